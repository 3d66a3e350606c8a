"""Overlap with the next forward pass: apply each module's update just before it runs.

``optimizer.step()`` records the step (the hyper-parameters in force now) and returns; a
global forward pre-hook waits only for the groups holding a module's own parameters and
runs the wrapped optimizer's own ``step()`` on just those parameters, with the recorded
hyper-parameters. That is exact for every optimizer whose update is per parameter (SGD,
Adam, AdamW, RMSprop, Adagrad, ...); others step synchronously.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

PER_PARAMETER_OPTIMIZERS = (
    "SGD", "Adam", "AdamW", "RMSprop", "Adagrad", "Adadelta", "Adamax", "NAdam", "RAdam", "ASGD", "Rprop",
)


def supports_deferral(optimizer: torch.optim.Optimizer) -> bool:
    """Optimizers whose update of one parameter reads only that parameter's gradient and state."""
    return any(cls.__module__.startswith("torch.optim") and cls.__name__ in PER_PARAMETER_OPTIMIZERS
               for cls in type(optimizer).__mro__)


class DeferredStep:
    """One recorded ``step()`` whose updates are applied module by module."""

    def __init__(self, optimizer: torch.optim.Optimizer, base_step, engine, fired: list[int]) -> None:
        self.optimizer = optimizer
        self.base_step = base_step  # the wrapped class's step (unbound)
        self.engine = engine
        self.fired = fired
        self.hparams = [{k: _copy(v) for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
        self.pending: dict[int, int] = {id(p): i for i, p in enumerate(engine.params)  # id(param) -> index
                                        if engine.views[i] is not None}
        self.zero_after_apply = False
        self.lock = threading.RLock()

    def owns(self, param: torch.Tensor) -> bool:
        return id(param) in self.pending

    def apply(self, params: list[torch.Tensor]) -> None:
        """Wait for the groups of ``params`` and apply their recorded update."""
        with self.lock:
            indices = [self.pending[id(p)] for p in params if id(p) in self.pending]
            if not indices:
                return
            engine = self.engine
            for g in sorted({engine.group_of[i] for i in indices}):
                group = engine.groups[g]
                engine.wait_group(group)
                group.submitted = False
            for i in indices:
                del self.pending[id(engine.params[i])]
            self._step_subset(indices)

    def flush(self) -> None:
        self.apply([self.engine.params[i] for i in self.pending.values()])

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
                if not engine.none_when_unused or (engine.topo.num_servers and bool(engine.views[i].any())):
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
        if self.zero_after_apply:
            for i in indices:
                if engine.none_when_unused:
                    engine.params[i].grad = None
                else:
                    engine.views[i].zero_()


def _copy(value: Any) -> Any:
    return value.clone() if isinstance(value, torch.Tensor) else value
