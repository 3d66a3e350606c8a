"""Horovod's torch API on IMerge (``import imerge_hooks as hvd``): every check asserts on every worker.

Usage: python horovod_api.py [--lonely] [--uncaught-mismatch]   (under mpiexec with IMERGE_NUM_SERVERS; or one
process)

Inputs are seeded by worker rank, so each worker computes every worker's input and the expected
result locally. Each passed check prints ``PASS <name>``, the end ``ALL OK``. ``--lonely``: at
the end worker 0 runs an allreduce no other worker joins and must time out naming them (a fatal
error: the job then aborts at exit, by design). ``--uncaught-mismatch``: at the end worker 0 calls
``barrier()`` while the others broadcast an object, uncaught (the job must exit non-zero).
"""

from __future__ import annotations

import contextlib
import itertools
import sys
import time
import traceback
import warnings
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from common import say
from torch import nn

import imerge_hooks as hvd
from imerge_hooks.cluster import collectives, session
from imerge_hooks.core.errors import IMergeConfigError, IMergeMismatchError, IMergeTimeoutError, IMergeUsageError

try:
    hvd.init()
except SystemExit:  # what a test runner does (unittest catches SystemExit): a server must never get here
    say(session.topology().world_rank, "SERVER WENT ON")
    raise
R, W = hvd.rank(), hvd.size()
CHECKS = []


def check(fn):
    CHECKS.append(fn)
    return fn


def inp(key: int, rank: int, shape: tuple, dtype: torch.dtype = torch.float64, integers: bool = False):
    """Worker ``rank``'s input number ``key`` (any worker can compute it)."""
    g = torch.Generator().manual_seed(1000 * key + rank)
    values = torch.randint(-4, 5, shape, generator=g) if integers else torch.randn(shape, generator=g)
    return values.to(dtype)


def every(key: int, shape: tuple, dtype: torch.dtype = torch.float64, integers: bool = False) -> list:
    return [inp(key, r, shape, dtype, integers) for r in range(W)]


@contextlib.contextmanager
def expect(kind: type, *fragments: str) -> Iterator[None]:
    try:
        yield
    except kind as exc:
        text = str(exc)
        missing = [f for f in fragments if f not in text]
        assert not missing, f"{kind.__name__} message lacks {missing}: {text}"
    else:
        raise AssertionError(f"expected {kind.__name__}")


def same(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), (a, b)


def close(a: torch.Tensor, b: torch.Tensor, tol: float = 1e-12) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape and torch.allclose(a, b, rtol=tol, atol=tol), (a, b)


# ---------------------------------------------------------------------- information
@check
def info():
    assert hvd.is_initialized() and 0 <= R < W
    assert (hvd.local_rank(), hvd.local_size()) == (R, W)  # one host
    assert (hvd.cross_rank(), hvd.cross_size(), hvd.is_homogeneous()) == (0, 1, True)
    assert hvd.mpi_threads_supported() and hvd.mpi_enabled() and hvd.mpi_built()
    assert not (hvd.gloo_enabled() or hvd.gloo_built() or hvd.nccl_built() or hvd.rocm_built() or hvd.ddl_built())
    assert hvd.cuda_built() == torch.backends.cuda.is_built()
    assert hvd.global_process_set.size() == W and hvd.global_process_set.rank() == R
    with expect(IMergeConfigError, "process sets"):
        hvd.add_process_set([0])
    with expect(IMergeConfigError, "IMERGE_TIMELINE"):
        hvd.start_timeline("/tmp/x.json")


# ---------------------------------------------------------------------- allreduce
@check
def allreduce_ops():
    xs = every(1, (3, 4))
    close(hvd.allreduce(xs[R], name="avg"), sum(xs) / W)
    ints = every(2, (5,), torch.int64, integers=True)
    same(hvd.allreduce(ints[R], op=hvd.Sum), sum(ints))
    same(hvd.allreduce(ints[R], op=hvd.Min), torch.stack(ints).min(0).values)
    same(hvd.allreduce(ints[R], op=hvd.Max), torch.stack(ints).max(0).values)
    same(hvd.allreduce(ints[R], op=hvd.Product), torch.stack(ints).prod(0))
    same(hvd.allreduce(ints[R], op=hvd.Average), torch.div(sum(ints), W, rounding_mode="trunc"))
    floats = every(3, (2, 3), torch.float32, integers=True)  # exact in any summation order
    same(hvd.allreduce(floats[R], op=hvd.Sum, prescale_factor=2.0, postscale_factor=0.25),
         sum(2 * f for f in floats) * 0.25)
    for dtype in (torch.float16, torch.bfloat16):
        halves = [f.to(dtype) for f in floats]
        same(hvd.allreduce(halves[R], op=hvd.Sum), sum(f for f in floats).to(dtype))
    same(hvd.allreduce(torch.tensor(float(R)), op=hvd.Sum), torch.tensor(float(sum(range(W)))))
    same(hvd.allreduce(torch.zeros(0, 3)), torch.zeros(0, 3))
    with expect(IMergeConfigError, "Adasum", "not supported", "Average"):
        hvd.allreduce(xs[R], op=hvd.Adasum)


@check
def allreduce_average_alias_and_compression():
    floats = every(3, (2, 3), torch.float32, integers=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        same(hvd.allreduce(floats[R], average=False), sum(floats))
    assert any(issubclass(w.category, DeprecationWarning) and "average" in str(w.message) for w in caught)
    with expect(ValueError, "supersedes average"):
        hvd.allreduce(floats[R], average=True, op=hvd.Sum)
    squeezed = hvd.allreduce(floats[R], op=hvd.Sum, compression=hvd.Compression.fp16)
    same(squeezed, sum(floats))  # small integers survive float16


@check
def allreduce_in_place_async_and_handles():
    xs = every(4, (6,), integers=True)
    t = xs[R].clone()
    assert hvd.allreduce_(t, op=hvd.Sum, name="inplace") is t
    same(t, sum(xs))
    handle = hvd.allreduce_async(xs[R], op=hvd.Sum, name="async")
    assert hvd.poll(handle)
    same(hvd.synchronize(handle), sum(xs))
    assert hvd.synchronize(handle) is None  # as Horovod: an unknown handle gives None
    with expect(IMergeUsageError, "unknown handle"):
        hvd.poll(handle)
    t = xs[R].clone()
    handle = hvd.allreduce_async_(t, op=hvd.Max)
    assert hvd.poll(handle) and hvd.synchronize(handle) is t
    same(t, torch.stack(xs).max(0).values)


@check
def allreduce_autograd():
    x = inp(5, R, (3,)).requires_grad_()
    y = hvd.allreduce(x, op=hvd.Sum)
    (y * torch.arange(3.0, dtype=torch.float64)).sum().backward()
    same(x.grad, torch.arange(3.0, dtype=torch.float64) * W)  # the gradient is summed too


@check
def grouped_allreduce():
    a, b = every(6, (2, 2), integers=True), every(7, (3,), torch.int32, integers=True)
    got = hvd.grouped_allreduce([a[R], b[R]], op=hvd.Sum, name="group")
    same(got[0], sum(a))
    same(got[1], sum(b))
    tensors = [a[R].clone(), b[R].clone()]
    assert hvd.grouped_allreduce_(tensors, op=hvd.Sum) is not None
    same(tensors[0], sum(a))
    handle = hvd.grouped_allreduce_async([a[R], b[R]], op=hvd.Min)
    same(hvd.synchronize(handle)[1], torch.stack(b).min(0).values)


# ---------------------------------------------------------------------- allgather, broadcast
@check
def allgather():
    parts = [inp(8, r, (r + 1, 3)) for r in range(W)]  # first dims differ
    same(hvd.allgather(parts[R], name="rows"), torch.cat(parts))
    flags = [torch.tensor([r % 2 == 0] * (r + 1)) for r in range(W)]
    same(hvd.allgather(flags[R]), torch.cat(flags))
    halves = [p.to(torch.bfloat16) for p in parts]
    same(hvd.synchronize(hvd.allgather_async(halves[R])), torch.cat(halves))
    same(hvd.allgather(torch.tensor(R)), torch.arange(W))  # a scalar is one row
    x = parts[R].clone().requires_grad_()
    weights = torch.arange(float(torch.cat(parts).numel()), dtype=torch.float64).reshape(-1, 3)
    (hvd.allgather(x) * weights).sum().backward()
    offset = sum(r + 1 for r in range(R))
    same(x.grad, weights[offset:offset + R + 1])  # averaged over workers: every worker's weights agree
    if W > 1:
        with expect(IMergeMismatchError, "allgather", "'bad rows'", f"worker {W - 1}", "dtype"):
            hvd.allgather(parts[R].float() if R == W - 1 else parts[R], name="bad rows")


@check
def allgather_object():
    d = {"metric_val_1": R}
    if R == 1:
        d["metric_val_2"] = 42
    expected = [{"metric_val_1": r} for r in range(W)]
    if W > 1:
        expected[1] = {"metric_val_1": 1, "metric_val_2": 42}
    assert hvd.allgather_object(d) == expected
    assert hvd.allgather_object(R * 10, name="tens") == [10 * r for r in range(W)]


@check
def broadcast():
    xs = every(9, (2, 5))
    for root in (0, W - 1):
        got = hvd.broadcast(xs[R], root_rank=root, name=f"b{root}")
        same(got, xs[root])
        assert got is not xs[R]
    t = xs[R].clone()
    assert hvd.broadcast_(t, W - 1) is t
    same(t, xs[W - 1])
    t = xs[R].to(torch.bfloat16)
    assert hvd.synchronize(hvd.broadcast_async_(t, 0)) is t
    same(t, xs[0].to(torch.bfloat16))
    same(hvd.synchronize(hvd.broadcast_async(xs[R], root_rank=W - 1)), xs[W - 1])
    x = xs[R].clone().requires_grad_()
    hvd.broadcast(x, 0).sum().backward()
    same(x.grad, torch.ones_like(x) if R == 0 else torch.zeros_like(x))
    with expect(IMergeUsageError, "root_rank 7", "'far'", "worker 0"):
        hvd.broadcast(xs[R], root_rank=7, name="far")
    if W == 1:
        return
    with expect(IMergeMismatchError, "'wrong shape'", "worker 1", "shape"):
        hvd.broadcast(xs[R][:1] if R == 1 else xs[R], 0, name="wrong shape")
    with expect(IMergeMismatchError, "root_rank", "worker 1"):
        hvd.broadcast(xs[R], root_rank=1 if R == 1 else 0, name="roots")


@check
def mismatched_ops_and_names():
    if W == 1:
        return
    x = torch.ones(2)
    with expect(IMergeMismatchError, "worker 1", "'b'", "'a'", "same order"):
        hvd.allreduce(x, name="b" if R == 1 else "a")
    with expect(IMergeMismatchError, "worker 1", "allgather", "allreduce"):
        hvd.allgather(x, name="k") if R == 1 else hvd.allreduce(x, name="k")
    with expect(IMergeMismatchError, "dtypes", "'mm'", "worker 1"):
        hvd.allreduce(x.double() if R == 1 else x, name="mm")
    hvd.barrier()


@check
def collectives_know_what_they_are():
    """Two workers in different collectives both raise, naming both calls; no collective returns
    another's value, and the workers stay in step afterwards."""
    if W == 1:
        return
    with expect(IMergeMismatchError, "barrier()", "broadcast of object 'cfg' from worker 0",
                "same collectives in the same order"):
        hvd.barrier() if R == 0 else hvd.broadcast_object({"lr": 0.1}, root_rank=0, name="cfg")
    with expect(IMergeMismatchError, "allreduce of tensor 'x'", "barrier()"):
        hvd.allreduce(torch.ones(2), name="x") if R == 0 else hvd.barrier()
    # a broadcast's non-root workers send the root nothing but what they called: the root learns too
    with expect(IMergeMismatchError, "broadcast of object 'cfg' from worker 0", "allgather_object of 'cfg'"):
        hvd.broadcast_object(R, root_rank=0, name="cfg") if R == 0 else hvd.allgather_object(R, name="cfg")
    with expect(IMergeMismatchError, "from worker 0", "from worker 1"):
        hvd.broadcast_object(R, root_rank=0 if R == 0 else 1, name="roots")
    same(hvd.allreduce(torch.tensor(float(R)), op=hvd.Sum), torch.tensor(float(sum(range(W)))))  # in step


@check
def horovod_exception_names():
    """Horovod's exception names resolve, and what a failed collective raises is a HorovodInternalError."""
    assert hvd.HorovodInternalError is hvd.IMergeError and issubclass(hvd.HorovodInternalError, RuntimeError)
    assert issubclass(hvd.HostsUpdatedInterrupt, RuntimeError) and hvd.HostsUpdatedInterrupt(True).skip_sync
    caught = None
    try:
        hvd.allreduce(torch.ones(3 + (R if W > 1 else 1)), name="shapes differ")
    except hvd.HostsUpdatedInterrupt:
        raise AssertionError("IMerge never raises HostsUpdatedInterrupt") from None
    except hvd.HorovodInternalError as exc:
        caught = exc
    assert (caught is not None) == (W > 1), caught
    with expect(ValueError, "root_rank 9"):  # argument errors are ValueErrors, as Horovod's
        hvd.broadcast(torch.ones(1), root_rank=9)


# ---------------------------------------------------------------------- alltoall, reducescatter
@check
def alltoall():
    rows = [torch.arange(2 * W) + 100 * r for r in range(W)]
    same(hvd.alltoall(rows[R], name="even"), torch.cat([rows[j][2 * R:2 * R + 2] for j in range(W)]))
    splits = [[(r + j) % 3 for j in range(W)] for r in range(W)]
    data = [inp(10, r, (sum(splits[r]), 2)) for r in range(W)]

    def part(j: int) -> torch.Tensor:
        start = sum(splits[j][:R])
        return data[j][start:start + splits[j][R]]

    out, received = hvd.alltoall(data[R], splits=splits[R], name="uneven")
    same(out, torch.cat([part(j) for j in range(W)]))
    same(received, torch.tensor([splits[j][R] for j in range(W)], dtype=torch.int32))
    out, received = hvd.alltoall(data[R], splits=torch.tensor(splits[R], dtype=torch.int64))
    assert received.dtype == torch.int64 and received.tolist() == [splits[j][R] for j in range(W)]
    out, received = hvd.synchronize(hvd.alltoall_async(rows[R]))
    same(out, torch.cat([rows[j][2 * R:2 * R + 2] for j in range(W)]))
    with expect(IMergeUsageError, "'bad splits'", "worker 0", "splits"):
        hvd.alltoall(rows[R], splits=[1] * (W + 1) if R == 0 else None, name="bad splits")
    # argument errors are ValueErrors on every worker, as Horovod's (test_horovod_alltoall_*_error)
    with expect(ValueError, "'too many rows'", "worker 0", "summing to at most dim 0"):
        hvd.alltoall(rows[R], splits=[2 * W + 1] + [0] * (W - 1) if R == 0 else None,
                     name="too many rows")
    with expect(ValueError, "float32", "integers"):
        hvd.alltoall(rows[R], splits=torch.ones(W))
    if W > 1:
        with expect(ValueError, "not divisible"):
            hvd.alltoall(torch.ones(W + 1))
    out, received = hvd.alltoall(rows[R], splits=[1] * W)  # fewer rows than dim 0: the rest are not sent
    same(out, torch.stack([rows[j][R] for j in range(W)]))


@check
def reducescatter():
    n = 2 * W + 1
    xs = every(11, (n, 2), integers=True)
    rows = [n // W + (1 if r < n % W else 0) for r in range(W)]  # Horovod: the first ranks get one more
    start = sum(rows[:R])
    total = sum(xs)
    same(hvd.reducescatter(xs[R], op=hvd.Sum, name="rs"), total[start:start + rows[R]])
    close(hvd.reducescatter(xs[R]), total[start:start + rows[R]] / W)  # default: Average
    same(hvd.synchronize(hvd.reducescatter_async(xs[R], op=hvd.Sum, prescale_factor=2.0)),
         2 * total[start:start + rows[R]])
    with expect(IMergeUsageError, "scalar", "worker 0"):
        hvd.reducescatter(torch.tensor(1.0))


@check
def grouped_allgather_and_reducescatter():
    """Horovod's grouped_allgather / grouped_reducescatter: each tensor as its single op, agreed as one."""
    parts = [[inp(20, r, (r + 1, 2)), inp(21, r, (1, 3), torch.float32)] for r in range(W)]
    got = hvd.grouped_allgather(parts[R], name="gag")
    for i in range(2):
        same(got[i], torch.cat([parts[r][i] for r in range(W)]))
    got = hvd.synchronize(hvd.grouped_allgather_async(parts[R]))
    same(got[1], torch.cat([parts[r][1] for r in range(W)]))
    n = 2 * W + 1
    xs = [[inp(22, r, (n, 2), integers=True), inp(23, r, (W,), torch.int64, integers=True)] for r in range(W)]
    def mine(total: torch.Tensor) -> torch.Tensor:  # this worker's rows, split as Horovod does
        rows = [len(total) // W + (1 if r < len(total) % W else 0) for r in range(W)]
        return total[sum(rows[:R]):sum(rows[:R + 1])]

    totals = [sum(x[i] for x in xs) for i in range(2)]
    got = hvd.grouped_reducescatter(xs[R], op=hvd.Sum, name="grs")
    same(got[0], mine(totals[0]))
    same(got[1], mine(totals[1]))
    got = hvd.grouped_reducescatter(xs[R])  # default: Average (integers truncated)
    close(got[0], mine(totals[0]) / W)
    same(got[1], mine(torch.div(totals[1], W, rounding_mode="trunc")))
    got = hvd.synchronize(hvd.grouped_reducescatter_async(xs[R], op=hvd.Sum, prescale_factor=2.0))
    same(got[0], mine(2 * totals[0]))
    if W > 1:
        with expect(IMergeMismatchError, "grouped_reducescatter", "shapes", f"worker {W - 1}"):
            hvd.grouped_reducescatter([torch.ones(2 * W + (R == W - 1))], name="bad group")


@check
def sparse_allreduce():
    """Horovod's sparse_allreduce_async: indices and values allgathered; the callable handle's result
    equals the dense allreduce (test_async_sparse_allreduce)."""
    dense = [inp(30, r, (6, 3)) * (inp(31, r, (6, 1)) > 0.3) for r in range(W)]  # rows of zeros differ by worker
    for op, want in ((hvd.Average, sum(dense) / W), (hvd.Sum, sum(dense))):
        handle = hvd.sparse_allreduce_async(dense[R].to_sparse(), name=f"sparse {op.name}", op=op)
        got = handle()
        assert got.is_sparse
        close(got.to_dense(), want)
    with expect(ValueError, "sparse COO"):
        hvd.sparse_allreduce_async(dense[R], name="dense", op=hvd.Sum)


@check
def gradients_as_horovods():
    """reducescatter, alltoall, grouped allreduce and grouped allgather are differentiable, with
    Horovod's gradients (test_horovod_*_grad)."""
    for op, factor in ((hvd.Sum, W), (hvd.Average, 1)):
        x = inp(24, R, (2 * W, 3)).requires_grad_()
        out = hvd.reducescatter(x, op=op, prescale_factor=0.5)
        weights = [inp(25, r, (2, 3)) for r in range(W)]  # each worker's output gradient
        (out * weights[R]).sum().backward()
        same(x.grad, torch.cat(weights) * factor * 0.5)
    splits = [[(r + j) % 2 + 1 for j in range(W)] for r in range(W)]
    x = inp(26, R, (sum(splits[R]) + 1, 2)).requires_grad_()  # one row past the splits: not sent, zero gradient
    out, received = hvd.alltoall(x, splits=splits[R])
    (out * torch.arange(1.0, out.numel() + 1, dtype=out.dtype).reshape(out.shape)).sum().backward()
    assert x.grad[-1].abs().sum() == 0 and x.grad.shape == x.shape
    for j in range(W):  # the rows sent to worker j come back with the weights j gave them
        start = sum(splits[R][:j])
        offset = sum(splits[k][j] for k in range(R))  # where worker j received them
        weights = torch.arange(1.0, 2 * sum(splits[k][j] for k in range(W)) + 1, dtype=x.dtype).reshape(-1, 2)
        same(x.grad[start:start + splits[R][j]], weights[offset:offset + splits[R][j]])
    a, b = inp(27, R, (3,)).requires_grad_(), inp(28, R, (2, 2)).requires_grad_()
    ra, rb = hvd.grouped_allreduce([a, b], op=hvd.Sum)
    (ra * 2).sum().backward(retain_graph=True)
    rb.sum().backward()
    same(a.grad, torch.full((3,), 2.0 * W, dtype=torch.float64))
    same(b.grad, torch.full((2, 2), float(W), dtype=torch.float64))
    parts = [inp(29, r, (r + 1, 2)) for r in range(W)]
    x = parts[R].clone().requires_grad_()
    g, = hvd.grouped_allgather([x])
    weights = torch.arange(float(g.numel()), dtype=torch.float64).reshape(g.shape)
    (g * weights).sum().backward()
    offset = sum(r + 1 for r in range(R))
    same(x.grad, weights[offset:offset + R + 1])


# ---------------------------------------------------------------------- parameters, state, objects
def seeded_model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2)).double()


@check
def broadcast_parameters():
    reference = [p.detach().clone() for p in seeded_model(0).parameters()]
    for form in ("list", "state_dict", "named_parameters"):
        model = seeded_model(R)
        params = {"list": list(model.parameters()), "state_dict": model.state_dict(),
                  "named_parameters": model.named_parameters()}[form]
        hvd.broadcast_parameters(params, root_rank=0)
        for got, want in zip(model.parameters(), reference):
            same(got.detach(), want)
    model = seeded_model(R)
    hvd.broadcast_parameters(list(model.parameters()), root_rank=W - 1)
    for got, want in zip(model.parameters(), seeded_model(W - 1).parameters()):
        same(got.detach(), want.detach())
    obj = {"hello": 123, 0: [1, 2]} if R == 0 else {}
    assert hvd.broadcast_object(obj, root_rank=0, name="cfg") == {"hello": 123, 0: [1, 2]}
    with expect(IMergeUsageError, "root_rank -1"):
        hvd.broadcast_object(obj, root_rank=-1)


def make_optimizer(kind, params):
    return {"SGD": lambda: torch.optim.SGD(params, lr=0.2, momentum=0.9, weight_decay=0.1),
            "Adam": lambda: torch.optim.Adam(params, lr=0.2), "RMSprop": lambda: torch.optim.RMSprop(
                params, lr=0.2, momentum=0.9, centered=True), "Adagrad": lambda: torch.optim.Adagrad(params, lr=0.2)
            }[kind]()


def distributed(model: nn.Module, kind: str = "SGD", **kwargs) -> torch.optim.Optimizer:
    kwargs.setdefault("schedule", "wfbp")
    return hvd.DistributedOptimizer(make_optimizer(kind, model.parameters()),
                                    named_parameters=model.named_parameters(), **kwargs)


def backward(model: nn.Module, key: int, rank: int = R) -> None:
    x, y = inp(key, rank, (6, 4)), inp(key + 50, rank, (6, 2))
    F.mse_loss(model(x), y).backward()


@check
def broadcast_state():
    """Horovod's test_broadcast_state: one step, checkpoint on worker 0, fresh model and optimizer."""
    for kind in ("SGD", "Adam", "RMSprop", "Adagrad"):
        model = seeded_model(0)
        opt = distributed(model, kind)
        opt.zero_grad()
        backward(model, 12)
        opt.step()
        params = {k: v.clone() for k, v in model.state_dict().items()}
        state = optimizer_values(opt)
        saved = {"model": model.state_dict(), "optimizer": opt.state_dict()} if R == 0 else None
        opt.close()
        model = seeded_model(R + 1)
        opt = distributed(model, kind)
        if R == 0:
            model.load_state_dict(saved["model"])
            opt.load_state_dict(saved["optimizer"])
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        hvd.broadcast_optimizer_state(opt, root_rank=0, model=model)
        for k, v in model.state_dict().items():
            same(v, params[k])
        after = optimizer_values(opt)
        assert [k for k, _ in after] == [k for k, _ in state] and state, kind
        for (_, got), (_, want) in zip(after, state):
            if torch.is_tensor(want):
                same(got, want)
            else:
                assert got == want, (kind, got, want)
        opt.close()


def optimizer_values(opt: torch.optim.Optimizer) -> list:
    """(key, value) of every parameter's optimizer state, in order (Horovod's get_optimizer_param_values)."""
    state = opt.state_dict()["state"]
    return [(f"{i}.{k}", v.clone() if torch.is_tensor(v) else v) for i in sorted(state)
            for k, v in sorted(state[i].items())]


def gradients(opt: torch.optim.Optimizer, model: nn.Module, key: int, passes: int = 1) -> list[torch.Tensor]:
    opt.zero_grad()
    for p in range(passes):
        backward(model, key + p)
    opt.synchronize()
    grads = [p.grad.clone() for p in model.parameters()]
    with opt.skip_synchronize():
        opt.step()
    return grads


def local_average(key: int, passes: int = 1) -> list[torch.Tensor]:
    """What the averaged gradients must be: every worker's own, averaged (computed here)."""
    total = None
    for r in range(W):
        model = seeded_model(0)
        for p in range(passes):
            backward(model, key + p, r)
        grads = [p.grad for p in model.parameters()]
        total = grads if total is None else [a + b for a, b in zip(total, grads)]
    return [g / W for g in total]


class Probe(nn.Module):
    """Each gradient element comes from one worker (zeros from the others), so the servers' average
    is the same whatever order the pushes arrive in."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(3, 4, dtype=torch.float64))
        self.b = nn.Parameter(torch.zeros(2, dtype=torch.float64))

    def coefficients(self, rank: int) -> list[torch.Tensor]:
        values = [inp(13, rank, (3, 4)), inp(14, rank, (2,))]
        return [v * (torch.arange(v.numel()).reshape(v.shape) % W == rank) for v in values]

    def forward(self, rank: int) -> torch.Tensor:
        cw, cb = self.coefficients(rank)
        return (self.w * cw).sum() + (self.b * cb).sum()


@check
def optimizer_sum_versus_average():
    runs = {}
    for label, kwargs in (("average", {}), ("sum", {"op": hvd.Sum}), ("predivide", {"gradient_predivide_factor": 4.0})):
        model = Probe()
        opt = distributed(model, **kwargs)
        opt.zero_grad()
        model(R).backward()
        opt.synchronize()
        runs[label] = [p.grad.clone() for p in model.parameters()]
        with opt.skip_synchronize():
            opt.step()
        opt.close()
    totals = [sum(c) for c in zip(*(Probe().coefficients(r) for r in range(W)))]
    for avg, total, pre, want in zip(runs["average"], runs["sum"], runs["predivide"], totals):
        same(total, avg * W)  # op=Sum is the servers' average times size()
        same(pre, avg)  # gradient_predivide_factor keeps the average, as Horovod's
        close(total, want)
        close(avg, want / W)
    model = seeded_model(0)
    model = seeded_model(0)
    with expect(IMergeConfigError, "gradient_predivide_factor", "op != Average"):
        distributed(model, op=hvd.Sum, gradient_predivide_factor=2.0)
    with expect(IMergeConfigError, "gradient_predivide_factor", "> 0"):
        distributed(model, gradient_predivide_factor=0.0)
    with expect(IMergeConfigError, "Adasum", "Average"):
        distributed(model, op=hvd.Adasum)
    with expect(IMergeConfigError, "Min"):
        distributed(model, op=hvd.Min)
    with expect(IMergeConfigError, "groups", "planner"):
        distributed(model, groups=[[model[0].weight, model[0].bias]])
    with expect(IMergeConfigError, "groups", "planner"):
        distributed(model, num_groups=2)
    with expect(IMergeConfigError, "overlap"):
        distributed(model, op=hvd.Sum, overlap_forward=True)


@check
def frozen_integer_parameter_is_skipped():
    """Horovod's test_broadcast_state_no_grad."""

    class ModelNoGrad(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Parameter(torch.tensor([1, 3]).int(), requires_grad=False)
            self.b = nn.Parameter(inp(14, 0, (4,)))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.index_select(self.b, 0, self.a.long()) * x

    model = ModelNoGrad()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.001, momentum=0.9, nesterov=True,
                                                   weight_decay=1e-6),
                                   named_parameters=model.named_parameters(), schedule="wfbp")
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    model(inp(15, R, (2,))).sum().backward()
    opt.step()
    grad = opt.param_groups[0]["params"][1].grad
    assert opt.param_groups[0]["params"][0].grad is None
    same(hvd.broadcast(grad, root_rank=0), grad)
    close(grad, torch.zeros(4, dtype=torch.float64).index_add_(0, torch.tensor([1, 3]), sum(every(15, (2,))) / W))
    opt.close()


@check
def gradient_clipping_and_step_warning():
    """Horovod's test_gradient_clipping and test_synchronize_step_warning."""
    model = nn.Linear(1, 1)
    model.weight = nn.Parameter(torch.zeros(1, 1) + 0.5)
    model.bias = nn.Parameter(torch.zeros(1))
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(), schedule="wfbp")
    for warned in (False, True):
        opt.zero_grad()
        F.mse_loss(model(torch.ones(1, 1)), torch.ones(1, 1)).backward()
        opt.synchronize()
        prior = model.weight.grad.item()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)
        clipped = model.weight.grad.item()
        assert abs(prior) > abs(clipped)
        before = model.weight.detach().clone()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if warned:
                opt.step()
            else:
                with opt.skip_synchronize():
                    opt.step()
        messages = [str(w.message) for w in caught]
        if warned:
            assert len(messages) == 1 and "optimizer.step() called without optimizer.skip_synchronize()" in \
                messages[0], messages
        else:
            assert not messages, messages
        close(model.weight.detach(), before - 0.1 * torch.tensor([[clipped]]), 1e-6)  # the clipped gradient stepped
    opt.close()


@check
def names_are_checked():
    """Horovod's test_duplicate_names, test_missing_named_parameters, test_no_named_parameters."""
    net1, net2 = nn.Conv2d(1, 1, 1), nn.Conv2d(1, 1, 1)
    opt = torch.optim.SGD(itertools.chain(net1.parameters(), net2.parameters()), lr=0.1)
    with expect(ValueError, "twice"):
        hvd.DistributedOptimizer(opt, named_parameters=itertools.chain(net1.named_parameters(),
                                                                       net2.named_parameters()))
    model = nn.Sequential(nn.Conv2d(1, 4, 1), nn.Conv2d(4, 1, 1))
    with expect(ValueError, "named_parameters"):
        hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                 named_parameters=list(model.named_parameters())[0:1])
    with expect(ValueError, "tuples"):
        hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.parameters())
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), schedule="wfbp")
    model(torch.rand(1, 1, 4, 4)).sum().backward()
    opt.step()
    names = hvd.allgather_object(sorted(opt._imerge_engine.names))
    assert all(n == names[0] for n in names) and len(set(names[0])) == 4
    opt.close()


@check
def backward_passes_and_fp16_compression():
    model = seeded_model(0)
    opt = distributed(model, backward_passes_per_step=2)
    for got, want in zip(gradients(opt, model, 16, passes=2), local_average(16, passes=2)):
        close(got, want)
    opt.set_backward_passes_per_step(3)
    model.load_state_dict(seeded_model(0).state_dict())  # in place: the parameters stay the engine's
    for got, want in zip(gradients(opt, model, 17, passes=3), local_average(17, passes=3)):
        close(got, want)
    opt.close()
    for compression in (hvd.Compression.fp16, "fp16"):
        model = seeded_model(0).float()
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(),
                                       compression, schedule="wfbp")
        assert opt._imerge_engine.cfg.compression == "fp16"
        opt.zero_grad()
        x, y = inp(18, R, (6, 4), torch.float32), inp(68, R, (6, 2), torch.float32)
        F.mse_loss(model(x), y).backward()
        opt.synchronize()
        want = local_average(18)
        for p, w in zip(model.parameters(), want):
            assert p.grad.dtype == torch.float32
            assert torch.allclose(p.grad.double(), w, rtol=2e-3, atol=2e-3), (p.grad, w)
        with opt.skip_synchronize():
            opt.step()
        opt.close()
    with expect(IMergeConfigError, "custom"):
        distributed(seeded_model(0), compression=type("Mine", (), {"compress": None, "decompress": None}))


@check
def sparse_gradients():
    rows = [torch.tensor([[1, 2, 4], [4, 3, 2 + r]]) for r in range(W)]
    emb = nn.Embedding(10, 3, sparse=True)
    hvd.broadcast_parameters(emb.state_dict(), root_rank=0)
    start = emb.weight.detach().clone()
    opt = hvd.DistributedOptimizer(torch.optim.SparseAdam(list(emb.parameters()), lr=0.1),
                                   named_parameters=emb.named_parameters(), sparse_as_dense=True, schedule="wfbp")
    emb(rows[R]).sum().backward()
    opt.synchronize()
    dense = torch.zeros(10, 3)
    for r in range(W):
        dense.index_add_(0, rows[r].flatten(), torch.ones(rows[r].numel(), 3))
    close(emb.weight.grad, dense / W, 1e-6)
    with opt.skip_synchronize():
        opt.step()  # SparseAdam steps with a sparse gradient again
    moved = (emb.weight.detach() != start).any(1)
    assert moved.tolist() == (dense.sum(1) > 0).tolist()
    gathered = hvd.allgather(emb.weight.detach()[None])
    assert all(torch.equal(gathered[0], g) for g in gathered)
    opt.close()
    emb = nn.Embedding(10, 3, sparse=True)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(emb.parameters(), lr=0.1), named_parameters=emb.named_parameters(),
                                   schedule="wfbp")
    with expect(TypeError, "'weight'", "sparse", "sparse_as_dense=True", f"worker {R}"):
        emb(rows[R]).sum().backward()


@check
def add_param_group_after_wrapping():
    """BaseFinetuning's unfreeze_and_add_param_group: a group added after wrapping is averaged too,
    and zero_grad() clears its gradients."""
    model = seeded_model(0)
    head = model[2]
    opt = distributed(nn.Sequential(model[0]), "SGD")  # the first layer only
    opt.zero_grad()
    backward(model, 30)
    opt.step()
    opt.add_param_group({"params": list(head.parameters()), "lr": 0.05})
    for step in range(2):
        opt.zero_grad()
        assert all(p.grad is None for p in model.parameters()), step
        backward(model, 31 + step)
        opt.synchronize()
        want = _average_of_workers(model, 31 + step)
        for got, expected in zip([p.grad for p in model.parameters()], want):
            close(got, expected)
        with opt.skip_synchronize():
            opt.step()
    opt.close()


def _average_of_workers(model: nn.Module, key: int) -> list[torch.Tensor]:
    """Every worker's gradient at ``model``'s current parameters, averaged (computed here)."""
    total = None
    for r in range(W):
        copy = seeded_model(0)
        copy.load_state_dict(model.state_dict())
        backward(copy, key, r)
        grads = [p.grad for p in copy.parameters()]
        total = grads if total is None else [a + b for a, b in zip(total, grads)]
    return [g / W for g in total]


def lonely() -> None:
    """Worker 0 runs an allreduce nobody else joins: it must time out naming the others (fatal)."""
    if R == 0:
        collectives.configure(2.0)
        try:
            hvd.allreduce(torch.ones(1), name="lonely")
            say(R, "NO TIMEOUT")
        except IMergeTimeoutError as exc:
            say(R, "TIMEOUT", exc)


def uncaught_mismatch() -> None:
    """Worker 0 calls barrier() while the others broadcast an object: every worker raises, and the
    uncaught error ends the job non-zero (the excepthook aborts it)."""
    try:
        hvd.barrier() if R == 0 else hvd.broadcast_object("cfg", root_rank=0, name="last")
    except IMergeMismatchError as exc:
        say(R, "MISMATCH", exc)
        raise
    say(R, "NO MISMATCH")


@check
def single_process_job():
    """One process, no servers: every op returns the local value (averaging over one worker)."""
    if W > 1:
        return
    assert session.topology().num_servers == 0 and session.comm_thread() is None
    x = inp(19, 0, (4, 2))
    for got in (hvd.allreduce(x), hvd.allreduce(x, op=hvd.Sum), hvd.allgather(x), hvd.broadcast(x, 0),
                hvd.alltoall(x), hvd.reducescatter(x), hvd.grouped_allreduce([x])[0]):
        same(got, x)
    assert hvd.allgather_object("me") == ["me"] and hvd.broadcast_object("me") == "me"


def main() -> None:
    for fn in CHECKS:
        start = time.monotonic()
        try:
            fn()
        except BaseException:
            say(R, "FAIL", fn.__name__, traceback.format_exc().replace("\n", " | "))
            raise
        say(R, "PASS", fn.__name__, f"{time.monotonic() - start:.2f}s")
    hvd.barrier()
    say(R, "ALL OK", W, session.topology().num_servers)
    if "--lonely" in sys.argv:
        lonely()
    if "--uncaught-mismatch" in sys.argv:
        uncaught_mismatch()


main()
