"""Broadcast model parameters, optimizer state and objects from one worker to all (over MPI)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch

from . import runtime
from .errors import IMergeUsageError
from .horovod_api import check_process_set


def _check_root(root_rank: Any, what: str) -> None:
    """``root_rank`` must be a worker rank (checked on every worker alike before any message)."""
    topo = runtime.topology()
    if isinstance(root_rank, bool) or not isinstance(root_rank, int) or not 0 <= root_rank < topo.num_workers:
        raise IMergeUsageError(f"IMerge worker {topo.worker_rank}: {what}: root_rank {root_rank!r} is not a worker "
                               f"rank (0 .. {topo.num_workers - 1})")


def _named(params: Mapping[str, torch.Tensor] | Iterable[Any]) -> list[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` pairs of a state_dict, named_parameters() or a plain list of tensors."""
    if isinstance(params, Mapping):
        return list(params.items())
    return [item if isinstance(item, tuple) else (f"params[{i}]", item) for i, item in enumerate(params)]


def broadcast_parameters(params: Mapping[str, torch.Tensor] | Iterable[Any], root_rank: int = 0) -> None:
    """Overwrite every worker's tensors with ``root_rank``'s, in place.

    ``params`` is a ``state_dict()``, ``named_parameters()`` or a list of tensors
    (``list(model.parameters())``); names (positions for a list) must match across workers.
    The root's tensors go as one object with a deadline (``runtime.collective``), so a worker
    that never calls this is named instead of leaving the others waiting.
    """
    topo = runtime.topology()
    _check_root(root_rank, "broadcast_parameters")
    items = _named(params)
    if topo.num_workers == 1:
        return
    signature = [(name, tuple(t.shape), str(t.dtype)) for name, t in items]
    mine = [t.detach().to("cpu", copy=True) for _, t in items] if topo.worker_rank == root_rank else None
    root_signature, values = runtime.collective(topo.worker_comm, "bcast", (signature, mine),
                                                f"the parameters of worker {root_rank}", root=root_rank)
    if root_signature != signature:
        diff = next((f"{a} vs {b}" for a, b in zip(signature, root_signature) if a != b),
                    f"{len(signature)} tensors vs {len(root_signature)}")
        raise ValueError(f"IMerge worker {topo.worker_rank}: broadcast_parameters: tensors differ from worker "
                         f"{root_rank}'s (this worker vs root: {diff})")
    if topo.worker_rank != root_rank:
        with torch.no_grad():
            for (_, tensor), value in zip(items, values):
                tensor.copy_(value)


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root_rank: int = 0, model: Any = None) -> None:
    """Give every worker ``root_rank``'s optimizer state (e.g. after loading a checkpoint on root).

    ``model`` (Horovod's, to find sparse parameters) is not needed: the whole state dict goes.
    """
    topo = runtime.topology()
    _check_root(root_rank, "broadcast_optimizer_state")
    if topo.num_workers == 1:
        return
    runtime.flush_all("broadcast_optimizer_state()")
    state: Any = optimizer.state_dict() if topo.worker_rank == root_rank else None
    state = runtime.collective(topo.worker_comm, "bcast", state, f"the optimizer state of worker {root_rank}",
                               root=root_rank)
    if topo.worker_rank != root_rank:
        optimizer.load_state_dict(state)


def broadcast_object(obj: Any, root_rank: int = 0, name: str | None = None, process_set: Any = None) -> Any:
    """Any picklable object from ``root_rank`` to every worker (``name`` names it in errors)."""
    check_process_set(process_set, "broadcast_object")
    _check_root(root_rank, "broadcast_object")
    what = f"object {name!r}" if name else "an object"
    return runtime.collective(runtime.topology().worker_comm, "bcast", obj, f"{what} from worker {root_rank}",
                              root=root_rank)
