"""Horovod's ``horovod.torch`` tensor API over the workers: ``import imerge_hooks as hvd``.

The collectives run over the workers only (the parameter servers never see them). Each op first
agrees on every worker's shapes, dtypes and arguments with a deadline collective over
``topology().worker_comm`` (``collectives.collective``), so a missing worker is named instead of
waited for and a mismatch raises on every worker with the worker and tensor it concerns (a worker
in another op or name: IMergeMismatchError naming both calls). Then the data moves:

* on the device, where every worker offered it in the agreement: all of the op's tensors are CUDA
  tensors on the worker's GPU and the workers' torch.distributed group (``worker_group()``) exists
  and runs NCCL (``device_collectives.device_group``; reductions also need a dtype NCCL reduces,
  not int16). torch.distributed's collective on that group moves it GPU to GPU, in the tensors'
  own dtype (16-bit floats are reduced natively), bounded by the group's timeout (``timeout_s``
  where ``worker_group()`` created it) instead of IMerge's polling;
* else through host memory, by a non-blocking MPI collective over ``worker_comm`` polled with
  back-off until ``timeout_s``: CPU tensors as numpy views, CUDA tensors staged through ``.cpu()``
  and copied back to their device; 16-bit floats are reduced in float32. So do all ops while a
  worker waits in ``join()``: it answers over MPI.

Either way the semantics are the same (ops, factors, truncated integer averages, results in the
input's dtype and on its device, autograd, in-place variants).

A caught error leaves the workers in step (``_agreed``): an error a worker finds in its own
arguments is sent in the agreement, so every worker raises it; while a worker waits in ``join()``
it answers the agreement (every worker that called the op raises the same error, except for an
allreduce, to which it adds zeros as Horovod's joined ranks do); a failure between the agreement
and the end of the data's move, which the others wait for, ends the job naming the worker.

Differences from Horovod (see ``docs/compatibility.md``): ops are matched by call order, not
by name (every worker must issue the same ops in the same order; kinds and names are checked);
``*_async`` ops run eagerly, their handle's ``synchronize()`` returns the result and ``poll()``
is always True; only the global process set exists.
"""

from __future__ import annotations

import functools
import inspect
import itertools
import operator
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch

from ..cluster import collectives, session
from ..cluster.failure import abort, record_fatal, whoami
from ..cluster.topology import Topology
from ..core._mpi import MPI
from ..core.compression import Compression
from ..core.errors import (
    IMergeArgumentError,
    IMergeConfigError,
    IMergeError,
    IMergeMismatchError,
    IMergeTimeoutError,
    IMergeUsageError,
)
from ..core.ops import SUMMING_OPS, ReduceOp, reduce_op, resolve_op, summing_op
from ..core.polling import DeadlineWait
from . import device_collectives
from .process_api import check_process_set, global_process_set

_MPI_OPS = {ReduceOp.Average: "SUM", ReduceOp.Sum: "SUM", ReduceOp.Min: "MIN", ReduceOp.Max: "MAX",
            ReduceOp.Product: "PROD"}
_REDUCIBLE = (torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.uint8, torch.int8, torch.int16,
              torch.int32, torch.int64)
_unnamed = itertools.count()
_F = TypeVar("_F", bound=Callable[..., Any])


def _compressor(compression: Any) -> Any:
    """An object with Horovod's ``compress``/``decompress``; a name picks one of ``Compression``'s."""
    if isinstance(compression, str):
        found = getattr(Compression, compression, None)
        if found is None or not hasattr(found, "compress"):
            raise IMergeConfigError(f"IMerge: unknown compression {compression!r}; use none, fp16 or bf16")
        return found
    if not (hasattr(compression, "compress") and hasattr(compression, "decompress")):
        raise IMergeConfigError(f"IMerge: compression {compression!r} has no compress()/decompress()")
    return compression


# ---------------------------------------------------------------------- agreement and waiting
def _topology() -> Topology:
    topo = session.topology()
    if topo.is_server:
        raise IMergeUsageError(f"{whoami()}: tensor collectives run on workers only; servers serve in init()")
    return topo


def _label(kind: str, name: str | None) -> str:
    return name if name else f"{kind}.noname.{next(_unnamed)}"


def _call(kind: str, name: str | None) -> str:
    """How mismatch messages name an op: ``allreduce of tensor 'x'``, ``barrier()``."""
    if kind == "barrier":
        return "barrier()"
    if kind == "allgather_object":
        return f"allgather_object of {name!r}" if name else "allgather_object()"
    return f"{kind} of tensor {name!r}" if name else f"{kind} of an unnamed tensor"


# The error classes a worker's own failed argument check is raised with on every worker (``_agree``).
_SHARED_ERRORS = {cls.__name__: cls for cls in (
    ValueError, TypeError, AttributeError, NotImplementedError, RuntimeError, IMergeError, IMergeConfigError,
    IMergeArgumentError, IMergeUsageError, IMergeMismatchError)}
_agreements = 0  # agreements this worker entered (``_agreed`` tells an error before its op's agreement)
_moving: str | None = None  # the op whose data this worker moves after every worker agreed on it


def _agreed(kind: str, name_of: Callable[[str | None], str | None] | None = None) -> Callable[[_F], _F]:
    """Public op ``kind`` keeps the workers in step when it raises (the rule, written once).

    An error this worker raises before the op's agreement (its own checks of ``op``, the process
    set, the compression) is sent in that agreement instead (as ``_agree``'s ``problem``), so every
    worker raises it, with its class, and the next op starts in step. The agreement's name is the
    op's ``name`` argument (``name_of(name)`` where the first agreement names it otherwise). An
    error after the agreement, before the data moved (staging it on the host), leaves the others
    waiting for this worker's data: it ends the job at once, naming this worker and the op.
    """
    def wrap(fn: _F) -> _F:
        signature = inspect.signature(fn)

        @functools.wraps(fn)
        def run(*args: Any, **kwargs: Any) -> Any:
            global _moving
            entered, _moving = _agreements, None
            try:
                result = fn(*args, **kwargs)
            except Exception as error:
                moving, _moving = _moving, None
                if _agreements == entered and session.is_initialized():
                    try:
                        name = signature.bind(*args, **kwargs).arguments.get("name")
                    except TypeError:  # a call that does not fit: the others' name is unknown (a mismatch)
                        name = None
                    try:
                        _agree(kind, name_of(name) if name_of else name, {}, (),
                               problem=(type(error).__name__, str(error)))
                    except Exception as agreed:
                        raise agreed from error
                if moving is not None and not isinstance(error, IMergeTimeoutError):
                    abort(f"{whoami()}: {moving} failed on this worker after every worker had agreed on it, while "
                          f"the others wait for its data: {type(error).__name__}: {error}; aborting the job")
                raise
            _moving = None
            return result

        return run  # type: ignore[return-value]

    return wrap


def _agree(kind: str, name: str | None, meta: dict[str, Any], same: Sequence[str],
           problem: str | tuple[str, str] | None = None,
           joined: collectives.ZerosPart | None = None) -> tuple[str, list[dict[str, Any] | None]]:
    """Every worker's ``meta`` for this op, gathered with a deadline; raise on every worker alike if a
    worker ran another op or name (IMergeMismatchError from the collective, naming both calls),
    reported a ``problem`` (a str: a bad argument, IMergeArgumentError, a ValueError as Horovod's;
    (class name, message): its own check failed, that class, ``_agreed``), or differs from the
    first worker in a field of ``same``.

    Workers waiting in ``join()`` answer it (``collectives.answer_pending``): then every worker
    raises IMergeUsageError naming them, unless all offered the same ``joined`` part (an allreduce,
    to which the joined workers add zeros). Returns the op's label (its name, or a generated one)
    and the metas by worker rank (None for a joined worker).
    """
    global _agreements, _moving
    topo = _topology()
    label = _label(kind, name) if kind not in ("barrier", "allgather_object") else _call(kind, name)
    what = label if kind in ("barrier", "allgather_object") else f"{kind} of tensor {label!r}"
    _agreements += 1
    entries = collectives.collective(topo.worker_comm, "allgather", (meta, problem), what, call=_call(kind, name),
                                     joined_part=joined)
    where = f"{whoami()}: {what}"
    live = [(r, entry) for r, entry in enumerate(entries) if entry is not None]
    for r, (_, why) in live:
        if why is not None:
            raise _shared_error(f"{where}: worker {r}", why)
    first, (meta0, _) = live[0]
    for r, (m, _) in live:
        for field in same:
            if m[field] != meta0[field]:
                raise IMergeMismatchError(f"{where}: worker {r} has {field} {m[field]} but worker {first} has "
                                          f"{meta0[field]}")
    _moving = what
    return label, [entry[0] if entry is not None else None for entry in entries]


def _shared_error(where: str, problem: str | tuple[str, str]) -> Exception:
    """The error every worker raises for one worker's ``problem`` (``_agree``)."""
    if isinstance(problem, str):
        return IMergeArgumentError(f"{where}: {problem}")
    name, message = problem
    cls = _SHARED_ERRORS.get(name)
    return cls(f"{where}: {message}") if cls else IMergeError(f"{where}: {name}: {message}")


def _wait(requests: list[Any], what: str) -> None:
    """Poll ``requests`` with back-off until all complete; IMergeTimeoutError at ``timeout_s``."""
    global _moving
    wait = DeadlineWait(session.config().timeout_s)
    while not MPI.Request.Testall(requests):
        if wait.expired():
            raise record_fatal(IMergeTimeoutError(
                f"{whoami()}: {what} did not complete within {wait.limit_s:.0f} s after every worker had started "
                "it (a worker died or stopped calling MPI)"))
        wait.idle(wait.elapsed())  # sleeps grow with the wait (a large transfer polls less often)
    _moving = None


def _device_route(group: Any, metas: Sequence[dict[str, Any] | None]) -> Any:
    """The group the agreed op's data moves on without the host: this worker's offer
    (``device_collectives.device_group``) where every worker offered one (the metas' ``device``), else
    None (MPI). A worker waiting in ``join()`` (its meta is None) answers over MPI: then MPI it is."""
    if group is None or not all(meta is not None and meta.get("device") for meta in metas):
        return None
    return group


def _moved() -> None:
    """The op's data moved on the device path (as ``_wait`` says for MPI): no one waits for this worker's data."""
    global _moving
    _moving = None


def _device_send(tensor: torch.Tensor, prescale: float) -> torch.Tensor:
    """``tensor`` times ``prescale`` on its device, in its dtype: a contiguous copy a collective may overwrite."""
    if prescale == 1.0:
        return tensor.detach().clone(memory_format=torch.contiguous_format)
    return _scale(tensor.detach(), prescale).contiguous()


def _host(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` on the host and contiguous (itself when it already is)."""
    return tensor.detach().to("cpu").contiguous()


def _raw(tensor: torch.Tensor) -> Any:
    """A contiguous host tensor's bytes as a numpy uint8 view."""
    return tensor.reshape(-1).view(torch.uint8).numpy()


def _describe(tensor: Any) -> tuple[tuple[int, ...], str]:
    return tuple(tensor.shape), str(tensor.dtype)


def _not_a_tensor(tensor: Any) -> str | None:
    return None if isinstance(tensor, torch.Tensor) else f"expected a torch.Tensor, got {type(tensor).__name__}"


# ---------------------------------------------------------------------- reductions
def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """What MPI reduces in: 16-bit floats go as float32 (MPI has no 16-bit float type)."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def _numpy_dtype(dtype: torch.dtype) -> str:
    """The numpy dtype MPI reduces a tensor of ``dtype`` in."""
    return str(torch.empty(0, dtype=_compute_dtype(dtype)).numpy().dtype)


def _scale(tensor: torch.Tensor, factor: float) -> torch.Tensor:
    """``tensor * factor``; integer tensors are scaled in float64 and truncated, as Horovod does."""
    if factor == 1.0:
        return tensor
    if tensor.is_floating_point():
        return tensor * factor
    return (tensor.double() * factor).to(tensor.dtype)


def _reduce_problem(tensor: Any) -> str | None:
    if _not_a_tensor(tensor):
        return _not_a_tensor(tensor)
    if tensor.dtype not in _REDUCIBLE:
        return f"dtype {tensor.dtype} cannot be reduced (use a floating or integer dtype)"
    return None


def _reduced(kind: str, tensors: Sequence[torch.Tensor], name: str | None, op: ReduceOp, prescale: float,
             postscale: float) -> list[torch.Tensor]:
    """``tensors`` reduced over the workers (new tensors, same dtype and device as each input)."""
    problem = next((f"tensor {i}: {why}" for i, t in enumerate(tensors) if (why := _reduce_problem(t))), None)
    meta = {"shapes": [_describe(t)[0] for t in tensors] if problem is None else [],
            "dtypes": [_describe(t)[1] for t in tensors] if problem is None else [], "op": op.name}
    joined = None  # what a worker waiting in join() adds: zeros, as Horovod's joined ranks (Sum and Average only)
    if problem is None and op in SUMMING_OPS:
        joined = collectives.ZerosPart(meta, _MPI_OPS[op], tuple((tuple(t.shape), _numpy_dtype(t.dtype))
                                                                 for t in tensors))
    group = device_collectives.device_group(tensors, reduce=True) if problem is None else None
    label, metas = _agree(kind, name, {**meta, "device": group is not None}, ("shapes", "dtypes", "op"), problem,
                          joined)
    comm = _topology().worker_comm
    if (group := _device_route(group, metas)) is not None:
        buffers = [_device_send(t, prescale) for t in tensors]
        device_collectives.allreduce(buffers, op, group)
        _moved()
        return [_finish(b, op, comm.Get_size(), postscale, t) for b, t in zip(buffers, tensors)]
    mpi_op = getattr(MPI, _MPI_OPS[op])
    sends = [_scale(_host(t).to(_compute_dtype(t.dtype)), prescale).contiguous() for t in tensors]
    recvs = [torch.empty_like(s) for s in sends]
    _wait([comm.Iallreduce(s.numpy(), r.numpy(), op=mpi_op) for s, r in zip(sends, recvs)], f"{kind} of {label!r}")
    size = comm.Get_size()
    return [_finish(r, op, size, postscale, t) for r, t in zip(recvs, tensors)]


def _finish(result: torch.Tensor, op: ReduceOp, size: int, postscale: float, like: torch.Tensor) -> torch.Tensor:
    if op is ReduceOp.Average:
        result = result / size if result.is_floating_point() else torch.div(result, size, rounding_mode="trunc")
    return _scale(result, postscale).to(dtype=like.dtype, device=like.device)


class _AllreduceFunction(torch.autograd.Function):
    """Differentiable allreduce, as Horovod's: the gradient is allreduced with the same op and factors."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, name: str | None, op: ReduceOp, prescale: float,
                postscale: float) -> torch.Tensor:
        ctx.op, ctx.prescale, ctx.postscale = op, prescale, postscale
        return _reduced("allreduce", [tensor], name, op, prescale, postscale)[0]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        return _reduced("allreduce", [grad], None, ctx.op, ctx.prescale, ctx.postscale)[0], None, None, None, None


def _differentiable(tensor: Any) -> bool:
    return isinstance(tensor, torch.Tensor) and tensor.requires_grad and torch.is_grad_enabled()


@_agreed("allreduce")
def allreduce(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
              compression: Any = Compression.none, op: Any = None, prescale_factor: float = 1.0,
              postscale_factor: float = 1.0, process_set: Any = global_process_set) -> torch.Tensor:
    """``tensor`` reduced over every worker (default: averaged); the input is not modified.

    Differentiable like Horovod's. 16-bit floats are reduced in float32 (natively on the NCCL path); integer
    averages are truncated.
    """
    check_process_set(process_set, "allreduce")
    op = resolve_op(op, average, "allreduce")
    codec = _compressor(compression)
    squeezed, ctx = codec.compress(tensor)
    if _differentiable(squeezed):
        result = _AllreduceFunction.apply(squeezed, name, op, prescale_factor, postscale_factor)
    else:
        result = _reduced("allreduce", [squeezed], name, op, prescale_factor, postscale_factor)[0]
    return codec.decompress(result, ctx)


@_agreed("allreduce")
def allreduce_(tensor: torch.Tensor, average: bool | None = None, name: str | None = None, op: Any = None,
               prescale_factor: float = 1.0, postscale_factor: float = 1.0,
               process_set: Any = global_process_set) -> torch.Tensor:
    """In-place ``allreduce``: ``tensor`` holds the result; returns it."""
    check_process_set(process_set, "allreduce_")
    op = resolve_op(op, average, "allreduce_")
    return _write_back(tensor, _reduced("allreduce", [tensor], name, op, prescale_factor, postscale_factor)[0])


@_agreed("allreduce")
def allreduce_async(tensor: torch.Tensor, average: bool | None = None, name: str | None = None, op: Any = None,
                    prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                    process_set: Any = global_process_set) -> int:
    """``allreduce`` run now; ``synchronize(handle)`` returns its result."""
    check_process_set(process_set, "allreduce_async")
    op = resolve_op(op, average, "allreduce_async")
    return _handle(_reduced("allreduce", [tensor], name, op, prescale_factor, postscale_factor)[0])


@_agreed("allreduce")
def allreduce_async_(tensor: torch.Tensor, average: bool | None = None, name: str | None = None, op: Any = None,
                     prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                     process_set: Any = global_process_set) -> int:
    """``allreduce_`` run now; ``synchronize(handle)`` returns ``tensor``."""
    return _handle(allreduce_(tensor, average, name, op, prescale_factor, postscale_factor, process_set))


@_agreed("grouped_allreduce")
def grouped_allreduce(tensors: Sequence[torch.Tensor], average: bool | None = None, name: str | None = None,
                      compression: Any = Compression.none, op: Any = None, prescale_factor: float = 1.0,
                      postscale_factor: float = 1.0, process_set: Any = global_process_set) -> list[torch.Tensor]:
    """Each tensor of ``tensors`` reduced over the workers, agreed as one op. Differentiable like Horovod's."""
    check_process_set(process_set, "grouped_allreduce")
    op = resolve_op(op, average, "grouped_allreduce")
    codec = _compressor(compression)
    squeezed = [codec.compress(t) for t in tensors]
    inputs = [t for t, _ in squeezed]
    if any(_differentiable(t) for t in inputs):
        results = _GroupedAllreduceFunction.apply(name, op, prescale_factor, postscale_factor, *inputs)
    else:
        results = _reduced("grouped_allreduce", inputs, name, op, prescale_factor, postscale_factor)
    return [codec.decompress(r, ctx) for r, (_, ctx) in zip(results, squeezed)]


class _GroupedAllreduceFunction(torch.autograd.Function):
    """Differentiable grouped allreduce, as Horovod's: the gradients are reduced with the same op and factors."""

    @staticmethod
    def forward(ctx: Any, name: str | None, op: ReduceOp, prescale: float, postscale: float,
                *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.op, ctx.prescale, ctx.postscale = op, prescale, postscale
        return tuple(_reduced("grouped_allreduce", list(tensors), name, op, prescale, postscale))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple:
        return (None, None, None, None,
                *_reduced("grouped_allreduce", list(grads), None, ctx.op, ctx.prescale, ctx.postscale))


@_agreed("grouped_allreduce")
def grouped_allreduce_(tensors: Sequence[torch.Tensor], average: bool | None = None, name: str | None = None,
                       op: Any = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                       process_set: Any = global_process_set) -> list[torch.Tensor]:
    """In-place ``grouped_allreduce``; returns ``tensors``."""
    check_process_set(process_set, "grouped_allreduce_")
    op = resolve_op(op, average, "grouped_allreduce_")
    results = _reduced("grouped_allreduce", list(tensors), name, op, prescale_factor, postscale_factor)
    return [_write_back(t, r) for t, r in zip(tensors, results)]


@_agreed("grouped_allreduce")
def grouped_allreduce_async(tensors: Sequence[torch.Tensor], average: bool | None = None, name: str | None = None,
                            op: Any = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                            process_set: Any = global_process_set) -> int:
    """``grouped_allreduce`` run now; ``synchronize(handle)`` returns the list of results."""
    return _handle(grouped_allreduce(tensors, average, name, Compression.none, op, prescale_factor, postscale_factor,
                                     process_set))


@_agreed("grouped_allreduce")
def grouped_allreduce_async_(tensors: Sequence[torch.Tensor], average: bool | None = None, name: str | None = None,
                             op: Any = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                             process_set: Any = global_process_set) -> int:
    """``grouped_allreduce_`` run now; ``synchronize(handle)`` returns ``tensors``."""
    return _handle(grouped_allreduce_(tensors, average, name, op, prescale_factor, postscale_factor, process_set))


def _write_back(tensor: torch.Tensor, result: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        tensor.copy_(result)
    return tensor


# ---------------------------------------------------------------------- allgather
def _gathered(tensor: torch.Tensor, name: str | None) -> torch.Tensor:
    """Every worker's ``tensor`` concatenated along dim 0 in rank order (first dims may differ)."""
    return _gathered_many("allgather", [tensor], name)[0]


def _gathered_many(kind: str, tensors: Sequence[torch.Tensor], name: str | None) -> list[torch.Tensor]:
    """Each of ``tensors`` gathered as ``_gathered`` does, agreed as one op."""
    problem = next((f"tensor {i}: {why}" for i, t in enumerate(tensors) if (why := _not_a_tensor(t))), None)
    flats = [t.reshape(1) if t.dim() == 0 else t for t in tensors] if problem is None else []
    meta = {"rows": [f.shape[0] for f in flats], "shapes after dim 0": [tuple(f.shape[1:]) for f in flats],
            "dtypes": [str(f.dtype) for f in flats]}
    group = device_collectives.device_group(flats) if problem is None else None
    label, metas = _agree(kind, name, {**meta, "device": group is not None}, ("shapes after dim 0", "dtypes"), problem)
    if (group := _device_route(group, metas)) is not None:
        outs = [device_collectives.allgather(flat, [m["rows"][i] for m in metas], group)
                for i, flat in enumerate(flats)]
        _moved()
        return outs
    comm = _topology().worker_comm
    outs, requests = [], []
    for i, flat in enumerate(flats):
        rows = [m["rows"][i] for m in metas]
        out = torch.empty((sum(rows), *flat.shape[1:]), dtype=flat.dtype)
        counts = [r * _row_bytes(flat) for r in rows]
        requests.append(comm.Iallgatherv([_raw(_host(flat)), MPI.BYTE],
                                         [_raw(out), counts, _displacements(counts), MPI.BYTE]))
        outs.append(out)
    _wait(requests, f"{kind} of {label!r}")
    return [out.to(t.device) for out, t in zip(outs, tensors)]


def _row_bytes(tensor: torch.Tensor) -> int:
    rest = 1
    for d in tensor.shape[1:]:
        rest *= d
    return rest * tensor.element_size()


def _displacements(counts: Sequence[int]) -> list[int]:
    return [sum(counts[:i]) for i in range(len(counts))]


class _AllgatherFunction(torch.autograd.Function):
    """Differentiable allgather, as Horovod's: the averaged gradient's rows of this worker."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, name: str | None) -> torch.Tensor:
        ctx.rows = tensor.shape[0] if tensor.dim() else 1
        ctx.scalar = tensor.dim() == 0
        return _gathered(tensor, name)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        reduced = _reduced("allreduce", [grad], None, ReduceOp.Average, 1.0, 1.0)[0]
        rows = _gathered(torch.tensor([ctx.rows]), None).tolist()
        offset = sum(rows[:session.topology().worker_rank])
        mine = reduced.narrow(0, offset, ctx.rows)
        return (mine.reshape(()) if ctx.scalar else mine), None


@_agreed("allgather")
def allgather(tensor: torch.Tensor, name: str | None = None, process_set: Any = global_process_set) -> torch.Tensor:
    """Every worker's ``tensor`` concatenated along dim 0 (their first dims may differ; a scalar counts as one row)."""
    check_process_set(process_set, "allgather")
    if _differentiable(tensor):
        return _AllgatherFunction.apply(tensor, name)
    return _gathered(tensor, name)


@_agreed("allgather")
def allgather_async(tensor: torch.Tensor, name: str | None = None, process_set: Any = global_process_set) -> int:
    """``allgather`` run now; ``synchronize(handle)`` returns its result."""
    check_process_set(process_set, "allgather_async")
    return _handle(_gathered(tensor, name))


class _GroupedAllgatherFunction(torch.autograd.Function):
    """Differentiable grouped allgather, as Horovod's: each averaged gradient's rows of this worker."""

    @staticmethod
    def forward(ctx: Any, name: str | None, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.rows = [t.shape[0] if t.dim() else 1 for t in tensors]
        ctx.scalars = [t.dim() == 0 for t in tensors]
        return tuple(_gathered_many("grouped_allgather", tensors, name))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple:
        reduced = _reduced("grouped_allreduce", list(grads), None, ReduceOp.Average, 1.0, 1.0)
        rows = _gathered(torch.tensor([ctx.rows]), None)  # (workers, tensors)
        me = session.topology().worker_rank
        mine = [r.narrow(0, int(rows[:me, i].sum()), n) for i, (r, n) in enumerate(zip(reduced, ctx.rows))]
        return (None, *(m.reshape(()) if scalar else m for m, scalar in zip(mine, ctx.scalars)))


@_agreed("grouped_allgather")
def grouped_allgather(tensors: Sequence[torch.Tensor], name: str | None = None,
                      process_set: Any = global_process_set) -> list[torch.Tensor]:
    """Each of ``tensors`` allgathered (``allgather``), agreed as one op. Differentiable like Horovod's."""
    check_process_set(process_set, "grouped_allgather")
    if any(_differentiable(t) for t in tensors):
        return list(_GroupedAllgatherFunction.apply(name, *tensors))
    return _gathered_many("grouped_allgather", tensors, name)


@_agreed("grouped_allgather")
def grouped_allgather_async(tensors: Sequence[torch.Tensor], name: str | None = None,
                            process_set: Any = global_process_set) -> int:
    """``grouped_allgather`` run now; ``synchronize(handle)`` returns the list of results."""
    check_process_set(process_set, "grouped_allgather_async")
    return _handle(_gathered_many("grouped_allgather", tensors, name))


@_agreed("allgather_object")
def allgather_object(obj: Any, name: str | None = None, process_set: Any = global_process_set) -> list[Any]:
    """Every worker's picklable ``obj``, by rank."""
    check_process_set(process_set, "allgather_object")
    _, metas = _agree("allgather_object", name, {"object": obj}, ())
    return [meta["object"] for meta in metas]


@_agreed("allgather", lambda name: f"{name}.indices")
def sparse_allreduce_async(tensor: torch.Tensor, name: str, op: Any,
                           process_set: Any = global_process_set) -> Callable[[], torch.Tensor]:
    """A sparse ``tensor`` reduced over the workers (Sum or Average), as Horovod's: every worker's
    indices and values allgathered (as ops ``{name}.indices`` and ``{name}.values``) into one
    uncoalesced sparse tensor. Run now; returns a callable that returns the result, as Horovod's."""
    check_process_set(process_set, "sparse_allreduce_async")
    op = summing_op(op, f"{whoami()}: sparse_allreduce_async of {name!r}")
    if not (isinstance(tensor, torch.Tensor) and tensor.is_sparse):
        raise IMergeArgumentError(f"{whoami()}: sparse_allreduce_async of {name!r}: expected a sparse COO tensor, "
                                  f"got {tensor if not isinstance(tensor, torch.Tensor) else tensor.layout}")
    indices = _gathered(tensor._indices().transpose(0, 1).contiguous(), f"{name}.indices")
    values = _gathered(tensor._values(), f"{name}.values")
    if op is ReduceOp.Average:
        values = values / session.topology().num_workers
    result = torch.sparse_coo_tensor(indices.transpose(0, 1), values, tensor.shape)
    return lambda: result


# ---------------------------------------------------------------------- broadcast
def _broadcasted(tensor: torch.Tensor, root_rank: int, name: str | None) -> torch.Tensor:
    """``root_rank``'s ``tensor`` on every worker (a new tensor; shapes and dtypes must match)."""
    topo = _topology()
    problem = _not_a_tensor(tensor) or collectives.root_problem(root_rank, topo.num_workers)
    shape, dtype = _describe(tensor) if _not_a_tensor(tensor) is None else ((), "")
    group = device_collectives.device_group([tensor]) if problem is None else None
    label, metas = _agree("broadcast", name, {"shape": shape, "dtype": dtype, "root_rank": root_rank,
                                              "device": group is not None}, ("root_rank", "shape", "dtype"), problem)
    if (group := _device_route(group, metas)) is not None:
        if topo.worker_rank == root_rank:
            buffer = tensor.detach().clone(memory_format=torch.contiguous_format)
        else:
            buffer = torch.empty(tensor.shape, dtype=tensor.dtype, device=tensor.device)
        device_collectives.broadcast(buffer, root_rank, group)
        _moved()
        return buffer
    if topo.worker_rank == root_rank:
        buffer = _host(tensor).clone()
    else:
        buffer = torch.empty(tensor.shape, dtype=tensor.dtype)
    _wait([topo.worker_comm.Ibcast([_raw(buffer), MPI.BYTE], root=root_rank)], f"broadcast of {label!r}")
    return buffer.to(tensor.device)


class _BroadcastFunction(torch.autograd.Function):
    """Differentiable broadcast, as Horovod's: the averaged gradient on the root, zeros elsewhere."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, root_rank: int, name: str | None) -> torch.Tensor:
        ctx.root_rank = root_rank
        return _broadcasted(tensor, root_rank, name)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        reduced = _reduced("allreduce", [grad], None, ReduceOp.Average, 1.0, 1.0)[0]
        if session.topology().worker_rank != ctx.root_rank:
            reduced = reduced * 0
        return reduced, None, None


@_agreed("broadcast")
def broadcast(tensor: torch.Tensor, root_rank: int, name: str | None = None,
              process_set: Any = global_process_set) -> torch.Tensor:
    """``root_rank``'s ``tensor`` as a new tensor on every worker; the input is not modified."""
    check_process_set(process_set, "broadcast")
    if _differentiable(tensor):
        return _BroadcastFunction.apply(tensor, root_rank, name)
    return _broadcasted(tensor, root_rank, name)


@_agreed("broadcast")
def broadcast_(tensor: torch.Tensor, root_rank: int, name: str | None = None,
               process_set: Any = global_process_set) -> torch.Tensor:
    """In-place ``broadcast``: ``tensor`` holds ``root_rank``'s values; returns it."""
    check_process_set(process_set, "broadcast_")
    result = _broadcasted(tensor, root_rank, name)
    return tensor if session.topology().worker_rank == root_rank else _write_back(tensor, result)


@_agreed("broadcast")
def broadcast_async(tensor: torch.Tensor, root_rank: int, name: str | None = None,
                    process_set: Any = global_process_set) -> int:
    """``broadcast`` run now; ``synchronize(handle)`` returns its result."""
    check_process_set(process_set, "broadcast_async")
    return _handle(_broadcasted(tensor, root_rank, name))


@_agreed("broadcast")
def broadcast_async_(tensor: torch.Tensor, root_rank: int, name: str | None = None,
                     process_set: Any = global_process_set) -> int:
    """``broadcast_`` run now; ``synchronize(handle)`` returns ``tensor``."""
    return _handle(broadcast_(tensor, root_rank, name, process_set))


# ---------------------------------------------------------------------- alltoall, reducescatter
def _split_rows(tensor: torch.Tensor, splits: Any, size: int) -> tuple[list[int], str | None]:
    """Rows of ``tensor`` sent to each worker, and a problem if ``splits`` does not fit."""
    if tensor.dim() == 0:
        return [0] * size, "a scalar cannot be split along dim 0"
    rows = tensor.shape[0]
    if splits is None:
        if rows % size:
            return [0] * size, f"dim 0 ({rows}) is not divisible by {size} workers; pass splits="
        return [rows // size] * size, None
    if isinstance(splits, torch.Tensor) and (splits.is_floating_point() or splits.is_complex()):
        return [0] * size, f"splits must be integers (got a {splits.dtype} tensor)"
    values = splits.tolist() if isinstance(splits, torch.Tensor) else list(splits)
    try:
        values = [operator.index(v) for v in values]
    except TypeError:
        return [0] * size, f"splits {values} must be integers"
    if len(values) != size or any(v < 0 for v in values) or sum(values) > rows:
        return [0] * size, (f"splits {values} must be {size} non-negative integers summing to at most dim 0 "
                            f"({rows}), as Horovod's (rows past the sum are not sent)")
    return values, None


def _exchanged(tensor: torch.Tensor, splits: Any, name: str | None) -> tuple[torch.Tensor, list[int]]:
    """Rows ``splits[j]`` of ``tensor`` go to worker j; returns what arrived (by rank) and the rows per sender."""
    topo = _topology()
    problem = _not_a_tensor(tensor)
    rows, bad = ([0] * topo.num_workers, problem) if problem else _split_rows(tensor, splits, topo.num_workers)
    meta = {"splits": rows, "shape after dim 0": tuple(tensor.shape[1:]) if not problem else (),
            "dtype": str(tensor.dtype) if not problem else ""}
    group = device_collectives.device_group([tensor]) if bad is None else None
    label, metas = _agree("alltoall", name, {**meta, "device": group is not None}, ("shape after dim 0", "dtype"), bad)
    received = [m["splits"][topo.worker_rank] for m in metas]
    if (group := _device_route(group, metas)) is not None:
        out = device_collectives.alltoall(tensor.detach(), rows, received, group)
        _moved()
        return out, received
    row_bytes = _row_bytes(tensor)
    out = torch.empty((sum(received), *tensor.shape[1:]), dtype=tensor.dtype)
    send_counts = [r * row_bytes for r in rows]
    recv_counts = [r * row_bytes for r in received]
    request = topo.worker_comm.Ialltoallv(
        [_raw(_host(tensor)), send_counts, _displacements(send_counts), MPI.BYTE],
        [_raw(out), recv_counts, _displacements(recv_counts), MPI.BYTE])
    _wait([request], f"alltoall of {label!r}")
    return out.to(tensor.device), received


@_agreed("alltoall")
def alltoall(tensor: torch.Tensor, splits: Any = None, name: str | None = None,
             process_set: Any = global_process_set) -> Any:
    """Rows ``splits[j]`` of ``tensor`` to worker j (default: equal parts); the rows received, by sender.

    With ``splits`` given, also returns the received splits (as Horovod: a tensor like ``splits``,
    int32 on the CPU for a list). Differentiable like Horovod's (the gradient goes back the same way).
    """
    check_process_set(process_set, "alltoall")
    if _differentiable(tensor):
        out, received = _AlltoallFunction.apply(tensor, splits, name)
    else:
        out, received = _exchanged(tensor, splits, name)
    if splits is None:
        return out
    like = splits if isinstance(splits, torch.Tensor) else torch.empty(0, dtype=torch.int32)
    return out, torch.tensor(received, dtype=like.dtype, device=like.device)


class _AlltoallFunction(torch.autograd.Function):
    """Differentiable alltoall, as Horovod's: each received row's gradient goes back to its sender."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, splits: Any, name: str | None) -> tuple[torch.Tensor, list[int]]:
        out, received = _exchanged(tensor, splits, name)
        ctx.received, ctx.shape = received, tensor.shape
        return out, received

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor, _received: Any) -> tuple:
        back, _ = _exchanged(grad.contiguous(), ctx.received, None)
        if back.shape[0] < ctx.shape[0]:  # rows past the splits' sum were not sent
            back = torch.cat([back, back.new_zeros((ctx.shape[0] - back.shape[0], *ctx.shape[1:]))])
        return back, None, None


@_agreed("alltoall")
def alltoall_async(tensor: torch.Tensor, splits: Any = None, name: str | None = None,
                   process_set: Any = global_process_set) -> int:
    """``alltoall`` run now; ``synchronize(handle)`` returns (output, received splits) as Horovod's."""
    check_process_set(process_set, "alltoall_async")
    out, received = _exchanged(tensor, splits, name)
    like = splits if isinstance(splits, torch.Tensor) else torch.empty(0, dtype=torch.int32)
    return _handle((out, torch.tensor(received, dtype=like.dtype, device=like.device)))


def scatter_rows(rows: int, size: int) -> list[int]:
    """Horovod's reducescatter split of dim 0: the first ``rows % size`` workers get one row more."""
    return [rows // size + (1 if r < rows % size else 0) for r in range(size)]


def _scattered(kind: str, tensors: Sequence[torch.Tensor], name: str | None, op: ReduceOp, prescale: float,
               postscale: float) -> list[torch.Tensor]:
    """Each of ``tensors`` reduced over the workers; this worker's rows of it (``scatter_rows``), agreed as one op."""
    problem = next((f"tensor {i}: {why}" for i, t in enumerate(tensors) if (why := _reduce_problem(t))), None)
    if problem is None:
        problem = next((f"tensor {i}: a scalar cannot be scattered along dim 0" for i, t in enumerate(tensors)
                        if t.dim() == 0), None)
    ok = problem is None
    meta = {"shapes": [_describe(t)[0] for t in tensors] if ok else [],
            "dtypes": [_describe(t)[1] for t in tensors] if ok else [], "op": op.name}
    group = device_collectives.device_group(tensors, reduce=True) if ok else None
    label, metas = _agree(kind, name, {**meta, "device": group is not None}, ("shapes", "dtypes", "op"), problem)
    topo = _topology()
    if (group := _device_route(group, metas)) is not None:
        parts = [device_collectives.reducescatter(_device_send(t, prescale), scatter_rows(t.shape[0], topo.num_workers),
                                                  topo.worker_rank, op, group) for t in tensors]
        _moved()
        return [_finish(part, op, topo.num_workers, postscale, t) for part, t in zip(parts, tensors)]
    recvs, requests = [], []
    for tensor in tensors:
        rows = scatter_rows(tensor.shape[0], topo.num_workers)
        per_row = tensor[0:1].numel() if tensor.shape[0] else 0
        send = _scale(_host(tensor).to(_compute_dtype(tensor.dtype)), prescale).contiguous()
        recv = torch.empty((rows[topo.worker_rank], *tensor.shape[1:]), dtype=send.dtype)
        requests.append(topo.worker_comm.Ireduce_scatter(send.numpy(), recv.numpy(), [r * per_row for r in rows],
                                                         op=getattr(MPI, _MPI_OPS[op])))
        recvs.append((send, recv))  # the send buffer lives until the request completes
    _wait(requests, f"{kind} of {label!r}")
    return [_finish(recv, op, topo.num_workers, postscale, t) for (_, recv), t in zip(recvs, tensors)]


class _ReducescatterFunction(torch.autograd.Function):
    """Differentiable (grouped) reducescatter, as Horovod's: the gradients scaled (by size() for Sum, and by
    the factors) and allgathered."""

    @staticmethod
    def forward(ctx: Any, kind: str, name: str | None, op: ReduceOp, prescale: float, postscale: float,
                *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.factor = (session.topology().num_workers if op is ReduceOp.Sum else 1) * prescale * postscale
        return tuple(_scattered(kind, tensors, name, op, prescale, postscale))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple:
        scaled = [g * ctx.factor if ctx.factor != 1 else g for g in grads]
        return (None, None, None, None, None, *_gathered_many("grouped_allgather", scaled, None))


def _reducescattered(kind: str, tensors: Sequence[torch.Tensor], name: str | None, op: ReduceOp, prescale: float,
                     postscale: float) -> list[torch.Tensor]:
    if any(_differentiable(t) for t in tensors):
        return list(_ReducescatterFunction.apply(kind, name, op, prescale, postscale, *tensors))
    return _scattered(kind, tensors, name, op, prescale, postscale)


@_agreed("reducescatter")
def reducescatter(tensor: torch.Tensor, name: str | None = None, compression: Any = Compression.none,
                  op: Any = ReduceOp.Average, process_set: Any = global_process_set, prescale_factor: float = 1.0,
                  postscale_factor: float = 1.0) -> torch.Tensor:
    """``tensor`` reduced over the workers (default: averaged), this worker's part of dim 0.

    Differentiable like Horovod's."""
    check_process_set(process_set, "reducescatter")
    codec = _compressor(compression)
    squeezed, ctx = codec.compress(tensor)
    result = _reducescattered("reducescatter", [squeezed], name, reduce_op(op, "reducescatter"), prescale_factor,
                              postscale_factor)[0]
    return codec.decompress(result, ctx)


@_agreed("reducescatter")
def reducescatter_async(tensor: torch.Tensor, name: str | None = None, op: Any = ReduceOp.Average,
                        process_set: Any = global_process_set, prescale_factor: float = 1.0,
                        postscale_factor: float = 1.0) -> int:
    """``reducescatter`` run now; ``synchronize(handle)`` returns its result."""
    check_process_set(process_set, "reducescatter_async")
    return _handle(_scattered("reducescatter", [tensor], name, reduce_op(op, "reducescatter_async"), prescale_factor,
                              postscale_factor)[0])


@_agreed("grouped_reducescatter")
def grouped_reducescatter(tensors: Sequence[torch.Tensor], name: str | None = None,
                          compression: Any = Compression.none, op: Any = ReduceOp.Average,
                          process_set: Any = global_process_set, prescale_factor: float = 1.0,
                          postscale_factor: float = 1.0) -> list[torch.Tensor]:
    """Each of ``tensors`` reducescattered (``reducescatter``), agreed as one op. Differentiable like Horovod's."""
    check_process_set(process_set, "grouped_reducescatter")
    codec = _compressor(compression)
    squeezed = [codec.compress(t) for t in tensors]
    results = _reducescattered("grouped_reducescatter", [t for t, _ in squeezed], name,
                               reduce_op(op, "grouped_reducescatter"), prescale_factor, postscale_factor)
    return [codec.decompress(r, ctx) for r, (_, ctx) in zip(results, squeezed)]


@_agreed("grouped_reducescatter")
def grouped_reducescatter_async(tensors: Sequence[torch.Tensor], name: str | None = None,
                                op: Any = ReduceOp.Average, process_set: Any = global_process_set,
                                prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> int:
    """``grouped_reducescatter`` run now; ``synchronize(handle)`` returns the list of results."""
    check_process_set(process_set, "grouped_reducescatter_async")
    return _handle(_scattered("grouped_reducescatter", tensors, name, reduce_op(op, "grouped_reducescatter_async"),
                              prescale_factor, postscale_factor))


# ---------------------------------------------------------------------- handles, barrier, join
_handles: dict[int, Any] = {}
_handle_ids = itertools.count(1)


def _handle(result: Any) -> int:
    handle = next(_handle_ids)
    _handles[handle] = result
    return handle


def poll(handle: int) -> bool:
    """Whether ``handle``'s op completed: always True (IMerge runs ``*_async`` ops eagerly)."""
    if handle not in _handles:
        raise IMergeUsageError(f"{whoami()}: poll(): unknown handle {handle!r} (synchronized already, or not a handle)")
    return True


def synchronize(handle: int) -> Any:
    """The result of ``handle``'s op (None for an unknown handle, as Horovod)."""
    return _handles.pop(handle, None)


@_agreed("barrier")
def barrier(process_set: Any = global_process_set) -> None:
    """Return when every worker has called ``barrier()`` (with a deadline)."""
    check_process_set(process_set, "barrier")
    _agree("barrier", None, {}, ())
