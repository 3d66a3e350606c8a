"""Horovod-style ``DistributedOptimizer``: wraps any ``torch.optim`` optimizer in place."""

from __future__ import annotations

import contextlib
import functools
import warnings
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch

from ..cluster import session, startup
from ..core.compression import compression_name
from ..core.config import Config
from ..core.errors import IMergeConfigError, IMergeUsageError
from ..core.layout import dtype_name
from ..core.ops import ReduceOp, summing_op
from ..core.wire import SUPPORTED_DTYPES
from ..worker.engine import GradientEngine
from .naming import module_names
from .process_api import check_process_set

SYNCHRONIZE_WARNING = ("optimizer.step() called without optimizer.skip_synchronize() context after "
                       "optimizer.synchronize(). This can cause training slowdown. You may want to consider using "
                       "optimizer.skip_synchronize() context if you use optimizer.synchronize() in your code.")


class _DistributedMixin:
    """Methods added to the wrapped optimizer's class (it stays an instance of that class)."""

    _imerge_mixin = True  # marks where the wrapped class's own methods start in the MRO (deferral.py)

    _imerge_engine: GradientEngine
    _imerge_skip_sync: bool
    _imerge_synchronized: bool  # synchronize() ran since the last step() (Horovod warns at that step)
    _imerge_sparse: dict[int, int]  # id(param) -> sparse_dim of its sparse gradients (sparse_as_dense)

    def synchronize(self) -> None:
        """Wait until every gradient is averaged over the workers (e.g. before clipping)."""
        self._imerge_engine.synchronize()
        self._imerge_synchronized = True

    @contextlib.contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """``step()`` inside this block does not synchronize (you called ``synchronize()`` already)."""
        self._imerge_skip_sync = True
        try:
            yield
        finally:
            self._imerge_skip_sync = False

    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        engine = self._imerge_engine
        if not self._imerge_skip_sync and self._imerge_synchronized and not engine.pending_gradients:
            warnings.warn(SYNCHRONIZE_WARNING, stacklevel=2)
        self._imerge_synchronized = False
        if not self._imerge_skip_sync and not self._imerge_sparse and engine.can_defer(self):
            engine.defer_step(self)
            return loss
        if not self._imerge_skip_sync:
            engine.synchronize()
        else:
            engine.flush_deferred("optimizer.step() in skip_synchronize()")
        hidden = _hide_missing_gradients(engine) + _sparse_again(engine, self._imerge_sparse)
        try:
            super().step()  # type: ignore[misc]
        finally:
            for p, grad in hidden:
                p.grad = grad
        return loss

    @property
    def _parameter_names(self) -> dict[torch.nn.Parameter, str]:
        """Horovod's attribute: each averaged parameter's name."""
        engine = self._imerge_engine
        return dict(zip(engine.params, engine.names))

    def gradients_pending(self) -> bool:
        """Whether a backward since the last ``synchronize()`` or ``step()`` left gradients that are
        not averaged yet."""
        return self._imerge_engine.pending_gradients

    @property
    def gradients_averaged(self) -> bool:
        """``synchronize()`` ran and no backward since: ``step()`` belongs in ``skip_synchronize()``."""
        return self._imerge_synchronized and not self._imerge_engine.pending_gradients

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """torch's ``add_param_group``; the new parameters are averaged too (a new engine over all of
        them: a plan epoch, so every worker adds the group at the same point, between steps)."""
        super().add_param_group(param_group)  # type: ignore[misc]
        old = self._imerge_engine
        old.flush_deferred("optimizer.add_param_group()")
        if old.pending_gradients or old.in_flight:
            raise IMergeUsageError(f"IMerge worker {old.topo.worker_rank}: add_param_group() between backward() "
                                   "and step(); add parameter groups between steps")
        names = {id(p): n for n, p in zip(old.names, old.params)}
        params = [p for group in self.param_groups for p in group["params"]]
        fresh = [p for p in params if id(p) not in names]
        names.update(zip(map(id, fresh), module_names(fresh)))
        named = [(names[id(p)], p) for p in params if not _frozen_integer(p)]
        old.close()
        self._imerge_engine = _build_engine(named, old.cfg, *self._imerge_build)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero gradients in place: they stay views into IMerge's flat buffers (no allocation per step).

        With ``set_to_none=True`` a parameter that then gets no gradient on any worker is skipped
        by ``step()`` as if its gradient were None; with ``False`` it is stepped with a zero
        gradient, as torch does.
        """
        self._imerge_engine.zero_grad(set_to_none)

    def set_backward_passes_per_step(self, passes: int) -> None:
        """Accumulate ``passes`` backward passes locally before each push (Horovod's method)."""
        if passes < 1:
            raise ValueError(f"IMerge: backward_passes_per_step must be >= 1, got {passes}")
        self._imerge_engine.synchronize()
        self._imerge_engine.passes = int(passes)

    def close(self) -> None:
        """Apply pending updates and retire the engine: hooks, callbacks and buffers go.

        The optimizer stays usable as a plain local optimizer afterwards (no averaging). Every
        worker must close at the same point (the servers drop the engine's keys, a plan epoch).
        """
        engine = self._imerge_engine
        engine.close()
        del self._imerge_engine, self._imerge_skip_sync, self._imerge_synchronized, self._imerge_build
        del self._imerge_sparse
        self.__class__ = type(self).__mro__[2]  # the wrapped class again

    def __enter__(self) -> _DistributedMixin:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def state_dict(self) -> dict[str, Any]:
        session.flush_all("optimizer.state_dict()")
        return super().state_dict()  # type: ignore[misc]

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        session.flush_all("optimizer.load_state_dict()")
        self._imerge_synchronized = False
        super().load_state_dict(state_dict)  # type: ignore[misc]


def _hide_missing_gradients(engine: GradientEngine) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Parameters no worker produced a gradient for are skipped by step(), as torch does for None."""
    hidden = []
    for i in engine.without_gradient:
        p = engine.params[i]
        if p.grad is not None:
            hidden.append((p, p.grad))
            p.grad = None
    return hidden


def _sparse_again(engine: GradientEngine, layouts: dict[int, int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """sparse_as_dense: parameters whose gradients came sparse step with a sparse gradient again
    (as Horovod does: SparseAdam needs one); returns (param, dense gradient) to put back after."""
    dense = []
    for p in engine.params:
        if id(p) in layouts and p.grad is not None and not p.grad.is_sparse:
            dense.append((p, p.grad))
            p.grad = p.grad.to_sparse(layouts[id(p)])
    return dense


def _densify(names: dict[int, str], layouts: dict[int, int], allow: bool,
             worker: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """What the engine does with a sparse gradient (``GradientEngine.sparse_gradient``): make it dense
    (``sparse_as_dense``, remembering its sparse layout for ``step()``) or refuse it naming the tensor."""

    def densify(param: torch.Tensor) -> torch.Tensor:
        grad = param.grad
        if not allow:
            raise TypeError(f"IMerge worker {worker}: gradient of {names[id(param)]!r} is sparse; IMerge's servers "
                            "average dense gradients: pass DistributedOptimizer(..., sparse_as_dense=True) to send it "
                            "dense (or use a dense embedding)")
        layouts[id(param)] = grad.sparse_dim()
        param.grad = grad.to_dense()
        return param.grad

    return densify


class _SummingEngine(GradientEngine):
    """``op=Sum``: each exchange's average times the number of workers (``factor``), applied once, before
    the planner or the step sees the gradients."""

    def __init__(self, named_parameters: Sequence[tuple[str, torch.nn.Parameter]], config: Config,
                 factor: float) -> None:
        self.factor = factor
        super().__init__(named_parameters, config)

    def finish_iteration(self) -> None:
        with torch.no_grad():
            for view in self.views:
                if view is not None:
                    view.mul_(self.factor)
        super().finish_iteration()

    def _adopt_trainable(self) -> None:
        """Newly unfrozen parameters' gradients are exchanged once more (after finish_iteration)."""
        before = list(self.trainable)
        super()._adopt_trainable()
        if self.comm is None:
            return
        with torch.no_grad():
            for i, (was, now) in enumerate(zip(before, self.trainable)):
                if now and not was and self.params[i].grad is not None:
                    self.views[i].mul_(self.factor)


_CLASSES: dict[type, type] = {}


def _distributed_class(cls: type) -> type:
    if cls not in _CLASSES:
        _CLASSES[cls] = type(cls.__name__, (_DistributedMixin, cls), {"__module__": cls.__module__,
                                                                     "__qualname__": cls.__qualname__})
    return _CLASSES[cls]


def DistributedOptimizer(optimizer: torch.optim.Optimizer,
                         named_parameters: Iterable[tuple[str, torch.nn.Parameter]] | None = None,
                         compression: Any = None, backward_passes_per_step: int | None = None,
                         op: Any = ReduceOp.Average, gradient_predivide_factor: float = 1.0, num_groups: int = 0,
                         groups: Any = None, sparse_as_dense: bool = False, process_set: Any = None, *,
                         schedule: str | None = None, **config: Any) -> torch.optim.Optimizer:
    """Make ``optimizer`` average gradients over all workers through the parameter servers.

    Returns the same object, now also an instance of a subclass of its class that adds
    ``synchronize()`` and ``skip_synchronize()``; its ``state_dict()`` is the wrapped
    optimizer's. Horovod's arguments, in Horovod's order: ``compression`` (``Compression.none``,
    ``fp16``, ``bf16`` or their names), ``op`` (``Average``, or ``Sum``: the average times
    ``size()``; Sum steps synchronously), ``gradient_predivide_factor`` (any f > 0 with Average:
    the result is the average either way), ``sparse_as_dense`` (sparse gradients are sent dense
    and step sparse again). ``groups``/``num_groups`` are refused (the planner fuses). Frozen
    integer parameters are left out. ``schedule`` is one of ``imerge_hooks.SCHEDULES`` (default
    ``imerge``); other keyword arguments are ``Config`` fields.
    """
    if isinstance(optimizer, _DistributedMixin):
        raise ValueError("IMerge: this optimizer is already a DistributedOptimizer")
    op = _check_horovod_options(op, gradient_predivide_factor, num_groups, groups, process_set)
    if not session.is_initialized():
        startup.init()
    overrides = _engine_overrides(config, schedule, backward_passes_per_step, compression, op)
    factor = float(session.topology().num_workers) if op is ReduceOp.Sum else 1.0
    cfg = session.engine_config("DistributedOptimizer", **overrides)
    named = _named_parameters(optimizer, named_parameters)
    layouts: dict[int, int] = {}
    build = (factor, layouts, bool(sparse_as_dense))
    engine = _build_engine(named, cfg, *build)
    optimizer.__class__ = _distributed_class(type(optimizer))
    optimizer._imerge_engine = engine
    optimizer._imerge_build = build
    optimizer._imerge_skip_sync = False
    optimizer._imerge_synchronized = False
    optimizer._imerge_sparse = layouts
    _repatch_scheduler_step(optimizer)
    return optimizer


def _build_engine(named: list, cfg: Config, factor: float, layouts: dict[int, int],
                  sparse_as_dense: bool) -> GradientEngine:
    """The engine over ``named``; a sparse gradient is made dense or refused inside its gradient hook."""
    worker = session.topology().worker_rank
    for name, p in named:
        dtype_name(p.dtype, name, f"worker {worker}")
    engine = _SummingEngine(named, cfg, factor) if factor != 1.0 else GradientEngine(named, cfg)
    engine.sparse_gradient = _densify({id(p): name for name, p in named}, layouts, sparse_as_dense, worker)
    return engine


def _check_horovod_options(op: Any, predivide: float, num_groups: int, groups: Any, process_set: Any) -> ReduceOp:
    """Horovod's DistributedOptimizer arguments IMerge supports; the op to use."""
    op = summing_op(op, "IMerge: DistributedOptimizer")
    if isinstance(predivide, bool) or not isinstance(predivide, (int, float)) or not predivide > 0:
        raise IMergeConfigError(f"IMerge: gradient_predivide_factor must be a number > 0, got {predivide!r}")
    if predivide != 1.0 and op is not ReduceOp.Average:
        raise IMergeConfigError("IMerge: gradient_predivide_factor not supported with op != Average (as Horovod)")
    if groups is not None or num_groups:
        raise IMergeConfigError("IMerge: DistributedOptimizer(groups=/num_groups=) is not supported: IMerge's "
                                "planner chooses the fusion groups from measured timings (see schedule= and "
                                "fusion_threshold_bytes); leave groups=None")
    check_process_set(process_set, "DistributedOptimizer")
    return op


def _engine_overrides(config: dict[str, Any], schedule: str | None, passes: int | None, compression: Any,
                      op: ReduceOp) -> dict[str, Any]:
    """The engine options given here (None: not given)."""
    overrides = dict(config, compression=compression_name(compression))
    if schedule is not None:
        overrides["schedule"] = schedule
    if passes is not None:
        overrides["backward_passes_per_step"] = passes
    if op is ReduceOp.Sum:  # the sum is taken when every gradient is in, not module by module in the next forward
        if overrides.get("overlap_forward"):
            raise IMergeConfigError("IMerge: op=Sum cannot overlap the update with the next forward pass; "
                                    "leave overlap_forward unset (or use op=Average)")
        overrides["overlap_forward"] = False
    return overrides


def _named_parameters(optimizer: torch.optim.Optimizer,
                      named_parameters: Iterable[tuple[str, torch.nn.Parameter]] | None) -> list:
    """(name, tensor) of every tensor the optimizer updates, frozen integer parameters left out."""
    opt_params = [p for group in optimizer.param_groups for p in group["params"]]
    if named_parameters is None:
        named = list(zip(module_names(opt_params), opt_params))
    else:
        named = list(named_parameters)
        if any(not isinstance(item, tuple) or len(item) != 2 for item in named):
            raise ValueError("IMerge: named_parameters should be a sequence of tuples (name, parameter), usually "
                             "produced by model.named_parameters()")
        known = {id(p) for _, p in named}
        missing = [i for i, p in enumerate(opt_params) if id(p) not in known]
        if missing:
            raise ValueError(f"IMerge: optimizer parameters at positions {missing[:5]} are not in "
                             "named_parameters; pass model.named_parameters() of the model being optimised")
        in_opt = {id(p) for p in opt_params}
        named = [(name, p) for name, p in named if id(p) in in_opt]
    return [(name, p) for name, p in named if not _frozen_integer(p)]


def _frozen_integer(p: torch.Tensor) -> bool:
    """A model parameter that never gets a gradient and that IMerge could not sum (e.g. an index table):
    left out, as Horovod does. A plain non-floating tensor given to the optimizer is still refused."""
    return isinstance(p, torch.nn.Parameter) and not p.requires_grad and p.dtype not in SUPPORTED_DTYPES


def _repatch_scheduler_step(optimizer: torch.optim.Optimizer) -> None:
    """Make ``optimizer.step()`` IMerge's step again if an LR scheduler patched it before wrapping.

    A torch LR scheduler replaces ``optimizer.step`` on the instance with a wrapper around the
    step of the class the optimizer had then (a scheduler built before ``DistributedOptimizer``,
    as Lightning's ``configure_optimizers`` does): that wrapper would bypass IMerge, so nothing
    would be averaged. Patch it again the way torch does, around the new class's step.
    """
    patched = optimizer.__dict__.get("step")
    if patched is None or not getattr(patched, "_wrapped_by_lr_sched", False):
        return
    del optimizer.__dict__["step"]
    owner = weakref.ref(optimizer)

    @functools.wraps(type(optimizer).step)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        opt = owner()
        opt._opt_called = True  # what the scheduler checks to warn about a missing optimizer.step()
        return type(opt).step(opt, *args, **kwargs)  # the class's step now (the plain one after close())

    wrapper._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
    optimizer.step = wrapper
