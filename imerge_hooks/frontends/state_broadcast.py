"""Broadcast model parameters, optimizer state and objects from one worker to all (over MPI)."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch

from ..cluster import collectives, session
from ..cluster.failure import record_fatal, whoami
from ..core._mpi import MPI
from ..core.errors import IMergeTimeoutError, IMergeUsageError
from ..core.polling import DeadlineWait
from .process_api import check_process_set

_CHUNK_BYTES = 1 << 30  # one Ibcast per GiB: MPI counts are 32-bit


def _check_root(root_rank: Any, what: str) -> None:
    """``root_rank`` must be a worker rank (checked on every worker alike before any message)."""
    topo = session.topology()
    problem = collectives.root_problem(root_rank, topo.num_workers)
    if problem is not None:
        raise IMergeUsageError(f"IMerge worker {topo.worker_rank}: {what}: {problem}")


def _named(params: Mapping[str, torch.Tensor] | Iterable[Any]) -> list[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` pairs of a state_dict, named_parameters() or a plain list of tensors."""
    if isinstance(params, Mapping):
        return list(params.items())
    return [item if isinstance(item, tuple) else (f"params[{i}]", item) for i, item in enumerate(params)]


def broadcast_parameters(params: Mapping[str, torch.Tensor] | Iterable[Any], root_rank: int = 0) -> None:
    """Overwrite every worker's tensors with ``root_rank``'s, in place.

    ``params`` is a ``state_dict()``, ``named_parameters()`` or a list of tensors
    (``list(model.parameters())``); names (positions for a list) must match across workers.
    Every worker's table of names, shapes and dtypes (a digest of it) goes first as an object collective
    with a deadline (``collectives.collective``, a tree), so a worker that never calls this is named
    instead of leaving the others waiting, and a table that differs from the root's raises on every
    worker, naming the workers whose table differs (so a caught error leaves the workers in step); the
    bytes then go by MPI's own broadcast (``Ibcast``: O(log W) steps, pipelined for large messages),
    bounded by the same deadline.
    """
    topo = session.topology()
    _check_root(root_rank, "broadcast_parameters")
    items = _named(params)
    if topo.num_workers == 1:
        return
    signature = [(name, tuple(t.shape), str(t.dtype)) for name, t in items]
    digest = hashlib.sha1(repr(signature).encode()).hexdigest()
    digests = collectives.collective(topo.worker_comm, "allgather", digest,
                                     f"the parameters to broadcast from worker {root_rank}")
    differ = [w for w, d in enumerate(digests) if d != digests[root_rank]]
    if differ:  # every worker knows: the root's table goes to all, and each says how its own differs
        root_signature = collectives.collective(topo.worker_comm, "bcast", signature,
                                                f"the parameters of worker {root_rank}", root=root_rank)
        mine = next((f"{a} vs {b}" for a, b in zip(signature, root_signature) if a != b),
                    f"{len(signature)} tensors vs {len(root_signature)}") if topo.worker_rank in differ else None
        raise ValueError(f"IMerge worker {topo.worker_rank}: broadcast_parameters: the tensors of worker(s) {differ} "
                         f"differ from worker {root_rank}'s" + (f" (this worker vs root: {mine})" if mine else ""))
    broadcast_tensors([t for _, t in items], root_rank, f"the parameters of worker {root_rank}")


def broadcast_tensors(tensors: list[torch.Tensor], root_rank: int, what: str) -> None:
    """``root_rank``'s values into every worker's ``tensors`` (same shapes and dtypes everywhere, checked
    by the caller), through one host buffer and MPI ``Ibcast`` polled until the process's deadline."""
    topo = session.topology()
    sizes = [t.numel() * t.element_size() for t in tensors]
    total = sum(sizes)
    if total == 0:
        return
    if topo.worker_rank == root_rank:
        flat = torch.cat([t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
                          for t in tensors if t.numel()])
    else:
        flat = torch.empty(total, dtype=torch.uint8)
    buffer = flat.numpy()
    wait = DeadlineWait(session.config().timeout_s)
    for start in range(0, total, _CHUNK_BYTES):
        request = topo.worker_comm.Ibcast([buffer[start:start + _CHUNK_BYTES], MPI.BYTE], root=root_rank)
        while not request.Test():
            if wait.expired():
                raise record_fatal(IMergeTimeoutError(
                    f"{whoami()}: the broadcast of {what} ({total} bytes) did not complete within "
                    f"{wait.limit_s:.0f} s (a worker died or stopped during it)"))
            wait.idle()
        wait.reset()
    if topo.worker_rank == root_rank:
        return
    offset = 0
    with torch.no_grad():
        for tensor, n in zip(tensors, sizes):
            if n:
                part = flat[offset:offset + n]
                if offset % tensor.element_size():  # a view needs its element size's alignment
                    part = part.clone()
                value = part.view(tensor.dtype).view(tensor.shape)
                tensor.copy_(value)
            offset += n


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root_rank: int = 0, model: Any = None) -> None:
    """Give every worker ``root_rank``'s optimizer state (e.g. after loading a checkpoint on root).

    ``model`` (Horovod's, to find sparse parameters) is not needed: the whole state dict goes, its
    structure as an object collective and its tensors' bytes by ``broadcast_tensors``.
    """
    topo = session.topology()
    _check_root(root_rank, "broadcast_optimizer_state")
    if topo.num_workers == 1:
        return
    session.flush_all("broadcast_optimizer_state()")
    what = f"the optimizer state of worker {root_rank}"
    skeleton, tensors = None, []
    if topo.worker_rank == root_rank:
        skeleton = _split_tensors(optimizer.state_dict(), tensors)
    skeleton = collectives.collective(topo.worker_comm, "bcast", skeleton, what, root=root_rank)
    if topo.worker_rank != root_rank:
        tensors = [torch.empty(shape, dtype=getattr(torch, dtype)) for shape, dtype in _tensor_specs(skeleton)]
    broadcast_tensors(tensors, root_rank, what)
    if topo.worker_rank != root_rank:
        optimizer.load_state_dict(_join_tensors(skeleton, iter(tensors)))


class _TensorSlot(tuple):
    """Where a tensor stood in a broadcast structure: (shape, dtype name)."""


def _split_tensors(obj: Any, out: list[torch.Tensor]) -> Any:
    """``obj`` with every tensor replaced by a ``_TensorSlot`` (the tensors appended to ``out`` in order)."""
    if isinstance(obj, torch.Tensor):
        out.append(obj)
        return _TensorSlot((tuple(obj.shape), str(obj.dtype).replace("torch.", "")))
    if isinstance(obj, dict):
        return {k: _split_tensors(v, out) for k, v in obj.items()}
    if type(obj) in (list, tuple):  # other sequences (named tuples) travel as they are
        return type(obj)(_split_tensors(v, out) for v in obj)
    return obj


def _tensor_specs(obj: Any) -> list[tuple[tuple[int, ...], str]]:
    if isinstance(obj, _TensorSlot):
        return [tuple(obj)]
    if isinstance(obj, dict):
        return [spec for v in obj.values() for spec in _tensor_specs(v)]
    if type(obj) in (list, tuple):
        return [spec for v in obj for spec in _tensor_specs(v)]
    return []


def _join_tensors(obj: Any, tensors: Iterator[torch.Tensor]) -> Any:
    if isinstance(obj, _TensorSlot):
        return next(tensors)
    if isinstance(obj, dict):
        return {k: _join_tensors(v, tensors) for k, v in obj.items()}
    if type(obj) in (list, tuple):
        return type(obj)(_join_tensors(v, tensors) for v in obj)
    return obj


def broadcast_object(obj: Any, root_rank: int = 0, name: str | None = None, process_set: Any = None) -> Any:
    """Any picklable object from ``root_rank`` to every worker (``name`` names it in errors)."""
    check_process_set(process_set, "broadcast_object")
    _check_root(root_rank, "broadcast_object")
    what = f"object {name!r}" if name else "an object"
    return collectives.collective(session.topology().worker_comm, "bcast", obj, f"{what} from worker {root_rank}",
                              root=root_rank)
