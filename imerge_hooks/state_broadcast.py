"""Broadcast model parameters and optimizer state from one worker to all (over MPI)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch

from . import runtime


def broadcast_parameters(params: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
                         root_rank: int = 0) -> None:
    """Overwrite every worker's tensors with ``root_rank``'s, in place.

    ``params`` is a ``state_dict()`` or ``named_parameters()``; names must match across workers.
    The root's tensors go as one object with a deadline (``runtime.collective``), so a worker
    that never calls this is named instead of leaving the others waiting.
    """
    topo = runtime.topology()
    items = list(params.items()) if isinstance(params, Mapping) else list(params)
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


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root_rank: int = 0) -> None:
    """Give every worker ``root_rank``'s optimizer state (e.g. after loading a checkpoint on root)."""
    topo = runtime.topology()
    if topo.num_workers == 1:
        return
    runtime.flush_all()
    state: Any = optimizer.state_dict() if topo.worker_rank == root_rank else None
    state = runtime.collective(topo.worker_comm, "bcast", state, f"the optimizer state of worker {root_rank}",
                               root=root_rank)
    if topo.worker_rank != root_rank:
        optimizer.load_state_dict(state)


def broadcast_object(obj: Any, root_rank: int = 0) -> Any:
    """Any picklable object from ``root_rank`` to every worker."""
    return runtime.collective(runtime.topology().worker_comm, "bcast", obj, f"an object from worker {root_rank}",
                              root=root_rank)
