"""The tensor collectives' device path (``imerge_hooks.frontends.device_collectives``) against their host path (MPI),
op by op: the cases ``device_path.py`` (gloo, CPU tensors) and ``tests/gpu/scripts/nccl_collectives.py``
(NCCL, CUDA tensors) run. Imported by those scripts, after ``init()`` and ``worker_group()``.

Each case runs twice on every worker: on the host path (``device_group`` answers None) and on the
device path (``route``: the real ``device_group`` with NCCL; on CPU ``on_this_gpu`` and ``is_nccl``
are made to say yes, so the gloo group takes the device path's calls). The results must be equal
(values, dtype, shape, device), and the device path must not stage any tensor through the host
(``horovod_api._host`` is counted). Inputs are small integers, exact in any dtype and order.
"""

from __future__ import annotations

import contextlib
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

import imerge_hooks as hvd
from imerge_hooks.frontends import device_collectives, horovod_api

staged = [0]  # calls of horovod_api._host: a tensor staged through the host
_host = horovod_api._host


def _counted_host(tensor: torch.Tensor) -> torch.Tensor:
    staged[0] += 1
    return _host(tensor)


horovod_api._host = _counted_host


@contextlib.contextmanager
def route(path: str, force: bool) -> Iterator[None]:
    """Ops in this block offer the ``path`` ("host" or "device"); ``force``: CPU tensors count as on this
    worker's GPU and any group as NCCL (to drive the device path with gloo)."""
    saved = device_collectives.device_group, device_collectives.on_this_gpu, device_collectives.is_nccl
    if path == "host":
        device_collectives.device_group = lambda tensors, reduce=False: None
    elif force:
        device_collectives.on_this_gpu = lambda t: isinstance(t, torch.Tensor) and t.layout == torch.strided
        device_collectives.is_nccl = lambda group: True
    try:
        yield
    finally:
        device_collectives.device_group, device_collectives.on_this_gpu, device_collectives.is_nccl = saved


def same(a: Any, b: Any, where: str) -> None:
    """Equal results: values, dtype, shape and device, recursively through lists and tuples."""
    if isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), (where, a, b)
        for i, (x, y) in enumerate(zip(a, b)):
            same(x, y, f"{where}[{i}]")
    elif isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), (where, a, b)
        assert (a.dtype, a.shape, a.device) == (b.dtype, b.shape, b.device), (where, a, b)
        assert torch.equal(a, b), (where, a, b)
    else:
        assert a == b, (where, a, b)


@dataclass
class Case:
    name: str
    run: Callable[[], Any]
    on_device: bool = True  # the device path takes it (int16 reductions stay on MPI)


def cases(rank: int, size: int, device: torch.device) -> list[Case]:
    """Every op's case for worker ``rank`` of ``size`` (size >= 2), with inputs on ``device``."""

    def inp(key: int, shape: tuple, dtype: torch.dtype = torch.float32, low: int = -4, high: int = 5) -> torch.Tensor:
        g = torch.Generator().manual_seed(1000 * key + rank)
        return torch.randint(low, high, shape, generator=g).to(dtype).to(device)

    def in_place(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> list:
        out = fn(x)
        assert out is x
        return [x]

    def grad(fn: Callable[[torch.Tensor], Any], x: torch.Tensor) -> list:
        x = x.clone().requires_grad_()
        y = fn(x)
        y = y[0] if isinstance(y, tuple) else y
        weights = torch.arange(1, y.numel() + 1, dtype=y.dtype, device=y.device).reshape(y.shape)
        (y * weights).sum().backward()
        return [y.detach(), x.grad]

    i32, i64 = torch.int32, torch.int64
    uneven = inp(20, (rank + 1, 3))  # rank r has r + 1 rows
    root = 1
    data = inp(30, (6, 2), i64)
    splits = [[1 + (rank + j) % 2 for j in range(size)], [2] * size][rank % 2]  # sums below 6: the rest stays
    rows = inp(31, (2 * size, 3))
    odd = inp(40, (2 * size + 1, 3))  # rows % size != 0: the first worker gets one row more
    return [
        Case("allreduce Average", lambda: hvd.allreduce(inp(1, (3, 4)), name="avg")),
        Case("allreduce Sum", lambda: hvd.allreduce(inp(2, (5,), i64), op=hvd.Sum)),
        Case("allreduce Min", lambda: hvd.allreduce(inp(2, (5,), i64), op=hvd.Min)),
        Case("allreduce Max", lambda: hvd.allreduce(inp(3, (2, 3)), op=hvd.Max)),
        Case("allreduce Product", lambda: hvd.allreduce(inp(4, (7,), i32), op=hvd.Product)),
        Case("allreduce prescale/postscale", lambda: hvd.allreduce(inp(5, (2, 3)), op=hvd.Sum, prescale_factor=2.0,
                                                                   postscale_factor=0.25)),
        Case("allreduce Average with factors", lambda: hvd.allreduce(inp(5, (4,)), prescale_factor=4.0,
                                                                     postscale_factor=0.5)),
        Case("allreduce integer Average", lambda: hvd.allreduce(inp(6, (9,), i64, -9, 10), op=hvd.Average)),
        Case("allreduce int32 Average scaled", lambda: hvd.allreduce(inp(6, (9,), i32, -9, 10), prescale_factor=3.0,
                                                                     postscale_factor=0.5)),
        Case("allreduce float16 Average", lambda: hvd.allreduce(inp(7, (6,), torch.float16))),
        Case("allreduce bfloat16 Sum", lambda: hvd.allreduce(inp(7, (6,), torch.bfloat16), op=hvd.Sum)),
        Case("allreduce scalar", lambda: hvd.allreduce(torch.tensor(float(rank), device=device), op=hvd.Sum)),
        Case("allreduce int16 (host path)", lambda: hvd.allreduce(inp(8, (4,), torch.int16), op=hvd.Sum),
             on_device=False),
        Case("allreduce_", lambda: in_place(lambda x: hvd.allreduce_(x, op=hvd.Sum, name="inplace"), inp(9, (6,)))),
        Case("allreduce non-contiguous", lambda: hvd.allreduce(inp(10, (4, 3)).t(), op=hvd.Sum)),
        Case("allreduce_async", lambda: hvd.synchronize(hvd.allreduce_async(inp(11, (3,)), op=hvd.Max))),
        Case("allreduce autograd", lambda: grad(lambda x: hvd.allreduce(x, op=hvd.Sum, prescale_factor=2.0),
                                                inp(12, (2, 2)))),
        Case("grouped_allreduce", lambda: hvd.grouped_allreduce([inp(13, (3,)), inp(14, (2, 2), i64)], op=hvd.Sum)),
        Case("grouped_allreduce_", lambda: hvd.grouped_allreduce_([inp(13, (3,)), inp(14, (2, 2))], op=hvd.Min)),
        Case("allgather uneven rows", lambda: hvd.allgather(uneven, name="rows")),
        Case("allgather uneven int64", lambda: hvd.allgather(inp(21, (2 * rank + 1,), i64))),
        Case("allgather bool", lambda: hvd.allgather(inp(22, (rank + 2, 2), torch.bool, 0, 2))),
        Case("allgather int16", lambda: hvd.allgather(inp(23, (rank + 1, 2), torch.int16))),
        Case("allgather scalar", lambda: hvd.allgather(torch.tensor(rank, device=device))),
        Case("allgather empty rows", lambda: hvd.allgather(inp(24, (0 if rank == 0 else 2, 3)))),
        Case("grouped_allgather", lambda: hvd.grouped_allgather([uneven, inp(25, (size - rank, 2), i32)])),
        Case("allgather_async", lambda: hvd.synchronize(hvd.allgather_async(uneven))),
        Case("broadcast from root 1", lambda: hvd.broadcast(inp(50, (3, 2)), root_rank=root, name="bcast")),
        Case("broadcast int16", lambda: hvd.broadcast(inp(51, (4,), torch.int16), root_rank=root)),
        Case("broadcast scalar", lambda: hvd.broadcast(torch.tensor(float(rank), device=device), root_rank=root)),
        Case("broadcast_", lambda: [hvd.broadcast_(inp(52, (5,), i64), root_rank=root)]),
        Case("broadcast autograd", lambda: grad(lambda x: hvd.broadcast(x, root_rank=root), inp(53, (3,)))),
        Case("alltoall even", lambda: hvd.alltoall(rows, name="even")),
        Case("alltoall splits", lambda: hvd.alltoall(data, splits=splits, name="uneven")),
        Case("alltoall tensor splits", lambda: hvd.alltoall(data, splits=torch.tensor(splits))),
        Case("alltoall_async", lambda: hvd.synchronize(hvd.alltoall_async(data, splits=splits))),
        Case("alltoall autograd", lambda: grad(lambda x: hvd.alltoall(x, splits=splits), inp(32, (6, 2)))),
        Case("reducescatter Sum", lambda: hvd.reducescatter(rows, op=hvd.Sum, name="rs")),
        Case("reducescatter uneven Average", lambda: hvd.reducescatter(odd)),
        Case("reducescatter Max", lambda: hvd.reducescatter(odd, op=hvd.Max)),
        Case("reducescatter factors", lambda: hvd.reducescatter(odd, op=hvd.Sum, prescale_factor=2.0,
                                                                postscale_factor=0.5)),
        Case("reducescatter integer Average", lambda: hvd.reducescatter(inp(41, (2 * size + 1,), i64, -9, 10))),
        Case("reducescatter_async", lambda: hvd.synchronize(hvd.reducescatter_async(odd, op=hvd.Min))),
        Case("grouped_reducescatter", lambda: hvd.grouped_reducescatter([odd, inp(42, (size, 2), i64)], op=hvd.Sum)),
        Case("reducescatter autograd", lambda: grad(lambda x: hvd.reducescatter(x, op=hvd.Sum), odd)),
    ]


def run_cases(rank: int, size: int, device: torch.device, force: bool, say: Callable[..., None]) -> bool:
    """Every case on both paths; prints ``PASS <case>`` or ``FAIL <case> <why>``; whether all passed."""
    ok = True
    for case in cases(rank, size, device):
        try:
            with route("host", force):
                host = case.run()
            with route("device", force):  # both runs before any check: the workers stay in step
                before = staged[0]
                dev = case.run()
                moved = staged[0] - before
            if case.on_device:
                assert moved == 0, f"the device path staged {moved} tensor(s) through the host"
            else:
                assert moved > 0, "expected the host path"
            same(host, dev, case.name)
            say("PASS", case.name)
        except Exception:  # noqa: BLE001 - report every case; the launcher checks FAIL lines
            ok = False
            say("FAIL", case.name, traceback.format_exc().replace("\n", " | "))
    return ok


def join_and_mixed(rank: int, size: int, device: torch.device, force: bool, say: Callable[..., None]) -> None:
    """While worker 0 waits in ``join()`` an allreduce goes over MPI (it answers there, adding zeros); a worker
    that does not offer the device path puts everyone on the host path."""
    x = torch.arange(4, dtype=torch.float32, device=device) + rank
    with route("device", force):
        before = staged[0]
        if rank == 0:
            hvd.join()
        else:
            got = hvd.allreduce(x, op=hvd.Sum, name="while.joined")
            hvd.join()
            assert staged[0] > before, "an allreduce while a worker waits in join() must go over MPI"
            same(got, x, "while joined")  # worker 0 added zeros
    say("PASS", "join")
    with route("device" if rank == 0 else "host", force):
        before = staged[0]
        got = hvd.allreduce(x, op=hvd.Sum, name="mixed")
        assert staged[0] > before, "a worker that offers no device path puts every worker on the host path"
        expected = sum(torch.arange(4, dtype=torch.float32, device=device) + r for r in range(size))
        same(got, expected, "mixed offers")
    say("PASS", "mixed offers")
