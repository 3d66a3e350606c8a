"""Broadcast model parameters and optimizer state from one worker to all (over MPI)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch

from . import runtime
from .transport import as_mpi_buffer


def broadcast_parameters(params: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
                         root_rank: int = 0) -> None:
    """Overwrite every worker's tensors with ``root_rank``'s, in place.

    ``params`` is a ``state_dict()`` or ``named_parameters()``; names must match across workers.
    """
    topo = runtime.topology()
    items = list(params.items()) if isinstance(params, Mapping) else list(params)
    if topo.num_workers == 1:
        return
    comm = topo.worker_comm
    signature = [(name, tuple(t.shape), str(t.dtype)) for name, t in items]
    root_signature = comm.bcast(signature, root=root_rank)
    if root_signature != signature:
        diff = next((f"{a} vs {b}" for a, b in zip(signature, root_signature) if a != b),
                    f"{len(signature)} tensors vs {len(root_signature)}")
        raise ValueError(f"IMerge worker {topo.worker_rank}: broadcast_parameters: tensors differ from worker "
                         f"{root_rank}'s (this worker vs root: {diff})")
    with torch.no_grad():
        for _, tensor in items:
            host = tensor.detach()
            if host.device.type != "cpu" or not host.is_contiguous():
                host = host.to("cpu", copy=True).contiguous()
            comm.Bcast(as_mpi_buffer(host), root=root_rank)
            if host is not tensor:
                tensor.copy_(host)


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root_rank: int = 0) -> None:
    """Give every worker ``root_rank``'s optimizer state (e.g. after loading a checkpoint on root)."""
    topo = runtime.topology()
    if topo.num_workers == 1:
        return
    runtime.flush_all()
    state: Any = optimizer.state_dict() if topo.worker_rank == root_rank else None
    state = topo.worker_comm.bcast(state, root=root_rank)
    if topo.worker_rank != root_rank:
        optimizer.load_state_dict(state)


def broadcast_object(obj: Any, root_rank: int = 0) -> Any:
    """Any picklable object from ``root_rank`` to every worker."""
    return runtime.topology().worker_comm.bcast(obj, root=root_rank)
