"""Horovod-style ``DistributedOptimizer``: wraps any ``torch.optim`` optimizer in place."""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from . import runtime
from .engine import GradientEngine
from .layout import dtype_name
from .naming import module_names


class _DistributedMixin:
    """Methods added to the wrapped optimizer's class (it stays an instance of that class)."""

    _imerge_engine: GradientEngine
    _imerge_skip_sync: bool

    def synchronize(self) -> None:
        """Wait until every gradient is averaged over the workers (e.g. before clipping)."""
        self._imerge_engine.synchronize()

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
        if not self._imerge_skip_sync and engine.can_defer(self):
            engine.defer_step(self, _base_step)
            return loss
        if not self._imerge_skip_sync:
            engine.synchronize()
        else:
            engine.flush_deferred()
        hidden = _hide_missing_gradients(engine)
        try:
            super().step()  # type: ignore[misc]
        finally:
            for p, grad in hidden:
                p.grad = grad
        return loss

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
        del self._imerge_engine, self._imerge_skip_sync
        self.__class__ = type(self).__mro__[2]  # the wrapped class again

    def __enter__(self) -> _DistributedMixin:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def state_dict(self) -> dict[str, Any]:
        runtime.flush_all()
        return super().state_dict()  # type: ignore[misc]

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        runtime.flush_all()
        super().load_state_dict(state_dict)  # type: ignore[misc]


def _base_step(optimizer: torch.optim.Optimizer) -> None:
    """The wrapped optimizer's own step (used for deferred per-module updates)."""
    super(_DistributedMixin, optimizer).step()  # type: ignore[misc]


def _hide_missing_gradients(engine: GradientEngine) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Parameters no worker produced a gradient for are skipped by step(), as torch does for None."""
    hidden = []
    for i in engine.without_gradient:
        p = engine.params[i]
        if p.grad is not None:
            hidden.append((p, p.grad))
            p.grad = None
    return hidden


_CLASSES: dict[type, type] = {}


def _distributed_class(cls: type) -> type:
    if cls not in _CLASSES:
        _CLASSES[cls] = type(cls.__name__, (_DistributedMixin, cls), {"__module__": cls.__module__,
                                                                     "__qualname__": cls.__qualname__})
    return _CLASSES[cls]


def DistributedOptimizer(optimizer: torch.optim.Optimizer,
                         named_parameters: Iterable[tuple[str, torch.nn.Parameter]] | None = None,
                         schedule: str | None = None, backward_passes_per_step: int | None = None,
                         **config: Any) -> torch.optim.Optimizer:
    """Make ``optimizer`` average gradients over all workers through the parameter servers.

    Returns the same object, now also an instance of a subclass of its class that adds
    ``synchronize()`` and ``skip_synchronize()``; its ``state_dict()`` is the wrapped
    optimizer's. ``schedule`` is one of ``imerge_hooks.SCHEDULES`` (default ``imerge``);
    other keyword arguments are ``Config`` fields.
    """
    if isinstance(optimizer, _DistributedMixin):
        raise ValueError("IMerge: this optimizer is already a DistributedOptimizer")
    if not runtime.is_initialized():
        runtime.init()
    overrides = dict(config)
    if schedule is not None:
        overrides["schedule"] = schedule
    if backward_passes_per_step is not None:
        overrides["backward_passes_per_step"] = backward_passes_per_step
    cfg = runtime.engine_config("DistributedOptimizer", **overrides)
    opt_params = [p for group in optimizer.param_groups for p in group["params"]]
    if named_parameters is None:
        named = list(zip(module_names(opt_params), opt_params))
    else:
        named = list(named_parameters)
        known = {id(p) for _, p in named}
        missing = [i for i, p in enumerate(opt_params) if id(p) not in known]
        if missing:
            raise ValueError(f"IMerge: optimizer parameters at positions {missing[:5]} are not in "
                             "named_parameters; pass model.named_parameters() of the model being optimised")
        in_opt = {id(p) for p in opt_params}
        named = [(name, p) for name, p in named if id(p) in in_opt]
    for name, p in named:
        dtype_name(p.dtype, name, f"worker {runtime.topology().worker_rank}")
    engine = GradientEngine(named, cfg)
    optimizer.__class__ = _distributed_class(type(optimizer))
    optimizer._imerge_engine = engine
    optimizer._imerge_skip_sync = False
    _repatch_scheduler_step(optimizer)
    return optimizer


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
