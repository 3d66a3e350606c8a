"""The data movement of the tensor collectives on a torch.distributed group, for CUDA tensors (NCCL).

``horovod_api`` agrees on every op over MPI first (shapes, dtypes, arguments, and which workers
wait in ``join()``). Where every worker's tensors are CUDA tensors on its own GPU and the workers'
process group runs NCCL (``device_group``), the data then moves here, device to device, instead of
being staged through host memory for MPI. The functions below take the group explicitly and trust
the agreement: every rank calls them with the same shapes (after dim 0), dtypes and arguments.
Gathers, broadcasts and all-to-alls move the tensors' bytes (``uint8`` views), so any dtype goes;
reductions reduce in the tensor's own dtype (NCCL reduces 16-bit floats natively).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from ..cluster import session
from ..core.ops import ReduceOp

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

# What NCCL reduces (no int16 and no bool): other dtypes' reductions stay on the MPI path.
NCCL_REDUCIBLE = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.uint8, torch.int8,
                            torch.int32, torch.int64})


def workers_group() -> ProcessGroup | None:
    """The workers' torch.distributed group where it exists already (what ``worker_group()`` returns),
    else None. Never creates one: that is a collective, and this is asked on one worker at a time."""
    if not session.is_initialized() or not dist.is_available():
        return None
    if session.state.process_group is not None:
        return session.state.process_group
    topo = session.topology()
    if (dist.is_initialized() and dist.get_world_size() == topo.num_workers
            and dist.get_rank() == topo.worker_rank):
        return dist.group.WORLD  # the script's own default group over the workers: worker_group() adopts it
    return None


def is_nccl(group: ProcessGroup) -> bool:
    """Whether ``group`` runs NCCL (for CUDA tensors; ``"cpu:gloo,cuda:nccl"`` counts)."""
    try:
        backend = str(dist.get_backend(group))
    except (RuntimeError, ValueError):  # destroyed meanwhile (destroy_process_group): not usable
        return False
    return backend == "nccl" or "cuda:nccl" in backend


def on_this_gpu(tensor: Any) -> bool:
    """A dense CUDA tensor on this worker's current GPU (the one NCCL's communicator uses)."""
    return (isinstance(tensor, torch.Tensor) and tensor.is_cuda and tensor.layout == torch.strided
            and tensor.device.index == torch.cuda.current_device())


def device_group(tensors: Sequence[Any], reduce: bool = False) -> ProcessGroup | None:
    """The group an op's data moves on without the host: the workers' NCCL group where every one of
    ``tensors`` is a CUDA tensor on this worker's GPU (and, for a reduction, ``reduce``, of a dtype
    NCCL reduces); else None (the op stages through the host for MPI).

    This is one worker's offer: the workers agree on it (all must offer) before the data moves.
    """
    if not tensors or not all(on_this_gpu(t) for t in tensors):
        return None
    if reduce and any(t.dtype not in NCCL_REDUCIBLE for t in tensors):
        return None
    group = workers_group()
    return group if group is not None and is_nccl(group) else None


_REDUCE_OPS = {ReduceOp.Average: "SUM", ReduceOp.Sum: "SUM", ReduceOp.Min: "MIN", ReduceOp.Max: "MAX",
               ReduceOp.Product: "PRODUCT"}


def _reduce_op(op: ReduceOp) -> Any:
    return getattr(dist.ReduceOp, _REDUCE_OPS[op])


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``'s bytes as a flat uint8 view (of ``tensor`` itself when it is contiguous, else of a copy)."""
    return tensor.contiguous().reshape(-1).view(torch.uint8)


def _row_bytes(tensor: torch.Tensor) -> int:
    return math.prod(tensor.shape[1:]) * tensor.element_size()


def allreduce(buffers: Sequence[torch.Tensor], op: ReduceOp, group: ProcessGroup) -> None:
    """Reduce each of ``buffers`` (contiguous) in place over ``group``.

    ``Average`` sums: the caller divides, as on the MPI path (so integer averages truncate alike)."""
    for buffer in buffers:
        if buffer.numel():
            dist.all_reduce(buffer, op=_reduce_op(op), group=group)


def allgather(tensor: torch.Tensor, rows: Sequence[int], group: ProcessGroup) -> torch.Tensor:
    """Every rank's ``tensor`` (``rows[r]`` rows on rank r) concatenated along dim 0 in rank order.

    NCCL gathers equal parts: ranks with fewer rows pad theirs to the most, and the pads are dropped."""
    out_shape = (sum(rows), *tensor.shape[1:])
    row_bytes, most = _row_bytes(tensor), max(rows)
    part = most * row_bytes
    if part == 0:
        return tensor.new_empty(out_shape)
    send = _bytes(tensor)
    if send.numel() < part:
        send = torch.cat([send, send.new_zeros(part - send.numel())])
    gathered = send.new_empty(len(rows) * part)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # the newer name where it exists
    gather(gathered, send, group=group)
    if any(r != most for r in rows):
        gathered = torch.cat([gathered[i * part:i * part + r * row_bytes] for i, r in enumerate(rows)])
    return gathered.view(tensor.dtype).reshape(out_shape)


def broadcast(buffer: torch.Tensor, root: int, group: ProcessGroup) -> None:
    """``root``'s ``buffer`` (contiguous) into every rank's, in place (``root``: a rank of ``group``)."""
    if not buffer.is_contiguous():
        raise ValueError("IMerge internal: broadcast needs a contiguous buffer")
    if buffer.numel():
        dist.broadcast(_bytes(buffer), src=dist.get_global_rank(group, root), group=group)


def alltoall(tensor: torch.Tensor, send_rows: Sequence[int], recv_rows: Sequence[int],
             group: ProcessGroup) -> torch.Tensor:
    """Rows ``send_rows[j]`` of ``tensor`` (in order, from row 0) to rank j; the rows received, by sender
    (``recv_rows[j]`` from rank j). Rows past ``sum(send_rows)`` are not sent."""
    out = tensor.new_empty((sum(recv_rows), *tensor.shape[1:]))
    row_bytes = _row_bytes(tensor)
    if row_bytes == 0:
        return out
    send = _bytes(tensor.narrow(0, 0, sum(send_rows)))
    dist.all_to_all_single(_bytes(out), send, [r * row_bytes for r in recv_rows], [r * row_bytes for r in send_rows],
                           group=group)
    return out


def reducescatter(tensor: torch.Tensor, rows: Sequence[int], rank: int, op: ReduceOp,
                  group: ProcessGroup) -> torch.Tensor:
    """``tensor`` reduced over ``group``, split along dim 0 in rank order (``rows[r]`` rows to rank r,
    summing to dim 0); ``rank``'s part. ``Average`` sums: the caller divides.

    NCCL scatters equal parts: uneven parts are padded to the largest, and the pads are dropped."""
    most = max(rows)
    out = tensor.new_empty((most, *tensor.shape[1:]))
    if out.numel() == 0:
        return tensor.new_empty((rows[rank], *tensor.shape[1:]))
    if all(r == most for r in rows):
        send = tensor.contiguous()
    else:
        send = tensor.new_zeros((len(rows) * most, *tensor.shape[1:]))
        start = 0
        for r, n in enumerate(rows):
            send[r * most:r * most + n] = tensor[start:start + n]
            start += n
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor  # (the newer name)
    scatter(out, send, op=_reduce_op(op), group=group)
    return out.narrow(0, 0, rows[rank])
