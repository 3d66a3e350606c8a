"""IMerge: parameter-server gradient synchronisation for PyTorch over MPI.

Typical use (Horovod style; ``import imerge_hooks as hvd`` runs Horovod scripts, see
docs/compatibility.md)::

    import imerge_hooks as imh
    imh.init()                       # server ranks serve here and exit when training ends
    opt = imh.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    imh.broadcast_parameters(model.state_dict(), root_rank=0)
    loss = imh.allreduce(loss, name="loss")  # tensor collectives over the workers only
"""

from __future__ import annotations

from .config import SCHEDULES, Config
from .ddp import IMergeHookState, ps_hook
from .errors import (
    HorovodInternalError,
    HostsUpdatedInterrupt,
    IMergeArgumentError,
    IMergeConfigError,
    IMergeError,
    IMergeHostsUpdated,
    IMergeMismatchError,
    IMergeTimeoutError,
    IMergeUsageError,
)
from .horovod_api import (
    Adasum,
    Average,
    Max,
    Min,
    Product,
    ReduceOp,
    Sum,
    add_process_set,
    allgather,
    allgather_async,
    allgather_object,
    allreduce,
    allreduce_,
    allreduce_async,
    allreduce_async_,
    alltoall,
    alltoall_async,
    barrier,
    broadcast,
    broadcast_,
    broadcast_async,
    broadcast_async_,
    ccl_built,
    cross_rank,
    cross_size,
    cuda_built,
    ddl_built,
    global_process_set,
    gloo_built,
    gloo_enabled,
    grouped_allgather,
    grouped_allgather_async,
    grouped_allreduce,
    grouped_allreduce_,
    grouped_allreduce_async,
    grouped_allreduce_async_,
    grouped_reducescatter,
    grouped_reducescatter_async,
    init,
    is_homogeneous,
    is_initialized,
    join,
    mpi_built,
    mpi_enabled,
    mpi_threads_supported,
    nccl_built,
    poll,
    reducescatter,
    reducescatter_async,
    remove_process_set,
    rocm_built,
    sparse_allreduce_async,
    start_timeline,
    stop_timeline,
    synchronize,
)
from .layout import Compression, Compressor, compression_name
from .optimizer import DistributedOptimizer
from .runtime import shutdown, worker_group
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
    "Adasum",
    "Average",
    "Compression",
    "Compressor",
    "Config",
    "DistributedOptimizer",
    "HorovodInternalError",
    "HostsUpdatedInterrupt",
    "IMergeArgumentError",
    "IMergeConfigError",
    "IMergeError",
    "IMergeHookState",
    "IMergeHostsUpdated",
    "IMergeMismatchError",
    "IMergeTimeoutError",
    "IMergeUsageError",
    "Max",
    "Min",
    "Product",
    "ReduceOp",
    "SCHEDULES",
    "Sum",
    "add_process_set",
    "allgather",
    "allgather_async",
    "allgather_object",
    "allreduce",
    "allreduce_",
    "allreduce_async",
    "allreduce_async_",
    "alltoall",
    "alltoall_async",
    "barrier",
    "broadcast",
    "broadcast_",
    "broadcast_async",
    "broadcast_async_",
    "broadcast_object",
    "broadcast_optimizer_state",
    "broadcast_parameters",
    "ccl_built",
    "compression_name",
    "cross_rank",
    "cross_size",
    "cuda_built",
    "ddl_built",
    "global_process_set",
    "gloo_built",
    "gloo_enabled",
    "grouped_allgather",
    "grouped_allgather_async",
    "grouped_allreduce",
    "grouped_allreduce_",
    "grouped_allreduce_async",
    "grouped_allreduce_async_",
    "grouped_reducescatter",
    "grouped_reducescatter_async",
    "init",
    "is_homogeneous",
    "is_initialized",
    "is_server",
    "join",
    "local_rank",
    "local_size",
    "mpi_built",
    "mpi_enabled",
    "mpi_threads_supported",
    "nccl_built",
    "num_servers",
    "poll",
    "ps_hook",
    "rank",
    "reducescatter",
    "reducescatter_async",
    "remove_process_set",
    "rocm_built",
    "shutdown",
    "size",
    "sparse_allreduce_async",
    "start_timeline",
    "stop_timeline",
    "synchronize",
    "worker_group",
]
