"""IMerge: parameter-server gradient synchronisation for PyTorch over MPI.

Typical use (Horovod style)::

    import imerge_hooks as imh
    imh.init()                       # server ranks serve here and exit when training ends
    opt = imh.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    imh.broadcast_parameters(model.state_dict(), root_rank=0)
"""

from __future__ import annotations

from .config import SCHEDULES, Config
from .ddp import IMergeHookState, ps_hook
from .errors import IMergeConfigError, IMergeError, IMergeMismatchError, IMergeTimeoutError, IMergeUsageError
from .layout import Compression
from .optimizer import DistributedOptimizer
from .runtime import init, join, shutdown, worker_group
from .state_broadcast import broadcast_object, broadcast_optimizer_state, broadcast_parameters

__version__ = "0.1.0"


def is_server() -> bool:
    """True on parameter-server ranks (user code after ``init()`` normally never sees this)."""
    from . import runtime

    return runtime.topology().is_server


def rank() -> int:
    """This worker's rank among the workers (0 .. size()-1)."""
    from . import runtime

    return runtime.topology().worker_rank


def size() -> int:
    """Number of workers (servers not counted)."""
    from . import runtime

    return runtime.topology().num_workers


def local_rank() -> int:
    """This worker's rank among the workers on its host."""
    from . import runtime

    return runtime.topology().local_rank


def local_size() -> int:
    """Number of workers on this host."""
    from . import runtime

    return runtime.topology().local_size


def num_servers() -> int:
    """Number of parameter-server ranks."""
    from . import runtime

    return runtime.topology().num_servers


__all__ = [
    "Compression",
    "Config",
    "DistributedOptimizer",
    "IMergeConfigError",
    "IMergeError",
    "IMergeHookState",
    "IMergeMismatchError",
    "IMergeTimeoutError",
    "IMergeUsageError",
    "SCHEDULES",
    "broadcast_object",
    "broadcast_optimizer_state",
    "broadcast_parameters",
    "init",
    "is_server",
    "join",
    "local_rank",
    "local_size",
    "num_servers",
    "ps_hook",
    "rank",
    "shutdown",
    "size",
    "worker_group",
]
