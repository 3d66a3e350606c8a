"""After the profiling iterations, compute a fusion plan on worker 0 and adopt it everywhere."""

from __future__ import annotations

import logging

from .. import runtime, streams
from ..schedule import tail_group
from .cache import load_plan, plan_key, plan_path, store_plan
from .choice import choose_plan
from .costmodel import CostModel, LinearModel, planner_model
from .planner import Plan
from .profiler import Profile, Profiler

log = logging.getLogger("imerge")


def cost_model_for(method: str) -> CostModel:
    """The model a planner method is judged on: the measured PS model, or MG-WFBP's line fitted to it."""
    from .calibrate import load_or_calibrate

    return planner_model(method, load_or_calibrate())


class Replanner:
    """Engine listener: profiles ``profile_steps`` iterations, then installs the plan (plan epoch)."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.method = engine.cfg.traits.planner
        self.profiler = Profiler(engine.names, engine.params, engine.cfg.profile_steps)
        self.profile: Profile | None = None
        self.plan: Plan | None = None
        self.model: CostModel | None = None
        if engine.cfg.profile_steps <= 0:
            raise ValueError("IMerge: profile_steps must be >= 1 for planned schedules")
        if self.profiler.on_device:  # the host queues backward ahead of the GPU: time it there
            engine.timing_events = [None] * len(engine.params)

    def __call__(self, engine) -> None:
        if self.profiler.done:
            return
        self.profiler.record_iteration(self._ready_times(engine))
        if self.profiler.done:
            engine.timing_events = None
            self.apply()

    @staticmethod
    def _ready_times(engine) -> list[float]:
        """The iteration's ready times: the host's, or on CUDA the GPU time of each gradient's event
        after the first gradient's (waits for those events: profiling iterations only)."""
        events = engine.timing_events
        recorded = [i for i, event in enumerate(events or []) if event is not None]
        if not recorded:
            return engine.ready_at
        first = events[min(recorded, key=lambda i: engine.ready_at[i])]
        times = list(engine.ready_at)
        for i in recorded:
            times[i] = max(0.0, streams.seconds_between(first, events[i]))
        engine.timing_events = [None] * len(events)
        return times

    def apply(self) -> None:
        engine = self.engine
        topo = engine.topo
        self.profile = self.profiler.profile()
        self.model = cost_model_for(self.method) if topo.num_servers else LinearModel(0.0, 0.0)
        decision = None
        if topo.worker_rank == 0:
            decision = self._cached_or_chosen()
        order, result, tail = runtime.from_worker0(decision, f"the {self.method} plan")
        self.plan = result
        groups = [[order[j] for j in group] for group in result.groups]
        engine.set_layout(groups, partition_bytes=result.partition_bytes, tail_group=tail)
        if result.stagger is not None:  # the search chose it (plan.search.searched_plan)
            engine.set_policy(stagger=result.stagger)
        if engine.cfg.plan_log and topo.worker_rank == 0:
            print(self.describe(order), flush=True)
        log.info("IMerge: %s plan with %d groups installed as plan epoch %d", self.method, len(groups), engine.epoch)

    def _cached_or_chosen(self) -> tuple[list[int], Plan, int | None]:
        """Worker 0: the plan kept for this model, cluster and cost model (``plan.cache``), or a new one."""
        engine, topo, profile = self.engine, self.engine.topo, self.profile
        cfg = engine.cfg
        path = key = None
        if cfg.plan_cache and self.method != "none":
            table = list(zip(profile.names, profile.sizes, profile.dtypes, engine.trainable))
            key = plan_key(table, cfg, topo.num_workers, topo.num_servers, topo.host_indices,
                           topo.aggregate_in_host, self.model)
            path = plan_path(runtime.config().cost_model_path, key)
            kept = load_plan(path, key)
            if kept is not None:
                log.info("IMerge: %s plan from the plan cache %s (no search)", self.method, path)
                return kept
        order = [i for i in profile.ready_order() if engine.trainable[i]]
        sizes = [profile.sizes[i] for i in order]
        ready = [profile.ready_times[i] for i in order]
        dtypes = [profile.dtypes[i] for i in order]
        names = [profile.names[i] for i in order]
        result = choose_plan(sizes, ready, names, self.model, cfg, topo.num_workers, topo.num_servers,
                             dtypes=dtypes, forward_times=profile.forward_times,
                             hosts=topo.host_indices, host_aggregation=topo.aggregate_in_host)
        tail = self._tail_group([[order[j] for j in group] for group in result.groups])
        if path is not None:
            store_plan(path, key, order, result, tail)
        return order, result, tail

    def _tail_group(self, groups: list[list[int]]) -> int | None:
        """Where the tail credit starts: one credit's round trip (cost model) before the last group is due."""
        cfg = self.engine.cfg
        if not cfg.traits.tail_credit or cfg.tail_credit_bytes is None:
            return None
        return tail_group(groups, self.profile.ready_times, self.model, cfg.credit_bytes)

    def describe(self, order: list[int]) -> str:
        sizes = [self.profile.sizes[i] for i in order]
        head = (f"IMerge plan ({self.method}, epoch {self.engine.epoch}, model: "
                f"{getattr(self.model, 'describe', lambda: repr(self.model))()})")
        return head + "\n" + self.plan.describe(sizes)
