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

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch
from torch.optim import optimizer as torch_optimizer

from .gates import GateLearner
from .read_guard import AccessGuard

log = logging.getLogger("imerge")

PER_PARAMETER_OPTIMIZERS = (
    "SGD", "Adam", "AdamW", "RMSprop", "Adagrad", "Adadelta", "Adamax", "NAdam", "RAdam", "ASGD", "Rprop",
)


def _step_owner(cls: type) -> type | None:
    """The class whose ``step`` runs when IMerge's step calls ``super().step()`` on an instance of ``cls``."""
    mro = cls.__mro__
    mixin = next((i for i, base in enumerate(mro) if base.__dict__.get("_imerge_mixin")), -1)
    return next((base for base in mro[mixin + 1:] if "step" in base.__dict__), None)


def _builtin(cls: type | None) -> bool:
    return (cls is not None and cls.__module__.startswith("torch.optim")
            and cls.__name__ in PER_PARAMETER_OPTIMIZERS)


_classes: dict[type, tuple[str | None, Callable | None]] = {}  # optimizer class -> (blocker, torch's own step)


def _class_facts(cls: type) -> tuple[str | None, Callable | None]:
    """Why instances of ``cls`` cannot defer their step whatever hooks they have (None: they can), and
    torch's own update of the class without its hook wrapper; read once per class (a class's methods are
    its own for the life of the process)."""
    facts = _classes.get(cls)
    if facts is None:
        owner = _step_owner(cls)
        if _builtin(owner):
            step = owner.__dict__["step"]
            facts = None, (getattr(step, "__wrapped__", step) if getattr(step, "hooked", False) else step)
        elif owner is not None and not owner.__module__.startswith("torch.optim"):
            facts = f"{owner.__qualname__} overrides step() (it must see every parameter at once)", None
        else:
            facts = (f"{cls.__qualname__} is not one of torch's per-parameter optimizers "
                     f"({', '.join(PER_PARAMETER_OPTIMIZERS)})"), None
        _classes[cls] = facts
    return facts


def deferral_blocker(optimizer: torch.optim.Optimizer) -> str | None:
    """Why ``optimizer``'s step cannot be split over the next forward exactly (None: it can). Step hooks
    can come and go any time, so they are looked at on every call (four dict tests)."""
    why = _class_facts(type(optimizer))[0]
    if why is not None:
        return why
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
    step = _class_facts(type(optimizer))[1]
    if step is None:
        raise RuntimeError(f"IMerge internal: {type(optimizer).__qualname__}'s step cannot be deferred")
    return step


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
        self.pending: dict[int, int] = engine.laid_out.copy()  # id(param) -> index
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
            engine.wait_params(indices)
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


# Who may apply pending updates without a warning: the ends of training, and the next step()
# (parameters the forward did not use before it).
_QUIET_REASONS = frozenset({"the next step()", "close()", "shutdown()", "join()", "the end of a stage"})


class Overlap:
    """One engine's overlap of updates with the next forward: the gates (where each parameter's
    update is applied, learned in the first synchronous iterations, ``gates.GateLearner``), the
    recorded step (``DeferredStep``), the global forward pre-hook that applies a module's updates
    just before it runs, and who applied them (``applied_by``, logged once).

    The engine asks through :meth:`can_defer`, :meth:`defer` and :meth:`flush`; while a step is
    pending, ``gates.AccessGuard`` routes user code's reads here (:meth:`on_fetch`,
    :meth:`zero_pending`). Of the engine it reads the parameters and names, its settings and topology
    (log lines), the groups (``group_of``, ``wait_params``), the event record and the timeline; it
    writes only ``none_when_unused`` (``module.zero_grad(set_to_none=...)`` while a step is pending)."""

    def __init__(self, engine: Any, enabled: bool) -> None:
        self.engine = engine
        self.deferred: DeferredStep | None = None
        self.deferred_at = 0.0  # when it was recorded (timeline)
        self.forward_hook = None
        self.learner = GateLearner(engine.params) if enabled else None
        if self.learner is not None:
            AccessGuard.retain()
        self.gate_of_module: dict[int, list[int]] = {}  # id(module) -> parameter indices it gates
        self.gate_modules: dict[int, torch.nn.Module] = {}  # keeps gate modules' ids meaningful
        self.ungated: set[int] = set()  # applied at step(): no gate could be learned for them
        # Who applied the deferred updates (parameter counts): "forward gates", "step() (no gate)", or
        # the call that read parameters first; what is not the gates did not overlap (logged once).
        self.applied_by: Counter[str] = Counter()
        self.warned_outside = False
        self.warned_sync: set[str] = set()  # why a step could not be deferred (logged once each)

    def learn(self) -> None:
        """A synchronous step ended: fold its forward's first uses into the gates (``gates.py``)."""
        learner = self.learner
        if learner is None or learner.learned:
            return
        learner.end_iteration()
        if learner.learned:
            self.gate_of_module, self.gate_modules, self.ungated = learner.gates()
            if not learner.compiled:  # a compiled graph traced the learner's hooks: keep them (inert)
                learner.close()
            if self.ungated:
                engine = self.engine
                log.info("IMerge worker %d: %d parameter(s) have no forward gate; their updates are applied at "
                         "step(): %s", engine.topo.worker_rank, len(self.ungated),
                         ", ".join(engine.names[i] for i in sorted(self.ungated)[:8]))

    def can_defer(self, optimizer: torch.optim.Optimizer) -> bool:
        """Whether the gates are learned and ``optimizer``'s step can be split exactly (else it runs now,
        and the reason is logged once)."""
        engine = self.engine
        if not (engine.cfg.overlap and self.learner is not None and self.learner.learned):
            return False
        why = deferral_blocker(optimizer)
        if why is None and self.learner.compiled:
            why = (f"the forward runs {self.learner.compiled}: compiled graphs run no per-module hooks, so "
                   "updates cannot be applied inside them")
        if why is None:
            return True
        if why not in self.warned_sync and engine.topo.worker_rank == 0:
            log.warning("IMerge: the %r schedule overlaps updates with the next forward, but %s; step() applies "
                        "the update at once instead (exact, no overlap with the forward)", engine.cfg.schedule, why)
        self.warned_sync.add(why)
        return False

    def defer(self, optimizer: torch.optim.Optimizer, fired: list[int]) -> None:
        """Record the step (``fired``: gradients each parameter got this iteration); parameters without
        a gate are updated now, the rest by the next forward's gates."""
        engine = self.engine
        self.deferred = DeferredStep(optimizer, engine, fired)
        self.deferred_at = time.monotonic()
        self.applied_by["step() (no forward gate)"] += self.deferred.apply(
            [engine.params[i] for i in sorted(self.ungated)])
        if self.deferred.finished:
            self.end()
            return
        if self.forward_hook is None:
            self.forward_hook = torch.nn.modules.module.register_module_forward_pre_hook(self.before_forward)
            AccessGuard.activate(self)

    def on_fetch(self, param: torch.Tensor, reason: str) -> None:
        """``param`` is about to be read by ``reason`` (not the forward's gate): apply its update first."""
        deferred = self.deferred
        if deferred is None or not deferred.owns(param):
            return
        engine = self.engine
        self.applied_outside(reason, deferred.apply([param]), engine.names[engine.index_of(param)])
        if deferred.finished:
            self.end()

    def zero_pending(self, params: list[torch.Tensor], set_to_none: bool) -> set[int]:
        """``module.zero_grad()`` while updates are pending: clear the gradients of pending parameters
        right after their update (so the overlap survives it); ids of the parameters it took."""
        deferred = self.deferred
        if deferred is None:
            return set()
        taken = {id(p) for p in params if deferred.owns(p)}
        if any(self.engine.index_of(p) is not None for p in params):
            self.engine.none_when_unused = set_to_none
        for pid in taken:
            deferred.zero_after[deferred.pending[pid]] = set_to_none
        return taken

    def applied_outside(self, reason: str, count: int, name: str) -> None:
        """``count`` pending updates were applied by ``reason``, outside the forward's gates: say so once
        (not for the ends of training, nor for parameters the forward did not use before the next step)."""
        if not count:
            return
        self.applied_by[reason] += count
        if reason in _QUIET_REASONS:
            return
        if not self.warned_outside and self.engine.topo.worker_rank == 0:
            self.warned_outside = True
            log.warning("IMerge: %s read %r before the next forward reached it, so its pending update (and any "
                        "others read that way) was applied there, not overlapped with the forward (exact, slower). "
                        "Read parameters before step() or after the forward to keep the overlap; "
                        "IMERGE_LOG_LEVEL=info prints how many updates the forward applied at shutdown",
                        reason, name)

    def before_forward(self, module: torch.nn.Module, _args: Any) -> None:
        """The global forward pre-hook: wait for ``module``'s own parameters and apply their updates."""
        deferred = self.deferred
        if deferred is None:
            return
        engine = self.engine
        gated = self.gate_of_module.get(id(module), ())
        mine = [engine.params[i] for i in gated if deferred.owns(engine.params[i])]
        mine += [p for p in module._parameters.values() if p is not None and deferred.owns(p) and
                 not any(p is q for q in mine)]
        if not mine:
            return
        if engine.events is not None:
            ready = all(engine.groups[engine.group_of[engine.index_of(p)]].done.is_set() for p in mine)
            engine.events.append(("wait_begin", type(module).__name__, time.monotonic(), ready))
        wait_start = time.monotonic()
        applied = deferred.apply(mine)
        deferred.by_gates += applied
        self.applied_by["forward gates"] += applied
        if engine.timeline is not None:
            engine.timeline.span(f"wait+update {type(module).__name__}", "wait", wait_start, time.monotonic())
        if engine.events is not None:
            engine.events.append(("wait_end", type(module).__name__, time.monotonic(), None))
        if deferred.finished:
            self.end()

    def flush(self, reason: str = "the next step()") -> None:
        """Apply every pending update of the recorded step (waits for its groups); ``reason``: who asked.

        After a forward and backward, what is still pending belongs to parameters that forward did
        not use (hence the default). At ``shutdown()`` the overlap summary is logged (info level).
        """
        deferred = self.deferred
        if deferred is not None:
            pending = list(deferred.pending.values())
            name = self.engine.names[pending[0]] if pending else ""
            self.applied_outside(reason, deferred.flush(), name)
            self.end()
        if reason == "shutdown()":
            self.say_summary()

    def end(self) -> None:
        """The recorded step is applied: the forward hook goes. Groups submitted now belong to the next
        round (a flush from the next step() runs after its backward) and stay submitted, or
        push_remaining() would push them twice."""
        deferred, self.deferred = self.deferred, None
        engine = self.engine
        if engine.timeline is not None and deferred is not None:
            engine.timeline.span(f"overlap: {deferred.by_gates}/{deferred.total} updates in the forward", "overlap",
                                 self.deferred_at, time.monotonic())
        if self.forward_hook is not None:
            self.forward_hook.remove()
            self.forward_hook = None
            AccessGuard.deactivate(self)

    def summary(self) -> str:
        """One line: how many deferred updates the forward's gates applied, and who applied the rest."""
        rank = self.engine.topo.worker_rank
        total = sum(self.applied_by.values())
        gates = self.applied_by.get("forward gates", 0)
        if not total:
            return f"IMerge worker {rank}: no update was deferred into a forward"
        others = ", ".join(f"{why} {n}" for why, n in self.applied_by.most_common() if why != "forward gates")
        return (f"IMerge worker {rank}: {gates}/{total} deferred updates "
                f"({100.0 * gates / total:.1f}%) applied by the forward's gates"
                + (f"; the others by: {others}" if others else ""))

    def say_summary(self) -> None:
        """Log :meth:`summary` once (info level), if any update was deferred."""
        if self.applied_by:
            log.info("%s", self.summary())
        self.applied_by.clear()

    def close(self) -> None:
        if self.learner is not None:
            self.learner.close()
            AccessGuard.release()
            self.learner = None
