"""``simulate()``: a model on a cluster under a schedule. Also the key layout, the fold of alike
workers, the simulated PS cost model and the plan search by simulation."""

from __future__ import annotations

import functools
import itertools
import math
import numbers
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..core.config import (
    CREDIT_BYTES,
    FUSION_THRESHOLD_BYTES,
    PARTITION_BYTES,
    SCHEDULE_TRAITS,
    SCHEDULES,
    TAIL_CREDIT_BYTES,
)
from ..core.layout import CALIBRATION_GRID, Placement, calibration_keys, cut_keys
from ..plan.costmodel import CostModel, LinearModel, PSModel, planner_model
from ..plan.planner import Plan, plan
from ..plan.search import (
    FOLD_TOLERANCE,
    HOST_FOLD_TOLERANCE,
    PARTITION_TOLERANCE,
    SearchBudgetSpent,
    candidate_plans,
    searched_plan,
)
from ..worker.schedule import SchedulePolicy, tail_group, windows
from .loop import _Sim
from .results import KeyInfo, SimResult
from .specs import FOLD_ABOVE, FOLD_HOSTS, FOLD_ORBIT_WORKERS, FOLD_WORKERS, ClusterSpec, ModelSpec

# The steady state: a run whose last iterations do not repeat the ones before them (the last within
# STEADY_TOLERANCE of the one before, or a cycle of up to MAX_PERIOD within CYCLE_TOLERANCE) is still in
# its transient (with the overlap, queues can take a few iterations to build up) and runs again with twice
# the iterations, up to MAX_ITERATIONS; its time is the mean of the last half, in whole cycles
# (``_steady_window``).
STEADY_TOLERANCE = 0.01
MAX_ITERATIONS = 24
MAX_PERIOD = 4
# Up to this many workers on the orbit fold the search's last choices are simulated on every worker
# (searched_plan's ``exact``): a few seconds each at 64 (benchmarks/results/fold-check.json's cpu_every_s).
EVERY_WORKER_DECIDES = 64
# A longer cycle must repeat exactly (the simulation is deterministic: a settled one repeats to rounding);
# within STEADY_TOLERANCE two iterations of a drifting transient can pass for a cycle of two.
CYCLE_TOLERANCE = 1e-6


def _cut(nbytes: int, partition_bytes: int | None, servers: int = 1) -> list[int]:
    """Key sizes as ``layout.cut_keys`` makes them (bytes; 4-byte elements assumed)."""
    if nbytes <= 0:
        return []
    ranges = cut_keys(max(1, nbytes // 4), 4, partition_bytes, servers)
    sizes = [(end - start) * 4 for start, end in ranges]
    sizes[-1] += nbytes - sum(sizes)
    return sizes


def _layout(groups: Sequence[Sequence[int]], sizes: Sequence[int], partition_bytes: int | None,
            cluster: ClusterSpec, cpu_deadline: float | None = None) -> tuple[list[list[int]], list[KeyInfo]]:
    """Keys of every group (``layout.cut_keys``, at least one per server and, with host aggregation, one
    per worker of the fullest host), placed by ``layout.Placement`` on the cluster's hosts, as the engine.
    ``cpu_deadline``: as :func:`simulate`'s (placing thousands of keys on hundreds of servers takes seconds)."""
    hosts = cluster.rank_hosts
    per_host = Counter(hosts[:cluster.workers])
    spread = max(cluster.servers, max(per_host.values()) if cluster.aggregates else 1)
    pushers = {h: 1 if cluster.aggregates else n for h, n in per_host.items()}
    placement = Placement(cluster.servers, list(hosts[cluster.workers:]), pushers)
    group_keys: list[list[int]] = []
    keys: list[KeyInfo] = []
    for g, members in enumerate(groups):
        ids = []
        for nbytes in _cut(sum(sizes[i] for i in members), partition_bytes, spread):
            if cpu_deadline is not None and not len(keys) & 63 and time.thread_time() > cpu_deadline:
                raise SearchBudgetSpent("IMerge simulate: the plan search's CPU budget ran out")
            ids.append(len(keys))
            keys.append(KeyInfo(g, nbytes, placement.place(nbytes)))
        group_keys.append(ids)
    return group_keys, keys


def fold_factor(cluster: ClusterSpec, stagger: bool = False) -> int:
    """How many workers one simulated worker stands for: on a ``hosts`` layout, ``host_fold``; where
    every rank has a host of its own (hosts=None), 1 up to ``FOLD_ABOVE`` workers, else the largest ``m``
    dividing W that leaves k = W/m >= ``FOLD_WORKERS`` workers; with ``stagger``, the largest that leaves a
    multiple of S (exact, below), else the largest that leaves at least ``FOLD_ORBIT_WORKERS``.

    Workers are alike (one model, one plan, one key layout), so k simulated workers can stand for W:
    simulated worker j stands for workers j, j + k, j + 2k, ... Without stagger they all push the same
    key at the same point, so each simulated push is ``m`` pushes at its server (its bytes weigh
    ``m``-fold on the server's link, and the server works ``m`` startups for it), each result ``m``
    results; servers are all simulated. With stagger worker j + ak starts its groups at server
    (j + ak) mod S, the same as j's where k is a multiple of S: exact again. Otherwise shifting workers
    by k and servers by k maps the cluster onto itself only where the key layout repeats with that
    shift, and :func:`server_orbits` folds servers s, s + k, ... (mod S) into one simulated server;
    the layout only roughly repeats (a server with one key more than its orbit's others is averaged
    with them), so that fold is approximate: ``SimResult.server_orbits`` says so, a plan search on it
    takes a partition size, stagger or window other than the configured one only where it wins by more
    than the fold's error (``FOLD_TOLERANCE``), and ``benchmarks/fold_check.py`` measures it against
    simulating every worker. The cost of an iteration then grows with k, not W x S.
    """
    W, S = cluster.workers, cluster.servers
    if cluster.hosts is not None:
        return host_fold(cluster)
    if W <= FOLD_ABOVE:
        return 1
    folds = [m for m in range(W // FOLD_WORKERS, 1, -1) if W % m == 0]
    if not stagger or S <= 1:
        return folds[0] if folds else 1
    exact = [m for m in folds if (W // m) % S == 0]
    if exact:
        return exact[0]
    return next((m for m in folds if W // m >= FOLD_ORBIT_WORKERS), 1)


def alike_hosts(cluster: ClusterSpec) -> tuple[int, int, int] | None:
    """(H, workers per host, servers per host) where every one of the H hosts has the same workers and at
    least one server, the ranks of each filling it in rank order (host 0 first); else None."""
    hosts = cluster.rank_hosts
    W, S = cluster.workers, cluster.servers
    H = len(set(hosts))
    if W % H or S % H:
        return None
    g, c = W // H, S // H
    if hosts[:W] != tuple(r // g for r in range(W)) or hosts[W:] != tuple(s // c for s in range(S)):
        return None
    return H, g, c


def host_fold(cluster: ClusterSpec) -> int:
    """How many alike hosts one simulated host stands for (a ``hosts`` layout, see ``alike_hosts``): 1 up
    to ``FOLD_ABOVE`` workers, else the largest ``f`` dividing H that leaves at least ``FOLD_HOSTS`` hosts.

    Simulated host j (its workers and servers, host aggregation inside it as unfolded) stands for the f
    hosts j*f .. (j+1)*f - 1, and its servers for theirs (``server_orbits``, ``_host_fold_layout``; the
    like keys of a group on one orbit summed together, as in the fold of one rank per host).
    A push from host h to a server of another orbit is f pushes from f real hosts to f servers, each on
    its own NICs: the simulated message carries one real push's bytes on each NIC. To its own orbit, one
    real pair in f is inside a host, so the message carries (f - 1)/f of its bytes on the NICs
    (``_Sim._pair_links``); every real NIC then carries on average what it does unfolded. The fold is
    approximate like the orbit fold (``SimResult.server_orbits`` says so; ``benchmarks/fold_check.py
    --hosts`` measures it against simulating every host).
    """
    shape = alike_hosts(cluster)
    if shape is None or cluster.workers <= FOLD_ABOVE:
        return 1
    H = shape[0]
    return next((f for f in range(H // FOLD_HOSTS, 1, -1) if H % f == 0), 1)


def _host_fold_layout(cluster: ClusterSpec, fold: int) -> tuple[tuple[int, ...], list[int], list[int]]:
    """The simulated ranks' hosts, each real server's simulated one and each simulated worker's real rank
    under ``host_fold`` ``fold``: simulated host j stands for the block of hosts j*fold .. (j+1)*fold - 1 and
    its servers for the block's servers. Blocks rather than every k-th host: the key layout fills servers
    in order, so servers next to each other carry alike loads and an orbit averages less. Its workers are
    those of one host of the block, chosen so that their start servers (stagger: rank mod S) cover the
    servers as evenly as the real workers' do; otherwise every simulated host could start on the same few
    servers (an artefact of the fold, not of the schedule)."""
    H, g, c = alike_hosts(cluster)  # type: ignore[misc]  # host_fold > 1 only on alike hosts
    k, S = H // fold, cluster.servers
    hosts = tuple(j for j in range(k) for _ in range(g)) + tuple(j for j in range(k) for _ in range(c))
    server_map = [(s // c // fold) * c + s % c for s in range(S)]
    starts = [0] * S
    worker_rank: list[int] = []
    for j in range(k):
        def crowding(h: int) -> tuple[int, int]:
            after = Counter((h * g + i) % S for i in range(g))
            return max(starts[s] + n for s, n in after.items()), h
        h = min(range(j * fold, (j + 1) * fold), key=crowding)
        for i in range(g):
            starts[(h * g + i) % S] += 1
            worker_rank.append(h * g + i)
    return hosts, server_map, worker_rank


def server_orbits(cluster: ClusterSpec, fold: int, stagger: bool) -> int | None:
    """How many simulated servers stand for the cluster's S under ``fold`` (``fold_factor``): None (all
    simulated) without stagger or where the simulated workers' start servers cover every server alike
    (W/fold a multiple of S), else ``gcd(W/fold, S)`` (approximate, see ``fold_factor``); with alike hosts
    folded (``host_fold``), S/fold, stagger or not."""
    if fold > 1 and cluster.hosts is not None:
        return cluster.servers // fold
    if fold <= 1 or not stagger or cluster.servers <= 1:
        return None
    orbits = math.gcd(cluster.workers // fold, cluster.servers)
    return None if orbits == cluster.servers else orbits


def _make_sim(*, fwd, bwd, layer_names, layer_tensors, groups, keys: list[KeyInfo], group_keys, cluster: ClusterSpec,
              priority: bool, stagger: bool, credit: int | None, push_after_backward: bool, overlap: bool,
              server_credit: int | None = None,
              tail_group: int | None = None, tail_credit: int | None = None,
              iterations: int, record: bool, fold: int = 1, waves: bool = False) -> _Sim:
    """The event loop for ``cluster``, its workers folded by ``fold`` (``fold_factor``): W/fold workers,
    with stagger the servers too (``server_orbits``), the fabric carrying 1/fold of the traffic."""
    fabric = None if cluster.fabric_Bps is None else cluster.fabric_Bps / fold
    orbits = server_orbits(cluster, fold, stagger)
    hosts: tuple[int, ...] | None = None if fold > 1 else cluster.rank_hosts  # one rank per host: all own hosts
    folded_hosts, server_map, worker_rank = 1, None, None
    if fold > 1 and cluster.hosts is not None:
        folded_hosts = fold
        hosts, server_map, worker_rank = _host_fold_layout(cluster, fold)
    return _Sim(fwd=fwd, bwd=bwd, layer_names=layer_names, layer_tensors=layer_tensors, groups=groups,
                group_keys=group_keys, key_bytes=[k.nbytes for k in keys],
                key_server=[k.server for k in keys],
                workers=cluster.workers // fold, servers=cluster.servers, bandwidth=cluster.bandwidth_Bps,
                startup=cluster.startup_s, priority=priority, stagger=stagger, credit=credit,
                push_after_backward=push_after_backward, overlap=overlap, iterations=iterations, record=record,
                fabric=fabric, share_cv=cluster.share_cv, share_period=cluster.share_period_s,
                share_seed=cluster.share_seed, tail_group=tail_group, tail_credit=tail_credit,
                worker_message=cluster.worker_message_s, hosts=hosts,
                aggregate=cluster.aggregates, local_bandwidth=cluster.local_Bps, reduce_rate=cluster.reduce_Bps,
                fold=fold, server_orbits=orbits, server_credit=server_credit, host_fold=folded_hosts,
                server_map=server_map, worker_rank=worker_rank, waves=waves)


# ---------------------------------------------------------------------------------- public API
def calibrate_model(cluster: ClusterSpec, sizes: Sequence[int] | None = None) -> PSModel:
    """The PSModel ``imerge_hooks.plan.calibrate`` would measure on the simulated cluster.

    Every worker pushes and pulls m bytes at once, cut into one key per server (as the real
    calibration), for m on ``sizes`` (default :data:`CALIBRATION_GRID`); T(m) is the time until
    every worker has every result; the table is fitted with :meth:`PSModel.fit`.
    """
    grid = tuple(int(m) for m in (sizes if sizes is not None else CALIBRATION_GRID))
    if not grid or any(m <= 0 for m in grid) or any(b <= a for a, b in zip(grid, grid[1:])):
        raise ValueError(f"IMerge simulate: calibration sizes must be positive and increasing, got {list(grid)}")
    return _calibrate_cached(cluster, grid)


@functools.lru_cache(maxsize=64)
def _calibrate_cached(cluster: ClusterSpec, grid: tuple[int, ...]) -> PSModel:
    times = []
    for m in grid:
        keys = [KeyInfo(0, (end - start) * 4, server) for start, end, server in calibration_keys(m, cluster.servers)]
        sim = _make_sim(fwd=[0.0], bwd=[0.0], layer_names=["calibration"], layer_tensors=[[0]], groups=[[0]],
                        keys=keys, group_keys=[list(range(len(keys)))], cluster=cluster, priority=False,
                        stagger=False, credit=None, push_after_backward=False, overlap=False, iterations=1,
                        record=False, fold=fold_factor(cluster))
        sim.run()
        times.append(max(s[1] - s[0] for s in sim.starts))
    return PSModel.fit(cluster.workers, cluster.servers, list(grid), times)


def search_by_simulation(model: ModelSpec, cluster: ClusterSpec, schedule: str, order: Sequence[int],
                         sizes: Sequence[int], ready: Sequence[float], cost_model: CostModel, *, partition_bytes: int,
                         credit_bytes: int, tail_credit_bytes: int | None, overlap_forward: bool | None,
                         iterations: int = 3, dtypes: Sequence[str] | None = None, cpu_deadline: float | None = None,
                         on_scored: Any = None) -> tuple[Plan, list]:
    """The plan search (``plan.search``): every candidate plan simulated on ``model`` and ``cluster``
    with ``schedule``'s own traits, the fastest kept; returns it and every candidate's score. The one
    rule the engine (``plan.choice.search_plan``, on its profile) and the simulator's own planned
    schedules (on the real model) share.

    ``sizes``/``ready`` (``dtypes``): the tensors in ready order; ``order[j]`` is the model's tensor at
    ready-order position ``j``. ``cpu_deadline``: as :func:`simulate` (``SearchBudgetSpent``).
    ``on_scored(seconds, groups, partition, stagger)`` sees every finished simulation.
    """
    def score(cand: list[list[int]], partition: int, stagger: bool | None = None,
              bound: float | None = None, server_credit: int | None = None, tail: bool = True,
              waves: bool = False, every_worker: bool = False) -> float:
        if cpu_deadline is not None and time.thread_time() > cpu_deadline:
            raise SearchBudgetSpent("IMerge simulate: the plan search's CPU budget ran out")
        seconds = simulate(model, cluster, schedule, timeline=False, groups=[[order[j] for j in g] for g in cand],
                           partition_bytes=partition, credit_bytes=credit_bytes,
                           tail_credit_bytes=tail_credit_bytes if tail else None,
                           cost_model=cost_model, overlap_forward=overlap_forward, iterations=iterations,
                           stagger=stagger, give_up_s=bound, cpu_deadline=cpu_deadline,
                           server_credit_bytes=server_credit, waves=waves,
                           fold_workers=not every_worker).iteration_s
        if on_scored is not None:
            on_scored(seconds, cand, partition, stagger)
        return seconds

    traits = SCHEDULE_TRAITS[schedule]
    # On an approximate fold (server_orbits, host_fold) a partition size, stagger or window other than the
    # configured one must win by more than that fold's error. On the orbit fold of up to 64 workers,
    # simulating every worker is cheap: stagger, window and tail credit are decided that way; above, the
    # search cannot judge stagger and runs without it, where the fold is exact.
    fold = fold_factor(cluster, True)
    exact = None
    unstaggered = False
    if fold > 1 and cluster.hosts is not None:
        tolerance = HOST_FOLD_TOLERANCE
    elif not traits.stagger or server_orbits(cluster, fold, True) is None:
        tolerance = PARTITION_TOLERANCE
    else:
        # The orbit fold with stagger can be far from every worker (ResNet-18 at W = S = 128, 256 KiB
        # partitions: 0.091 s folded, 0.153 s on every worker); without stagger it is exact.
        tolerance = FOLD_TOLERANCE
        if cluster.workers <= EVERY_WORKER_DECIDES:
            exact = functools.partial(score, every_worker=True)
        else:
            unstaggered, tolerance = True, PARTITION_TOLERANCE
    return searched_plan(candidate_plans(sizes, ready, cost_model, dtypes), score, sizes, ready, cost_model,
                         partition_bytes, traits.partition, staggered=traits.stagger and cluster.servers > 1,
                         windowed=traits.partition and cluster.servers > 1,
                         tolerance=tolerance, servers=cluster.servers,
                         tailed=traits.tail_credit and tail_credit_bytes is not None, exact=exact,
                         unstaggered=unstaggered)


def _check_groups(groups: Sequence[Sequence[int]], n: int) -> list[list[int]]:
    """An explicit plan as lists of ints, or ValueError if it is not a partition of 0..n-1."""
    out = [[int(i) for i in g] for g in groups]
    flat = sorted(i for g in out for i in g)
    if any(not g for g in out) or flat != list(range(n)):
        raise ValueError(f"IMerge simulate: groups must cover each of the model's {n} tensors exactly once, "
                         f"in non-empty groups; got {len(flat)} entries over {len(out)} groups")
    return out


def _positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value <= 0:
        raise ValueError(f"IMerge simulate: {name} must be a positive int, got {value!r}")
    return value


def _check_args(model: ModelSpec, cluster: ClusterSpec, schedule: str, cost_model: CostModel | None,
                **counts: int) -> None:
    """ValueError for an unknown schedule, a model or cluster of the wrong type, an invalid model, a count that
    is not a positive int or a cost model without ``time``."""
    if schedule not in SCHEDULE_TRAITS:
        raise ValueError(f"IMerge simulate: unknown schedule {schedule!r}; choose one of {', '.join(SCHEDULES)}")
    if not isinstance(model, ModelSpec):
        raise ValueError(f"IMerge simulate: model must be a ModelSpec, got {type(model).__name__}")
    if not isinstance(cluster, ClusterSpec):
        raise ValueError(f"IMerge simulate: cluster must be a ClusterSpec, got {type(cluster).__name__}")
    model.check()
    for name, value in counts.items():
        _positive_int(name, value)
    if cost_model is not None and not callable(getattr(cost_model, "time", None)):
        raise ValueError("IMerge simulate: cost_model needs a time(nbytes) method")


@dataclass
class _Compute:
    """A model's compute on a cluster: per-layer times (scaled by ``time_scale``), each layer's tensors,
    every tensor's bytes and ready time (from the start of backward) and the ready order."""

    fwd: list[float]
    bwd: list[float]
    layer_tensors: list[list[int]]
    sizes: list[int]
    ready_at: list[float]
    order: list[int]


def _compute(model: ModelSpec, cluster: ClusterSpec) -> _Compute:
    """Layer l's tensors are ready after the backward of layers L-1..l; the ready order is reverse
    registration order (ties inside a layer: later-registered first, as the profiler)."""
    scale = cluster.time_scale
    fwd = [layer.forward_s * scale for layer in model.layers]
    bwd = [layer.backward_s * scale for layer in model.layers]
    sizes = [int(b) for b in model.tensor_bytes]
    layer_tensors: list[list[int]] = []
    ready_at: list[float] = []
    suffix = list(itertools.accumulate(reversed(bwd)))[::-1]
    start = 0
    for index, layer in enumerate(model.layers):
        n = len(layer.param_bytes)
        layer_tensors.append(list(range(start, start + n)))
        ready_at += [suffix[index]] * n
        start += n
    order = list(reversed(range(len(sizes))))
    return _Compute(fwd, bwd, layer_tensors, sizes, ready_at, order)


@dataclass
class _Choice:
    """The groups to send (tensor indices in registration order, in send order) and what their plan
    settled: the planner's result and cost model (None: no planner ran), and the partition size, stagger
    and per-server window to use (the caller's, unless the plan chose them)."""

    groups: list[list[int]]
    partition_bytes: int
    stagger: bool | None
    server_credit_bytes: int | None
    plan: Plan | None = None
    cost_model: Any = None
    waves: bool | None = None


def _choose_plan(model: ModelSpec, cluster: ClusterSpec, schedule: str, compute: _Compute,
                 groups: Sequence[Sequence[int]] | None, *, cost_model: CostModel | None, plan_search: bool,
                 fusion_threshold_bytes: int, partition_bytes: int, credit_bytes: int,
                 tail_credit_bytes: int | None, overlap_forward: bool | None, iterations: int,
                 stagger: bool | None, server_credit_bytes: int | None, waves: bool | None = None) -> _Choice:
    """``groups`` if given, else one group per tensor (planner ``none``), else the schedule's planner on the
    tensors in ready order (``optimal`` with ``plan_search``: :func:`search_by_simulation`)."""
    traits = SCHEDULE_TRAITS[schedule]
    order, sizes = compute.order, compute.sizes
    if groups is not None:
        return _Choice(_check_groups(groups, len(sizes)), partition_bytes, stagger, server_credit_bytes, waves=waves)
    if traits.planner == "none" or not sizes:
        return _Choice([[i] for i in order], partition_bytes, stagger, server_credit_bytes, waves=waves)
    if traits.planner == "threshold":
        used_model = cost_model if cost_model is not None else LinearModel(0.0, 0.0)
    else:
        used_model = cost_model if cost_model is not None else calibrate_model(cluster)
    judged_on = planner_model(traits.planner, used_model)
    ordered_sizes, ordered_ready = [sizes[i] for i in order], [compute.ready_at[i] for i in order]
    if traits.planner == "optimal" and plan_search and len(sizes) > 1:
        chosen = search_by_simulation(model, cluster, schedule, order, ordered_sizes, ordered_ready, judged_on,
                                      partition_bytes=partition_bytes, credit_bytes=credit_bytes,
                                      tail_credit_bytes=tail_credit_bytes, overlap_forward=overlap_forward,
                                      iterations=iterations)[0]
    else:
        chosen = plan(ordered_sizes, ordered_ready, judged_on, traits.planner,
                      fusion_threshold_bytes=fusion_threshold_bytes)
    return _Choice(groups=[[order[j] for j in g] for g in chosen.groups],
                   partition_bytes=partition_bytes if chosen.partition_bytes is None else chosen.partition_bytes,
                   stagger=chosen.stagger if stagger is None else stagger,
                   server_credit_bytes=chosen.server_credit_bytes if server_credit_bytes is None
                   else server_credit_bytes,
                   plan=chosen, cost_model=used_model, waves=chosen.waves if waves is None else waves)


def _flow_control(schedule: str, cluster: ClusterSpec, choice: _Choice, ready_at: Sequence[float],
                  cost_model: CostModel | None, credit_bytes: int,
                  tail_credit_bytes: int | None) -> tuple[int | None, SchedulePolicy]:
    """The tail group (``schedule.tail_group``; None: no tail credit) and the send policy: priority and, for
    partitioned schedules, the credit windows (``schedule.windows``), as the engine sets them."""
    traits = SCHEDULE_TRAITS[schedule]
    tail = None
    if tail_credit_bytes is not None and traits.tail_credit and (choice.plan is None or
                                                                  choice.plan.tail_credit is not False):
        tail_model = cost_model if cost_model is not None else choice.cost_model
        if tail_model is None:
            tail_model = calibrate_model(cluster)
        tail = tail_group(choice.groups, ready_at, tail_model, credit_bytes)
    policy = SchedulePolicy(priority=traits.priority)
    if traits.partition:
        policy.credit_bytes, policy.server_credit_bytes = windows(credit_bytes, choice.partition_bytes,
                                                                  cluster.servers, choice.server_credit_bytes)
    return tail, policy


def _per_iteration(sim: _Sim, iterations: int) -> list[float]:
    """Every iteration's time: the latest worker's start of layer 0's forward to the next."""
    starts = [max(s[it] for s in sim.starts) for it in range(iterations + 1)]
    return [b - a for a, b in zip(starts, starts[1:])]


def _period(per_iteration: list[float]) -> int | None:
    """The shortest cycle (1 to ``MAX_PERIOD`` iterations) whose last occurrence repeats the one before it,
    never counting the first iteration: one iteration within ``STEADY_TOLERANCE`` of the one before, a
    longer cycle within ``CYCLE_TOLERANCE``; None: not settled. A settled run can cycle (a queue that
    drains every other iteration), so 1 alone would call it a transient until ``MAX_ITERATIONS``."""
    body = per_iteration[1:]
    for period in range(1, MAX_PERIOD + 1):
        if len(body) < 2 * period:
            break
        tolerance = STEADY_TOLERANCE if period == 1 else CYCLE_TOLERANCE
        if all(abs(a - b) <= tolerance * max(a, b) for a, b in zip(body[-period:], body[-2 * period:-period])):
            return period
    return None


def _steady_window(per_iteration: list[float], period: int = 1) -> list[float]:
    """The iterations the steady time averages: the last half, at least two, never the first (which starts
    with no communication pending), cut to whole cycles of ``period`` (at least one); the only one of a
    single iteration."""
    if len(per_iteration) < 2:
        return per_iteration
    count = min(len(per_iteration) - 1, max(2, len(per_iteration) // 2))
    if period > 1:
        count = min(len(per_iteration) - 1, max(period, count - count % period))
    return per_iteration[-count:]


def _result(sim: _Sim, schedule: str, model: ModelSpec, cluster: ClusterSpec, iterations: int, choice: _Choice,
            keys: list[KeyInfo], fold: int, orbits: int | None) -> SimResult:
    """The SimResult of a finished run: the steady iteration time (every iteration's but the first, the
    latest worker's start of layer 0's forward to the next), or ``inf`` if the run gave up."""
    common = dict(schedule=schedule, groups=choice.groups, keys=keys, workers=cluster.workers,
                  servers=cluster.servers, plan=choice.plan, cost_model=choice.cost_model, fold=fold,
                  server_orbits=orbits)
    if sim.gave_up:
        return SimResult(iteration_s=math.inf, throughput=0.0, iteration_times=[], timeline=[], **common)
    per_iteration = _per_iteration(sim, iterations)
    steady = _steady_window(per_iteration, _period(per_iteration) or 1)
    iteration_s = sum(steady) / len(steady)
    throughput = cluster.workers * model.batch_size / iteration_s if iteration_s > 0 else math.inf
    events = sorted(sim.timeline, key=lambda e: (e.start, e.end))
    return SimResult(iteration_s=iteration_s, throughput=throughput, iteration_times=per_iteration,
                     timeline=events, **common)


def simulate(model: ModelSpec, cluster: ClusterSpec, schedule: str, *, partition_bytes: int = PARTITION_BYTES,
             credit_bytes: int = CREDIT_BYTES,
             tail_credit_bytes: int | None = TAIL_CREDIT_BYTES,
             fusion_threshold_bytes: int = FUSION_THRESHOLD_BYTES,
             cost_model: CostModel | None = None, iterations: int = 3, overlap_forward: bool | None = None,
             timeline: bool = True, groups: Sequence[Sequence[int]] | None = None,
             plan_search: bool = True, stagger: bool | None = None, fold_workers: bool = True,
             give_up_s: float | None = None, cpu_deadline: float | None = None,
             server_credit_bytes: int | None = None, waves: bool | None = None) -> SimResult:
    """Simulate ``iterations`` iterations (more where they have not settled: the module doc) of ``model`` on
    ``cluster`` under ``schedule``.

    ``schedule`` is one of :data:`imerge_hooks.core.config.SCHEDULES`; its traits
    (``SCHEDULE_TRAITS``) decide planner, partitions, priority, stagger, credit and overlap.
    ``partition_bytes``/``credit_bytes`` matter for partitioned schedules (priority, imerge),
    ``tail_credit_bytes`` (None: off) for imerge (``schedule``, tail credit),
    ``fusion_threshold_bytes`` for ``threshold``. ``cost_model``: what the planner of
    mgwfbp/adaptive-ps/imerge uses (anything with ``.time(nbytes)``); None: the
    :func:`calibrate_model` of ``cluster``. ``overlap_forward``: as ``Config.overlap_forward``
    (None: as the schedule says). ``timeline=False`` skips recording events (faster for
    sweeps; ``SimResult.timeline`` is then empty). ``groups``: an explicit plan instead of
    the schedule's planner (lists of tensor indices in registration order, in send order,
    every tensor exactly once); the schedule's other traits still apply. ``plan_search``: as
    ``Config.plan_search``, the ``optimal`` planner (adaptive-ps, imerge) simulates its
    candidate plans (:mod:`imerge_hooks.plan.search`) and keeps the fastest, as the engine
    does; False: the DP's plan alone (the search may also choose ``stagger``, as the engine's does).
    ``stagger``: as ``SchedulePolicy.stagger`` (None: as the schedule, or its searched plan, says).
    ``give_up_s``: stop as soon as the steady iteration time is known to exceed this (a plan search's
    bound: a candidate that cannot win need not finish); ``iteration_s`` is then ``inf``.
    ``cpu_deadline``: raise :class:`imerge_hooks.plan.search.SearchBudgetSpent` once the calling
    thread's CPU time (``time.thread_time()``) passes this (a plan search's budget).
    ``server_credit_bytes``: a partitioned schedule's window per server (None: as ``schedule.windows``
    says, or as the searched plan chose). ``waves``: with stagger, rotate each wave of a group rather than
    the whole group (``schedule.key_slots``; None: as the searched plan chose, else the whole group).
    ``fold_workers``: simulate the alike workers of a large cluster through a few that stand for
    them (``fold_factor``; ``SimResult.fold`` says how many each stands for, and the timeline then
    has tracks for those only); False: every worker and server. A plan searched here up to 64 workers
    (``EVERY_WORKER_DECIDES``), which the search judged on every worker, is simulated on every worker
    where the fold would be the approximate one with stagger (``server_orbits``).
    See the module doc for the model.
    """
    _check_args(model, cluster, schedule, cost_model, partition_bytes=partition_bytes, credit_bytes=credit_bytes,
                fusion_threshold_bytes=fusion_threshold_bytes, iterations=iterations)
    traits = SCHEDULE_TRAITS[schedule]
    compute = _compute(model, cluster)
    choice = _choose_plan(model, cluster, schedule, compute, groups, cost_model=cost_model, plan_search=plan_search,
                          fusion_threshold_bytes=fusion_threshold_bytes, partition_bytes=partition_bytes,
                          credit_bytes=credit_bytes, tail_credit_bytes=tail_credit_bytes,
                          overlap_forward=overlap_forward, iterations=iterations, stagger=stagger,
                          server_credit_bytes=server_credit_bytes, waves=waves)
    group_keys, keys = _layout(choice.groups, compute.sizes, choice.partition_bytes if traits.partition else None,
                               cluster, cpu_deadline)
    staggered = traits.stagger if choice.stagger is None else bool(choice.stagger)
    fold = fold_factor(cluster, staggered) if fold_workers else 1
    orbits = server_orbits(cluster, fold, staggered)
    searched = groups is None and plan_search and traits.planner == "optimal"
    if orbits is not None and searched and cluster.workers <= EVERY_WORKER_DECIDES:
        # A searched plan the search judged on every worker is reported there too (the orbit fold with
        # stagger can be far off; docs/architecture.md, "Plan search").
        fold, orbits = 1, None
    tail, policy = _flow_control(schedule, cluster, choice, compute.ready_at, cost_model, credit_bytes,
                                 tail_credit_bytes)
    runs = iterations
    while True:
        sim = _make_sim(fwd=compute.fwd, bwd=compute.bwd, layer_names=[layer.name for layer in model.layers],
                        layer_tensors=compute.layer_tensors, groups=choice.groups, keys=keys, group_keys=group_keys,
                        cluster=cluster, priority=traits.priority, stagger=staggered,
                        credit=policy.credit_bytes, server_credit=policy.server_credit_bytes,
                        tail_group=tail, tail_credit=tail_credit_bytes,
                        push_after_backward=traits.push_after_backward,
                        overlap=traits.overlap_forward if overlap_forward is None else bool(overlap_forward),
                        iterations=runs, record=timeline, fold=fold, waves=staggered and bool(choice.waves))
        if give_up_s is not None and runs > 1:
            sim.give_up_s = float(give_up_s)
        sim.cpu_deadline = cpu_deadline
        if cpu_deadline is not None and time.thread_time() > cpu_deadline:  # the key layout above took it
            raise SearchBudgetSpent("IMerge simulate: the plan search's CPU budget ran out")
        sim.run()
        if sim.gave_up or runs < 3 or runs >= MAX_ITERATIONS or _period(_per_iteration(sim, runs)) is not None:
            return _result(sim, schedule, model, cluster, runs, choice, keys, fold, orbits)
        runs = min(2 * runs, MAX_ITERATIONS)
