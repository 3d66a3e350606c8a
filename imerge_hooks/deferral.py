"""Overlap with the next forward pass: apply each module's update just before it runs.

``optimizer.step()`` records the step (the hyper-parameters in force now) and returns; a
global forward pre-hook waits only for the groups holding a module's own parameters and
runs the optimizer's update on just those parameters, with the recorded hyper-parameters.
That is exact for torch's own per-parameter optimizers (SGD, Adam, AdamW, RMSprop, Adagrad,
...), whose update of one parameter reads only that parameter's gradient and state.

``step()`` keeps torch's meaning: one call per step, seeing every parameter. So a step is
deferred only when the optimizer's ``step`` is torch's own (no subclass overrides it) and no
step hook is registered (the optimizer's or torch's global ones); the per-subset updates run
torch's step *without* its hook wrapper. Anything else steps synchronously, and the engine
says once why (``deferral_blocker``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch
from torch.optim import optimizer as torch_optimizer

PER_PARAMETER_OPTIMIZERS = (
    "SGD", "Adam", "AdamW", "RMSprop", "Adagrad", "Adadelta", "Adamax", "NAdam", "RAdam", "ASGD", "Rprop",
)


def _step_owner(optimizer: torch.optim.Optimizer) -> type | None:
    """The class whose ``step`` runs when IMerge's step calls ``super().step()``."""
    mro = type(optimizer).__mro__
    mixin = next((i for i, cls in enumerate(mro) if cls.__dict__.get("_imerge_mixin")), -1)
    return next((cls for cls in mro[mixin + 1:] if "step" in cls.__dict__), None)


def _builtin(cls: type | None) -> bool:
    return (cls is not None and cls.__module__.startswith("torch.optim")
            and cls.__name__ in PER_PARAMETER_OPTIMIZERS)


def deferral_blocker(optimizer: torch.optim.Optimizer) -> str | None:
    """Why ``optimizer``'s step cannot be split over the next forward exactly (None: it can)."""
    owner = _step_owner(optimizer)
    if not _builtin(owner):
        name = type(optimizer).__qualname__
        if owner is not None and not owner.__module__.startswith("torch.optim"):
            return f"{owner.__qualname__} overrides step() (it must see every parameter at once)"
        return f"{name} is not one of torch's per-parameter optimizers ({', '.join(PER_PARAMETER_OPTIMIZERS)})"
    hooks = [("register_step_pre_hook", optimizer._optimizer_step_pre_hooks),
             ("register_step_post_hook", optimizer._optimizer_step_post_hooks),
             ("torch.optim.optimizer.register_optimizer_step_pre_hook", torch_optimizer._global_optimizer_pre_hooks),
             ("torch.optim.optimizer.register_optimizer_step_post_hook",
              torch_optimizer._global_optimizer_post_hooks)]
    for where, registered in hooks:
        if registered:
            hook = next(iter(registered.values()))
            return f"a step hook is registered ({where}: {getattr(hook, '__qualname__', hook)!r})"
    return None


def unhooked_step(optimizer: torch.optim.Optimizer) -> Callable[[torch.optim.Optimizer], Any]:
    """torch's own update of ``optimizer``'s class, without the wrapper that runs step hooks."""
    step = _step_owner(optimizer).__dict__["step"]
    return getattr(step, "__wrapped__", step) if getattr(step, "hooked", False) else step


class DeferredStep:
    """One recorded ``step()`` whose updates are applied module by module.

    ``had_gradient(i)`` tells whether any worker produced a gradient for parameter ``i`` this
    step (the engine reads it off the exchange), which decides skip (None) or step.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, engine, fired: list[int]) -> None:
        self.optimizer = optimizer
        self.base_step = unhooked_step(optimizer)
        self.engine = engine
        self.fired = fired
        self.hparams = [{k: _copy(v) for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
        self.pending: dict[int, int] = {id(p): i for i, p in enumerate(engine.params)  # id(param) -> index
                                        if engine.views[i] is not None}
        self.total = len(self.pending)
        self.by_gates = 0  # updates the forward's gates applied (the rest did not overlap)
        self.zero_after: dict[int, bool] = {}  # index -> set_to_none: zero_grad() ran while it was pending
        self.lock = threading.RLock()

    def owns(self, param: torch.Tensor) -> bool:
        return id(param) in self.pending

    def apply(self, params: list[torch.Tensor]) -> int:
        """Wait for the groups of ``params`` and apply their recorded update; how many were pending."""
        with self.lock:
            indices = [self.pending[id(p)] for p in params if id(p) in self.pending]
            if not indices:
                return 0
            engine = self.engine
            for g in sorted({engine.group_of[i] for i in indices}):
                group = engine.groups[g]
                engine.wait_group(group)
                group.submitted = False
            for i in indices:
                del self.pending[id(engine.params[i])]
            self._step_subset(indices)
            return len(indices)

    def flush(self) -> int:
        return self.apply([self.engine.params[i] for i in self.pending.values()])

    @property
    def finished(self) -> bool:
        return not self.pending

    def _step_subset(self, indices: list[int]) -> None:
        engine = self.engine
        chosen = {id(engine.params[i]) for i in indices}
        hidden = []
        for i in indices:
            p = engine.params[i]
            if self.fired[i] == 0:
                if not engine.none_when_unused or engine.had_gradient(i):
                    p.grad = engine.views[i]
                elif p.grad is not None:
                    hidden.append((p, p.grad))
                    p.grad = None
        saved = []
        for group, snap in zip(self.optimizer.param_groups, self.hparams):
            current = {k: group[k] for k in snap}
            saved.append((group["params"], current))
            group["params"] = [p for p in group["params"] if id(p) in chosen]
            group.update(snap)
        try:
            with torch.no_grad():
                self.base_step(self.optimizer)
        finally:
            for group, (params, current) in zip(self.optimizer.param_groups, saved):
                group["params"] = params
                group.update(current)
            for p, grad in hidden:
                p.grad = grad
        for i in indices:
            if i in self.zero_after:
                if self.zero_after.pop(i):
                    engine.params[i].grad = None
                else:
                    engine.views[i].zero_()


def _copy(value: Any) -> Any:
    return value.clone() if isinstance(value, torch.Tensor) else value
