"""After the profiling iterations, compute a fusion plan on worker 0 and adopt it everywhere; a search
longer than its CPU budget finishes in the background and its plan comes as a later plan epoch."""

from __future__ import annotations

import logging

from ..cluster import messages, session
from ..worker import streams
from ..worker.schedule import tail_group, windows
from .background import BackgroundSearch
from .cache import load_plan, plan_fit, plan_key, plan_path, store_plan
from .choice import choose_plan
from .costmodel import CostModel, LinearModel, planner_model
from .planner import Plan, plan
from .profiler import Profile, Profiler
from .search import SearchBudgetSpent

log = logging.getLogger("imerge")

POLL_STEPS = 5  # iterations between asks whether a background plan search has finished


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
        self.order: list[int] = []  # the plan's ready order (parameter indices)
        self.pending = False  # a background search is to replace the installed plan (every worker knows)
        self.background: BackgroundSearch | None = None  # worker 0's
        self.cache_entry: tuple[str, str] | None = None  # worker 0: (path, key) in the plan cache
        if engine.cfg.profile_steps <= 0:
            raise ValueError("IMerge: profile_steps must be >= 1 for planned schedules")
        if self.profiler.on_device:  # the host queues backward ahead of the GPU: time it there
            engine.timing_events = [None] * len(engine.params)

    def __call__(self, engine) -> None:
        if self.profiler.done:
            if self.pending:
                self._poll()
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
        self.order, result, tail, self.pending = messages.from_worker0(decision, f"the {self.method} plan")
        self._install(result, tail)

    def _install(self, result: Plan, tail: int | None) -> None:
        engine, topo = self.engine, self.engine.topo
        self.plan = result
        groups = [[self.order[j] for j in group] for group in result.groups]
        engine.set_layout(groups, partition_bytes=result.partition_bytes, tail_group=tail)
        changes: dict[str, object] = {}
        if result.stagger is not None:  # the search chose it, and whether in waves (plan.search.searched_plan)
            changes["stagger"], changes["waves"] = result.stagger, bool(result.waves)
        if engine.cfg.traits.partition:  # the windows follow the plan's partition size (schedule.windows)
            changes["credit_bytes"], changes["server_credit_bytes"] = windows(
                engine.cfg.credit_bytes, result.partition_bytes or engine.cfg.partition_bytes, topo.num_servers,
                result.server_credit_bytes)
        if changes:
            engine.set_policy(**changes)
        if engine.cfg.plan_log and topo.worker_rank == 0:
            print(self.describe(self.order), flush=True)
        log.info("IMerge: %s plan with %d groups installed as plan epoch %d%s", self.method, len(groups),
                 engine.epoch, " (the search goes on in the background)" if self.pending else "")

    def _cached_or_chosen(self) -> tuple[list[int], Plan, int | None, bool]:
        """Worker 0: the plan kept for this model, cluster and cost model (``plan.cache``), or a new
        one; and whether a background search is still to replace it."""
        engine, topo, profile = self.engine, self.engine.topo, self.profile
        cfg = engine.cfg
        if cfg.plan_cache and self.method != "none":
            table = list(zip(profile.names, profile.sizes, profile.dtypes, engine.trainable))
            key = plan_key(table, cfg, topo.num_workers, topo.num_servers, topo.host_indices,
                           topo.aggregate_in_host, self.model)
            self.cache_entry = (plan_path(session.config().cost_model_path, key), key)
            kept = load_plan(*self.cache_entry, plan_fit(table, cfg))
            if kept is not None:
                log.info("IMerge: %s plan from the plan cache %s (no search)", self.method, self.cache_entry[0])
                return (*kept, False)
        order = [i for i in profile.ready_order() if engine.trainable[i]]
        inputs = dict(sizes=[profile.sizes[i] for i in order], ready=[profile.ready_times[i] for i in order],
                      names=[profile.names[i] for i in order], cost_model=self.model, cfg=cfg,
                      workers=topo.num_workers, servers=topo.num_servers,
                      dtypes=[profile.dtypes[i] for i in order], forward_times=profile.forward_times,
                      hosts=topo.host_indices, host_aggregation=topo.aggregate_in_host)
        try:
            result = choose_plan(**inputs, cpu_budget_s=self._budget())
        except SearchBudgetSpent as spent:
            self.background = BackgroundSearch(inputs)
            log.info("IMerge: the %s plan search needs more than %g s of CPU: training goes on with the fastest plan "
                     "simulated so far while the search finishes in a background process (pid %d), installed as a "
                     "later plan epoch", self.method, cfg.plan_search_budget_s, self.background.process.pid)
            result = spent.best
            if result is None:
                result = plan(inputs["sizes"], inputs["ready"], self.model, "optimal", dtypes=inputs["dtypes"])
                result.note = "the DP's plan, while the search runs in the background"
            return order, result, self._tail_of(order, result), True
        return order, result, self._kept(order, result), False

    def _budget(self) -> float | None:
        """The foreground search's CPU budget, or None (to the end). A plan may change later only while
        every worker can tell that none has joined (see :meth:`_poll`): with join_divisor "active"
        and no host aggregation the servers' averages hide it, so the search ends in the foreground."""
        topo, cfg = self.engine.topo, self.engine.cfg
        if cfg.join_divisor == "active" and not topo.aggregate_in_host:
            return None
        return cfg.plan_search_budget_s

    def _tail_of(self, order: list[int], result: Plan) -> int | None:
        """A plan's tail group, its groups given as positions in ``order`` (None where its search turned the
        tail credit off)."""
        if result.tail_credit is False:
            return None
        return self._tail_group([[order[j] for j in group] for group in result.groups])

    def _kept(self, order: list[int], result: Plan) -> int | None:
        """Worker 0: a searched plan's tail group; the plan goes to the plan cache."""
        tail = self._tail_of(order, result)
        if self.cache_entry is not None:
            store_plan(self.cache_entry[0], self.cache_entry[1], order, result, tail)
        return tail

    def boundary_due(self, iteration: int) -> bool:
        """Whether the step that ends ``iteration`` must be synchronous: a background search's plan
        may be installed there (:meth:`_poll`)."""
        return self.pending and iteration % POLL_STEPS == 0

    def _poll(self) -> None:
        """Every ``POLL_STEPS`` iterations while a background search runs: worker 0 says whether it
        finished, and every worker installs its plan at this iteration boundary (a plan epoch).

        The question is a collective over the workers, so it is asked only after a round in which
        every worker trained (the group's training flag, the same on every worker): a worker that
        called join() takes part in no collective, and once one has, the plan stays as it is."""
        engine, topo = self.engine, self.engine.topo
        if engine.iteration % POLL_STEPS or not engine.groups:
            return
        if engine.groups[-1].trained(topo.num_workers) < topo.num_workers:
            self._stop("a worker has joined; the plan stays as it is")
            return
        state: tuple = ("pending",)
        if topo.worker_rank == 0:
            try:
                searched = self.background.result()
            except RuntimeError as exc:
                log.warning("IMerge worker 0: %s; the DP's plan stays", exc)
                state = ("failed",)
            else:
                if searched is not None:
                    state = ("plan", searched, self._kept(self.order, searched))
                    log.info("IMerge: the background plan search took %.1f s", self.background.seconds)
        state = messages.from_worker0(state, "the background plan search's state")
        if state[0] == "plan":
            self.pending = False
            self._install(state[1], state[2])
        elif state[0] == "failed":
            self._stop("the background plan search failed")

    def _stop(self, why: str) -> None:
        if self.pending:
            log.info("IMerge worker %d: %s", self.engine.topo.worker_rank, why)
        self.pending = False
        if self.background is not None:
            self.background.close()
            self.background = None

    def close(self) -> None:
        """The engine retires this replanner: module hooks go, a background search stops."""
        self.profiler.close()
        self._stop("the background plan search was stopped")

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
