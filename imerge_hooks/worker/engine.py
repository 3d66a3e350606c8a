"""Worker runtime for parameter gradients: grad hooks -> groups -> comm thread -> completion.

Gradients live in flat per-group buffers (``param.grad`` is a view into one), so a group is
pushed without a pack copy. A group goes to the comm thread as soon as every tensor in it
has its gradient (or at ``synchronize()`` for the ``default`` schedule). Layout changes
(a new fusion plan) happen only between iterations, as a numbered plan epoch.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import Counter
from collections.abc import Callable, Sequence

import torch

from ..cluster import collectives, session
from ..core.config import Config
from ..core.errors import IMergeUsageError
from ..core.layout import dtype_name
from . import key_table, streams
from .buffers import build_layout, count_keys
from .deferral import DeferredStep, Overlap
from .group import Group
from .schedule import SchedulePolicy

log = logging.getLogger("imerge")


class GradientEngine:
    """Synchronises the gradients of one set of named parameters through the servers."""

    def __init__(self, named_parameters: Sequence[tuple[str, torch.nn.Parameter]], config: Config) -> None:
        self.cfg = config
        self.topo = session.topology()
        self.comm = session.comm_thread()
        self.client = session.new_client_id()
        self.names = [name for name, _ in named_parameters]
        self.params = [p for _, p in named_parameters]
        self._index = {id(p): i for i, p in enumerate(self.params)}
        self._check_parameters()
        traits = config.traits
        self.policy = SchedulePolicy.from_config(config, self.topo.num_servers)
        self.immediate = not traits.push_after_backward
        self.passes = config.backward_passes_per_step
        self.iteration = 0
        self.epoch = 0
        self.counts = [0] * len(self.params)
        self.ready_at: list[float] = [0.0] * len(self.params)
        self.backward_started: float | None = None
        # Profiling on CUDA (set by the replanner): a timing event per tensor when its gradient is ready
        self.timing_events: list | None = None
        self.last_ready = 0.0
        self.groups: list[Group] = []
        self.group_of: list[int] = [-1] * len(self.params)
        self.views: list[torch.Tensor] = []
        self.without_gradient: set[int] = set()  # no worker produced a gradient this step
        # zero_grad(set_to_none=True) semantics: a parameter no worker produced a gradient for has
        # "no gradient" (skipped by step()); with set_to_none=False it keeps a zero gradient.
        self.none_when_unused = True
        self.listeners: list = []  # callables(engine) run after each synchronize (profiler, planner)
        # overlap_forward: the gates, the recorded step and who applied its updates (deferral.Overlap)
        self.overlap = Overlap(self, enabled=config.overlap and self.comm is not None)
        self._presence_slot: list[int] = [-1] * len(self.params)  # index into its group's presence tail
        # (event, module name, monotonic time, detail): for tests and timelines
        self.events: list | None = [] if config.record_events else None
        # First guess of the ready order: reverse registration order (as DDP assumes).
        self.trainable = [bool(p.requires_grad) for p in self.params]  # frozen ones sit out of the layout
        initial = self._one_per_tensor()
        self.partition_bytes = config.partition_bytes  # the plan search may change it
        self.set_layout(initial)
        self.replanner = None
        if config.traits.planner != "none":
            from ..plan.replan import Replanner

            self.replanner = Replanner(self)
            self.listeners.append(self.replanner)
        self.timeline = session.timeline()
        # Called with each group as it is submitted: returns a one-shot fn(error_or_None) the comm
        # thread runs when the group completes (the DDP hook resolves its futures with it).
        self.on_complete = None
        # The front end's handling of a sparse gradient (fn(param) -> dense gradient, or raises); None: refused.
        self.sparse_gradient: Callable[[torch.Tensor], torch.Tensor] | None = None
        self._hooks: dict[int, object] = {}
        self._connect()

    def _connect(self) -> None:
        """Where gradients come from and what the process asks of this engine: grad hooks on the
        parameters, flush and join callbacks, the timeline's module spans."""
        session.add_flush_callback(self.flush_deferred)
        session.add_join_callbacks(self._finish_before_join, self._take_parameters_of, self.shadow_round)
        if self.timeline is not None:
            self.timeline.watch_modules(lambda m: any(id(p) in self._index for p in m._parameters.values()
                                                      if p is not None))
        self._register_hooks()

    # ------------------------------------------------------------------ checks
    def _check_parameters(self) -> None:
        where = f"worker {self.topo.worker_rank}"
        seen: dict[str, int] = {}
        for name, p in zip(self.names, self.params):
            if name in seen:
                raise ValueError(f"IMerge: {where}: parameter name {name!r} is used twice; names must be unique")
            seen[name] = 1
            if not isinstance(p, torch.Tensor):
                raise TypeError(f"IMerge: {where}: {name!r} is a {type(p).__name__}, not a tensor")
            dtype_name(p.dtype, name, where)
        if len(self._index) != len(self.params):
            raise ValueError(f"IMerge: {where}: the same parameter tensor appears twice in named_parameters")

    # ------------------------------------------------------------------ layout
    def _one_per_tensor(self) -> list[list[int]]:
        """First guess of the ready order: reverse registration order (as DDP assumes)."""
        return [[i] for i in reversed(range(len(self.params))) if self.trainable[i]]

    def _register_hooks(self) -> None:
        for i, p in enumerate(self.params):
            if self.trainable[i] and i not in self._hooks:
                self._hooks[i] = p.register_post_accumulate_grad_hook(self._on_grad)
            elif not self.trainable[i] and i in self._hooks:
                self._hooks.pop(i).remove()

    def trainable_changed(self) -> bool:
        return any(bool(p.requires_grad) != t for p, t in zip(self.params, self.trainable))

    def _adopt_trainable(self) -> None:
        """Layers were frozen or unfrozen: new layout (plan epoch) over the trainable parameters.

        Gradients of newly unfrozen parameters were computed this iteration outside the old
        layout; every group holding one is exchanged once more so they are averaged too. Which
        groups is decided from what every worker knows (the same parameters were unfrozen
        everywhere), not from local gradients: a worker that did not use an unfrozen parameter
        pushes zeros with its presence flag off, and the parameter gets no gradient only if no
        worker had one. The other members of those groups keep what they had.
        """
        old = self.trainable
        self.trainable = [bool(p.requires_grad) for p in self.params]
        fresh = [i for i, (was, now) in enumerate(zip(old, self.trainable)) if now and not was]
        self.set_layout(self._one_per_tensor())
        self._register_hooks()
        if self.replanner is not None:
            from ..plan.replan import Replanner

            self.listeners.remove(self.replanner)
            self.replanner.close()  # an unfinished profile leaves global module hooks; a search stops
            self.replanner = Replanner(self)
            self.listeners.append(self.replanner)
        log.info("IMerge worker %d: trainable parameters changed (%d unfrozen); plan epoch %d",
                 self.topo.worker_rank, len(fresh), self.epoch)
        if not fresh or self.comm is None:
            return
        fresh_set = set(fresh)
        groups = sorted({self.group_of[i] for i in fresh})
        kept: dict[int, torch.Tensor | None] = {}
        for g in groups:  # part of the step that just ended (its number was already counted)
            group = self.groups[g]
            for i in group.members:
                if i not in fresh_set:
                    grad = self.params[i].grad
                    kept[i] = None if grad is None else grad.detach().clone()
                if self.params[i].grad is None:
                    self.views[i].zero_()
            present = [self.params[i].grad is not None for i in group.members]
            self._submit(group, self.iteration - 1, present)
        for g in groups:
            self.wait_group(self.groups[g])
            self.groups[g].submitted = False
        for g in groups:
            for i in self.groups[g].members:
                p = self.params[i]
                if i in kept:
                    if kept[i] is None:
                        p.grad = None
                    else:
                        self.views[i].copy_(kept[i])
                        p.grad = self.views[i]
                elif self.had_gradient(i) or not self.none_when_unused:
                    p.grad = self.views[i]
                else:
                    p.grad = None
                    self.without_gradient.add(i)

    def set_layout(self, plan: list[list[int]], partition_bytes: int | None = None,
                   tail_group: int | None = None) -> None:
        """Rebuild groups for ``plan`` (lists of parameter indices, in send order).

        ``partition_bytes``: the key size limit of partitioned schedules from now on (the plan
        search may choose one); None keeps the current one. ``tail_group``: the group whose
        submission starts the tail credit (``schedule.tail_start_group``; None: no tail). Must
        be called on every worker at
        the same iteration boundary (it registers a new plan epoch with the servers, a
        collective step).
        """
        if partition_bytes is not None:
            if partition_bytes <= 0:
                raise ValueError(f"IMerge: partition_bytes must be positive, got {partition_bytes}")
            self.partition_bytes = int(partition_bytes)
        if self.groups and any(g.submitted and not g.done.is_set() for g in self.groups):
            raise IMergeUsageError("IMerge internal: layout change while groups are in flight")
        covered = sorted(i for group in plan for i in group)
        if covered != [i for i, t in enumerate(self.trainable) if t]:
            raise ValueError("IMerge: a plan must list every trainable parameter index exactly once")
        # Results of the old layout are no longer needed (every group was taken): free them before
        # the new buffers exist, so a plan change peaks at 3x, not 4x, the gradient bytes.
        for group in self.groups:
            group.result = None
            group.release_buffers()
        self._spare_views = []
        placement = self.topo.placement()
        key_ids = iter(key_table.allocate_keys(self._count_keys(plan)))
        built = build_layout(self.params, self.names, plan, self.cfg.compression, self.partition_limit,
                             self.topo.key_spread, placement, key_ids, self.topo.aggregate_in_host)
        groups = built.groups
        for i in range(len(self.params)):
            if built.group_of[i] >= 0:
                self.group_of[i], self._presence_slot[i] = built.group_of[i], built.presence_slot[i]
        views, spare = built.views, built.spare
        if tail_group is not None and groups:
            groups[-1].urgent = True
            groups[tail_group].tail_keys = len(groups[-1].keys)
        self.groups = groups
        self.views = views
        self._spare_views = spare
        # id(param) -> index of the parameters in this layout (a recorded step's pending updates start as it)
        self.laid_out = {id(p): i for i, p in enumerate(self.params) if views[i] is not None}
        self.kinds = [(p.dtype, p.device) for p in self.params]  # what the buffers were built for
        self.group_arrived = [0] * len(groups)
        self.epoch = key_table.register_keys(self.client, [k for g in groups for k in g.keys],
                                           [(n, tuple(p.shape), str(p.dtype)) for n, p in zip(self.names, self.params)])
        if self.topo.num_servers > 1:
            log.info("IMerge worker %d: plan epoch %d, %d groups, %d keys, server load max/mean %.3f",
                     self.topo.worker_rank, self.epoch, len(groups), sum(len(g.keys) for g in groups),
                     placement.balance())

    def set_policy(self, **changes: object) -> None:
        """Change how this engine's groups are pushed from the next submission on (fields of
        ``SchedulePolicy``). A new policy object: groups in flight keep the one they went with."""
        self.policy = dataclasses.replace(self.policy, **changes)

    @property
    def partition_limit(self) -> int | None:
        """The key size limit of this plan: ``partition_bytes`` for partitioned schedules, else None."""
        return self.partition_bytes if self.cfg.traits.partition else None

    def _count_keys(self, plan: list[list[int]]) -> int:
        return count_keys(self.params, plan, self.cfg.compression, self.partition_limit, self.topo.key_spread)

    # ------------------------------------------------------------------ backward
    def _on_grad(self, param: torch.Tensor) -> None:
        i = self._index[id(param)]
        if self.deferred is not None and self.deferred.owns(param):
            raise IMergeUsageError(
                f"IMerge worker {self.topo.worker_rank}: {self.names[i]!r} got a gradient before its deferred "
                "update was applied: this iteration used it through a path the first (synchronous) iterations "
                "did not show and that is not a module attribute or parameters() (e.g. a reference kept in a "
                "list). Pass overlap_forward=False for this model")
        if param.dtype != self.kinds[i][0] or param.device != self.kinds[i][1]:
            raise self._converted(i)
        if self.backward_started is None:
            self.backward_started = time.monotonic()
        view = self.views[i]
        grad = param.grad
        if grad is not view:
            if grad.is_sparse and self.sparse_gradient is not None:
                grad = self.sparse_gradient(param)  # made dense, or refused naming the tensor
            if grad.dtype != view.dtype or grad.is_sparse:
                raise TypeError(f"IMerge worker {self.topo.worker_rank}: gradient of {self.names[i]!r} is "
                                f"{'sparse ' if grad.is_sparse else ''}{grad.dtype}, expected dense {view.dtype}")
            view.copy_(grad)
            param.grad = view
        self.groups[self.group_of[i]].note_producer()
        self.gradient_ready(i)

    def _converted(self, i: int) -> IMergeUsageError:
        """Parameter ``i`` changed dtype or device since the layout was built (``model.double()``,
        ``.half()``, ``.to(...)`` after the engine was made): its gradient buffer no longer fits it."""
        p, (dtype, device) = self.params[i], self.kinds[i]
        return IMergeUsageError(
            f"IMerge worker {self.topo.worker_rank}: parameter {self.names[i]!r} changed from {dtype} on {device} "
            f"to {p.dtype} on {p.device} after IMerge took it (model.double(), .half() or .to() after "
            "DistributedOptimizer); IMerge's gradient buffers have the dtypes and devices the "
            "parameters had then. Convert the model first, then wrap the optimizer")

    def accept(self, i: int, gradient: torch.Tensor) -> None:
        """Tensor ``i``'s gradient arrives as a tensor (the DDP hook's bucket): copy it in, count it."""
        if self.backward_started is None:
            self.backward_started = time.monotonic()
        group = self.groups[self.group_of[i]]
        group.before_write()
        self.views[i].copy_(gradient.reshape(self.views[i].shape))
        group.note_producer()
        self.gradient_ready(i)

    def gradient_ready(self, i: int) -> None:
        """Tensor ``i``'s gradient is in its view: count it and submit its group once complete."""
        if self.backward_started is None:
            self.backward_started = time.monotonic()
        self.counts[i] += 1
        if self.counts[i] > self.passes:
            raise IMergeUsageError(
                f"IMerge worker {self.topo.worker_rank}: gradient of {self.names[i]!r} computed "
                f"{self.counts[i]} times before step(); backward_passes_per_step={self.passes}. Call step() "
                "(or synchronize()) after each group of backward passes, or raise backward_passes_per_step")
        if self.counts[i] < self.passes:
            return
        self.last_ready = time.monotonic()
        self.ready_at[i] = self.last_ready - self.backward_started
        if self.timing_events is not None:
            self.timing_events[i] = streams.timing_event(self.params[i].device)
        g = self.group_of[i]
        self.group_arrived[g] += 1
        if self.immediate and self.group_arrived[g] == len(self.groups[g].members):
            self._submit(self.groups[g])

    def _submit(self, group: Group, round_number: int | None = None, present: list[bool] | None = None) -> None:
        """Send ``group`` (this step's, or round ``round_number``'s); ``present``: per member, whether this
        worker has a gradient for it (default: whether its backward passes all arrived)."""
        if self.comm is None:
            group.done.set()
            group.submitted = True
            return
        group.flat[group.active_at] = 1  # this worker trains (not shadowing a round in join())
        flags = group.flat[group.presence_at:group.active_at]
        if present is None and self.group_arrived[group.index] == len(group.members):
            flags.fill_(1)
        else:
            if present is None:
                present = [self.counts[i] >= self.passes for i in group.members]
            flags.copy_(torch.tensor(present, dtype=flags.dtype))
        group.mark_ready()
        if self.on_complete is not None:
            group.callbacks.append(self.on_complete(group))
        self.comm.submit(group, self.policy, self.iteration if round_number is None else round_number)

    # ------------------------------------------------------------------ iteration end
    @property
    def in_flight(self) -> bool:
        return any(g.submitted and not g.done.is_set() for g in self.groups)

    @property
    def pending_gradients(self) -> bool:
        return any(self.counts)

    def had_gradient(self, i: int) -> bool:
        """Whether any worker produced a gradient for tensor ``i`` in the exchange just taken.

        Carried with the push (each group's presence flags are averaged with it), never inferred
        from the values: an exactly-zero average is still a gradient, as in DDP.
        """
        if self.counts[i] >= self.passes:
            return True
        if self.comm is None or not self.topo.num_servers:
            return False
        group = self.groups[self.group_of[i]]
        return group.flag(group.presence_at + self._presence_slot[i]) != 0

    def push_remaining(self) -> None:
        """Submit every group not sent yet; tensors with no gradient go as zeros."""
        for group in self.groups:
            if group.submitted:
                continue
            for i in group.members:
                if self.counts[i] == 0:
                    self.views[i].zero_()
            self._submit(group)

    def wait_group(self, group: Group) -> None:
        """Wait for ``group`` and leave its averaged gradients in ``.grad`` (main thread)."""
        if self.comm is not None:
            self.comm.wait(group)
        self._take_result(group)
        if self._divide_by_trained and group.rescaled != group.round:
            group.rescaled = group.round
            trained = group.trained(self.topo.num_workers)
            if 0 < trained < self.topo.num_workers:  # some workers shadowed this round from join()
                group.flat[:group.presence_at].mul_(self.topo.num_workers / trained)

    @property
    def _divide_by_trained(self) -> bool:
        """``join_divisor="active"`` where joined workers shadow rounds (host aggregation): the servers
        divide by every worker, the workers rescale to the ones that trained."""
        return self.cfg.join_divisor == "active" and self.topo.aggregate_in_host

    def shadow_round(self, wait) -> int | None:
        """This worker waits in join() while others still train, with host aggregation: it takes part
        in their next round with zero gradients and its flags off, as Horovod's joined ranks do in
        all-reduces (its host's sums need it, and it may push some of its host's keys). ``wait(group)``
        waits for one group. Returns how many workers trained in that round (0: all have joined; None:
        nothing to shadow)."""
        if self.comm is None or not self.groups:
            return None
        for group in self.groups:
            group.flat.zero_()
            group.mark_ready()
            self.comm.submit(group, self.policy, self.iteration)
        trained = 0
        for group in self.groups:
            wait(group)
            self._take_result(group)
            group.submitted = False
            trained = max(trained, group.trained(self.topo.num_workers))
        self.iteration += 1
        return trained

    def _take_result(self, group: Group) -> None:
        """The caller's stream waits for the group's results (CUDA); swap groups: the result buffer
        becomes the gradient buffer, re-point the views."""
        group.use_results()
        if not group.take_result():
            return
        for i in group.members:
            self.views[i], self._spare_views[i] = self._spare_views[i], self.views[i]
            if self.params[i].grad is not None:
                self.params[i].grad = self.views[i]

    def synchronize(self) -> None:
        """Push what is left, wait for every result, and leave averaged gradients in ``.grad``."""
        self.flush_deferred()
        changed = self.trainable_changed()
        if not self.pending_gradients and not any(g.submitted for g in self.groups) and not changed:
            # Nothing was computed since the last step: nothing moves (grads are None after zero_grad)
            # and the step still counts, so a worker that skipped its backward is a round behind
            # the others and the servers say so at its next push.
            self.without_gradient = set()
            self.iteration += 1
            return
        self.push_remaining()
        wait_start = time.monotonic()
        for group in self.groups:
            self.wait_group(group)
        if self.timeline is not None:
            self.timeline.span("wait for all groups", "wait", wait_start, time.monotonic())
        self.finish_iteration()
        if changed:
            self._adopt_trainable()

    def _finish_before_join(self) -> None:
        """join(): push what a backward left without its step (a round of its own); a step with nothing
        to push does not count here, so a joined worker's shadow rounds keep the others' numbers."""
        if self.pending_gradients or any(g.submitted for g in self.groups) or self.trainable_changed():
            self.synchronize()

    def _record_backward(self) -> None:
        if self.timeline is not None and self.backward_started is not None:
            self.timeline.span("backward", "backward", self.backward_started, self.last_ready)

    def finish_iteration(self) -> None:
        self._record_backward()
        self.without_gradient = set()
        for i, p in enumerate(self.params):
            if self.counts[i] == 0 and self.views[i] is not None:
                if not self.none_when_unused or self.had_gradient(i):
                    p.grad = self.views[i]
                else:
                    self.without_gradient.add(i)
        for group in self.groups:
            group.submitted = False
        self._clear_round()
        self.iteration += 1
        self.overlap.learn()
        for listener in list(self.listeners):
            listener(self)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """``optimizer.zero_grad()`` as torch does it; the gradient buffers stay IMerge's.

        ``set_to_none=True``: every ``.grad`` becomes None (the next backward's gradient is copied
        into the flat buffer by the grad hook), so a parameter that gets no gradient is skipped
        by ``step()``, as in torch. ``False``: the buffers are zeroed in place.
        """
        self.none_when_unused = set_to_none
        if self.deferred is not None:
            # Pending updates still need their gradients: clear each one right after it is applied.
            for i in self.deferred.pending.values():
                self.deferred.zero_after[i] = set_to_none
            self._clear_gradients(set_to_none, skip=set(self.deferred.pending.values()))
            return
        if self.in_flight:
            raise IMergeUsageError(
                f"IMerge worker {self.topo.worker_rank}: zero_grad() called while gradients are being pushed "
                "to the servers; call optimizer.step() or optimizer.synchronize() first")
        if self.pending_gradients:
            self._clear_round()
        self._clear_gradients(set_to_none)

    def _clear_round(self) -> None:
        """Forget this round's arrivals (the gradients counted, the groups' arrivals, the backward's start):
        the round ended (``finish_iteration``, ``defer_step``) or was dropped (``zero_grad``)."""
        self.counts = [0] * len(self.params)
        self.group_arrived = [0] * len(self.groups)
        self.backward_started = None

    def _clear_gradients(self, set_to_none: bool, skip: set[int] = frozenset()) -> None:
        for i, (p, view) in enumerate(zip(self.params, self.views)):
            if i in skip:
                continue
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                if view is None:
                    p.grad.zero_()  # frozen: not IMerge's buffer
                else:
                    view.zero_()
                    p.grad = view

    # ------------------------------------------------------------------ overlap with the next forward
    def index_of(self, param: torch.Tensor) -> int | None:
        """Parameter ``param``'s index in this engine, None if it is not one of its parameters."""
        return self._index.get(id(param))

    @property
    def deferred(self) -> DeferredStep | None:
        """The recorded step whose updates the next forward applies (None: none pending)."""
        return self.overlap.deferred

    @property
    def applied_by(self) -> Counter[str]:
        return self.overlap.applied_by

    def can_defer(self, optimizer: torch.optim.Optimizer) -> bool:
        """Whether this ``step()`` may be applied during the next forward (else it runs now)."""
        # Profiling, and the iterations where a background plan search may install its plan, end at a
        # synchronous step: the plan listener runs there (the same iterations on every worker).
        profiling = self.replanner is not None and (not self.replanner.profiler.done
                                                    or self.replanner.boundary_due(self.iteration + 1))
        return (not profiling and self.pending_gradients and not self.trainable_changed()
                and self.overlap.can_defer(optimizer))

    def defer_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Send what is left, end the iteration without waiting, and record the step: its updates
        are applied in the next forward (``deferral.Overlap``)."""
        self.flush_deferred("the next step()")
        self.push_remaining()
        self._record_backward()
        fired = self.counts  # _clear_round makes a new list
        self._clear_round()
        self.iteration += 1
        self.overlap.defer(optimizer, fired)

    def flush_deferred(self, reason: str = "the next step()") -> None:
        """Apply every pending update of the recorded step (waits for its groups); ``reason``: who asked."""
        self.overlap.flush(reason)

    def wait_params(self, indices: list[int]) -> None:
        """Wait for the groups holding parameters ``indices`` and take their results (a deferred update)."""
        for g in sorted({self.group_of[i] for i in indices}):
            group = self.groups[g]
            self.wait_group(group)
            group.submitted = False

    def _take_parameters_of(self, worker: int) -> None:
        """After join(): every worker takes ``worker``'s parameters and step count (DDP's Join does too)."""
        topo = self.topo
        if topo.num_workers == 1:
            return
        mine = (self.iteration, [p.detach().cpu() for p in self.params]) if topo.worker_rank == worker else None
        iteration, values = collectives.collective(topo.worker_comm, "bcast", mine, "the last joiner's parameters",
                                                   root=worker)
        self.iteration = iteration
        if topo.worker_rank != worker:
            with torch.no_grad():
                for p, value in zip(self.params, values):
                    p.copy_(value)

    def remove(self) -> None:
        for hook in self._hooks.values():
            hook.remove()
        self._hooks = {}

    def close(self) -> None:
        """Retire this engine: hooks and runtime callbacks go, its keys leave the servers (a plan
        epoch, so every worker closes at the same point), group buffers are released.

        Gradients that are views into those buffers keep them alive until they are dropped.
        """
        self.flush_deferred("close()")
        self.overlap.say_summary()
        if self.groups and self.comm is not None and self.comm.failed is None:
            key_table.unregister_keys(self.client)
        self.remove()
        self.overlap.close()
        if self.replanner is not None:
            self.replanner.close()
        session.remove_callbacks(self.flush_deferred, self._finish_before_join, self._take_parameters_of,
                                 self.shadow_round)
        for group in self.groups:
            group.flat = group.result = group.staging = None
            group.release_buffers()
        self.groups, self.views, self._spare_views = [], [], []
