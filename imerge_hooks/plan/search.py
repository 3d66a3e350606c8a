"""Pick a fusion plan by simulating candidates, not by the one-channel DP alone.

Why: the ``optimal`` DP (:mod:`imerge_hooks.plan.planner`) is exact for ONE FIFO channel that
pays the measured startup ``a(W)`` per message. The runtime is not one channel: keys go
to S servers and many are in flight at once (credit window), so startups overlap and a
plan fused for the FIFO model can be slower than sending tensors as they are ready
(``benchmarks/run.py --rank-env IMERGE_PLAN_SEARCH=0`` measures the DP's plan alone).

So the planner proposes several plans and :func:`imerge_hooks.simulate.simulate`, which
models partitions, placement, credit, priority and overlap with the next forward, scores
each one with the schedule's own traits; the fastest wins. Candidates: the DP on the
measured model, the DP with the startup term scaled down (what pipelining hides), small
buckets that merge only small neighbouring gradients (BatchNorm weights and biases), and no
fusion at all. Ties (within ``TIE_TOLERANCE``) go to the earlier candidate, i.e. to
more fusion, which costs the servers fewer messages.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from .costmodel import CostModel
from .planner import Plan, _times, plan, simulate_fifo

log = logging.getLogger("imerge")

# Startup factors of the DP candidates: 1 is the published DP on the measured model.
STARTUP_FACTORS = (1.0, 0.5, 0.25, 0.125, 1 / 16, 1 / 64)
# Bucket sizes of the "merge only small gradients" candidates (bytes).
SMALL_BUCKETS = (64 << 10, 256 << 10, 1 << 20, 4 << 20)
# Partition sizes tried for the best plan (partitioned schedules), relative to the current size.
PARTITION_FACTORS = (1.0, 0.5, 0.25, 2.0)
# On many servers every group is cut into at least one key per server, so sizes between a few MiB and
# a group / S cut it into the same keys: a plateau the steps above cannot cross. There a jump to 1/16
# is tried too.
MANY_SERVERS = 16
MANY_SERVERS_FACTORS = PARTITION_FACTORS + (1 / 16,)
MIN_PARTITION_BYTES = 256 << 10
SEARCH_ROUNDS = 4  # alternations of partition size and plan (search)
TIE_TOLERANCE = 0.005  # relative: a later candidate must beat an earlier one by more than this
# A partition size other than the current one must win by more than this: the simulator charges a
# message only the server's startup, not the per-message CPU work of the workers' and servers' Python
# loops, so smaller partitions look cheaper than they are (``benchmarks/run.py --rank-env
# IMERGE_PLAN_SEARCH=0 --rank-env IMERGE_PARTITION_BYTES=...`` measures one size; its JSON has each
# run's ``worker_cpu_s_per_iter``).
PARTITION_TOLERANCE = 0.02
# On the simulator's approximate fold (servers folded too) the choices must win by more than its error
# against simulating every worker (benchmarks/results/fold-check.json: at most 4.1%).
FOLD_TOLERANCE = 0.05
# The same on the fold of alike hosts (host_fold: approximate with or without stagger;
# benchmarks/results/fold-check-hosts.json: up to ~9% where a few stagger starts stand for many).
HOST_FOLD_TOLERANCE = 0.10
# Windows per server tried for the winning plan, in partitions (schedule.windows); the first is the rule's.
SERVER_WINDOWS = (1, 2, 4)


class SearchBudgetSpent(Exception):
    """A plan search ran past its CPU budget (``Config.plan_search_budget_s``): the engine installs the
    fastest plan it simulated so far (``best``; None if none finished) for now and finishes the search
    in a background process (``plan.background``)."""

    best: Plan | None = None


class StartupScaled:
    """``T(m)`` with its startup scaled by ``factor``: ``max(T(m) - (1-factor)*T(0), T(m)*factor)``."""

    def __init__(self, model: CostModel, factor: float) -> None:
        self.model = model
        self.factor = float(factor)
        self.startup = float(model.time(0.0))

    def time(self, nbytes: float) -> float:
        return float(self.time_array(np.asarray([nbytes]))[0])

    def time_array(self, nbytes: np.ndarray) -> np.ndarray:
        base = _times(self.model, nbytes)
        return np.maximum(base - (1.0 - self.factor) * self.startup, base * self.factor)


@dataclass
class Candidate:
    """One scored plan: its label, groups (ready-order positions) and simulated iteration time."""

    label: str
    groups: list[list[int]]
    iteration_s: float


def _dedupe(labelled: list[tuple[str, list[list[int]]]]) -> list[tuple[str, list[list[int]]]]:
    seen: set[tuple[tuple[int, ...], ...]] = set()
    out = []
    for label, groups in labelled:
        key = tuple(tuple(g) for g in groups)
        if key not in seen:
            seen.add(key)
            out.append((label, groups))
    return out


def candidate_plans(sizes: Sequence[float], ready: Sequence[float], cost_model: CostModel,
                    dtypes: Sequence[str] | None = None) -> list[tuple[str, list[list[int]]]]:
    """Distinct candidate plans (groups of ready-order positions), the published DP first."""
    labelled: list[tuple[str, list[list[int]]]] = []
    for factor in STARTUP_FACTORS:
        model = cost_model if factor == 1.0 else StartupScaled(cost_model, factor)
        label = "DP, measured startup" if factor == 1.0 else f"DP, startup x{factor:g}"
        labelled.append((label, plan(sizes, ready, model, "optimal", dtypes=dtypes).groups))
    for bucket in SMALL_BUCKETS:
        small = plan(sizes, ready, cost_model, "threshold", fusion_threshold_bytes=bucket, dtypes=dtypes)
        labelled.append((f"buckets of {bucket >> 10} KiB", small.groups))
    labelled.append(("unfused", [[i] for i in range(len(sizes))]))
    return _dedupe(labelled)


def pick(scored: Sequence[Candidate], tolerance: float = TIE_TOLERANCE) -> Candidate:
    """The fastest candidate; a later one must beat an earlier one by ``tolerance``."""
    best = scored[0]
    for cand in scored[1:]:
        if cand.iteration_s < best.iteration_s * (1.0 - tolerance):
            best = cand
    return best


def partition_sizes(configured: int, factors: Sequence[float] = PARTITION_FACTORS) -> list[int]:
    """Partition sizes to try: the configured one first, then smaller and larger ones."""
    out: list[int] = []
    for factor in factors:
        size = max(MIN_PARTITION_BYTES, int(configured * factor))
        if size not in out:
            out.append(size)
    return out


def _capped(bound: float | None, cap: float | None) -> float | None:
    """The tighter of a simulation's own bound and the search's cap (None: no limit)."""
    if cap is None:
        return bound
    return cap if bound is None else min(bound, cap)


def search(candidates: Sequence[tuple[str, list[list[int]]]], score: Callable[[list[list[int]], int], float],
           partition_bytes: int, partitioned: bool, tolerance: float = PARTITION_TOLERANCE,
           factors: Sequence[float] = PARTITION_FACTORS,
           cap: float | None = None) -> tuple[Candidate, list[Candidate], int, str]:
    """Score every candidate plan at ``partition_bytes``; for partitioned schedules, then
    alternate: the best plan at neighbouring partition sizes, and every plan again at the size
    that won, until neither the size nor the plan changes (at most ``SEARCH_ROUNDS`` times).
    Plan and partition size interact: the best plan at one size need not be the best at another
    (``IMERGE_PLAN_LOG=1`` prints every pair simulated). ``score(groups, size, bound=None)`` may stop
    and return ``inf`` once the score is known to exceed ``bound``: what a candidate must beat to win
    (branch and bound; the winner is the same). ``cap``: what every simulation must beat to matter (a
    second search that must beat a first one's winner): each stops once it cannot, so a plan scored
    ``inf`` lost to the cap; where every plan at a size did, the search keeps the first and the size it
    has. Returns the winner, every plan's score at the chosen
    size (``inf``: lost before the end), the size and a one-line explanation."""
    cache: dict[tuple[int, int], float] = {}

    def rank(size: int) -> list[Candidate]:
        out: list[Candidate] = []
        for i, (label, groups) in enumerate(candidates):
            if (i, size) not in cache:
                # Branch and bound: a candidate must beat the best so far by TIE_TOLERANCE to win, so its
                # simulation may stop once it cannot (inf: lost); the choice is the same as without.
                bound = pick(out).iteration_s * (1.0 - TIE_TOLERANCE) if out else None
                cache[(i, size)] = score(groups, size, bound=_capped(bound, cap))
            out.append(Candidate(label, groups, cache[(i, size)]))
        return out

    chosen_partition = partition_bytes
    scored = rank(chosen_partition)
    best = pick(scored)
    sizes_note = ""
    if partitioned:
        for _ in range(SEARCH_ROUNDS):
            at = scored.index(best)
            sizes = partition_sizes(chosen_partition, factors)
            tried = []
            for size in sizes:
                if (at, size) not in cache:
                    bound = pick(tried, tolerance).iteration_s * (1.0 - tolerance) if tried \
                        else None
                    cache[(at, size)] = score(best.groups, size, bound=_capped(bound, cap))
                tried.append(Candidate(f"{size >> 10} KiB", best.groups, cache[(at, size)]))
            sizes_note = "; partitions: " + ", ".join(f"{c.label} {c.iteration_s * 1e3:.2f} ms" for c in tried)
            size = sizes[tried.index(pick(tried, tolerance))]
            if size == chosen_partition:
                break
            chosen_partition = size
            scored = rank(size)
            best = pick(scored)
    note = (f"chosen by simulation: {best.label}, {len(best.groups)} groups"
            + (f", partitions of {chosen_partition >> 10} KiB" if partitioned else "")
            + f", {best.iteration_s * 1e3:.2f} ms/iteration; candidates: "
            + "; ".join(f"{c.label} ({len(c.groups)} groups) {c.iteration_s * 1e3:.2f} ms" for c in scored)
            + sizes_note + f"; {len(cache)} simulations")
    return best, scored, chosen_partition, note


def searched_plan(candidates: Sequence[tuple[str, list[list[int]]]],
                  score: Callable[..., float], sizes: Sequence[float],
                  ready: Sequence[float], cost_model: CostModel, partition_bytes: int,
                  partitioned: bool, staggered: bool = False, windowed: bool = False,
                  tolerance: float = PARTITION_TOLERANCE, servers: int = 1,
                  tailed: bool = False, exact: Callable[..., float] | None = None,
                  unstaggered: bool = False) -> tuple[Plan, list[Candidate]]:
    """:func:`search`, as a Plan: the winner's groups with their FIFO-model start/end times,
    ``method`` ``optimal``, the chosen ``partition_bytes`` (partitioned schedules) and the
    explanation as ``note``; plus every candidate's score.

    ``staggered`` (the schedule staggers its workers' first server): ``score`` takes a third
    argument, ``stagger``. The search runs with stagger; then its winning plan is searched again
    without stagger over the partition sizes (the size matters: without stagger smaller keys
    spread a group over the servers). Staggering spreads each group's first pushes over the
    servers, but it also delays every key's last push (each worker reaches a key at another point
    of its sequence, and a key completes only with its last push), so the results of a
    comm-bound backward can stay on the servers until its end (``docs/architecture.md``,
    "Stagger"). Without stagger must win by ``PARTITION_TOLERANCE``; the Plan records the choice
    (``stagger``).

    ``windowed`` (a partitioned schedule on several servers): ``score`` takes ``server_credit``, and the
    winner is tried with ``SERVER_WINDOWS`` partitions in flight to each server (``schedule.windows``:
    the worker's window grows with it) besides one; a wider window must win by ``PARTITION_TOLERANCE``
    (``server_credit_bytes``). With ``staggered``, ``score`` takes ``waves`` too, and the whole search runs
    again with each wave of a group rotated rather than the whole group (``schedule.key_slots``); waves
    must win by ``tolerance`` (``Plan.waves``), and stagger is then decided on the winner. ``tolerance``: what a
    partition size, stagger, waves or window other than the configured one must win by
    (``PARTITION_TOLERANCE``; more where the scores are approximate).
    ``servers``: more than ``MANY_SERVERS`` adds the jump of ``MANY_SERVERS_FACTORS``.

    ``tailed`` (the schedule holds other keys to the tail credit near the end of backward): ``score`` takes
    ``tail``, and the winner is tried without the tail credit last; without must win by ``tolerance``
    (``tail_credit``). The tail credit helps where the last groups' pushes queue behind earlier keys; where
    every key is large and the window small (8 x 8 MiB) it only throttles the link.

    ``exact`` (``score``'s signature, on every worker rather than a fold: where ``score`` is an approximate
    fold and every worker is cheap to simulate): a staggered winner is scored again with it, and stagger,
    window and tail credit are decided on it, by ``PARTITION_TOLERANCE`` instead of ``tolerance`` (the
    choice is then not hidden by the fold's error).

    ``unstaggered`` (a staggering schedule where ``score`` cannot judge stagger and nothing can check it):
    ``score`` takes ``stagger`` as with ``staggered``; the search runs without stagger and the Plan says so
    (``stagger`` False)."""
    factors = MANY_SERVERS_FACTORS if servers > MANY_SERVERS else PARTITION_FACTORS
    first = score
    if staggered or unstaggered:
        def first(g: list[list[int]], p: int, bound: float | None = None) -> float:
            return score(g, p, not unstaggered, bound=bound)
    best, scored, partition, note = search(candidates, first, partition_bytes, partitioned, tolerance, factors)
    stagger = waves = None
    if unstaggered:
        stagger = False
        note += "; without stagger (the simulation cannot judge it here)"
    elif staggered:
        # In waves the best plan and size can differ (fewer, larger groups): the whole search again, each
        # simulation stopping once it cannot beat the first search's winner by the tolerance.
        waved, waved_scored, waved_partition, _ = search(
            candidates, lambda g, p, bound=None: score(g, p, True, bound=bound, waves=True), partition_bytes,
            partitioned, tolerance, factors, cap=best.iteration_s * (1.0 - tolerance))
        if waved.iteration_s < best.iteration_s * (1.0 - tolerance):
            waves, best, scored, partition = True, waved, waved_scored, waved_partition
        note += (f"; {'in waves' if waves else 'whole groups rotated'} (in waves: "
                 + (f"{waved.label}, {len(waved.groups)} groups, {waved.iteration_s * 1e3:.2f} ms at "
                    f"{waved_partition >> 10} KiB)" if math.isfinite(waved.iteration_s)
                    else "none beat it by the tolerance)"))
        flat, _, flat_partition, _ = search([(best.label, best.groups)],
                                            lambda g, p, bound=None: score(g, p, False, bound=bound),
                                            partition, partitioned, tolerance, factors)
        if exact is not None:
            # Without stagger the fold is exact; with it, every worker decides from here on.
            folded = best.iteration_s
            best = Candidate(best.label, best.groups, exact(best.groups, partition, True,
                                                            **({"waves": True} if waves else {})))
            score, tolerance = exact, PARTITION_TOLERANCE
            note += f"; on every worker: {best.iteration_s * 1e3:.2f} ms (folded: {folded * 1e3:.2f} ms)"
        stagger = not flat.iteration_s < best.iteration_s * (1.0 - tolerance)
        if not stagger:
            best, partition, waves = flat, flat_partition, None
        note += (f"; {'with' if stagger else 'without'} stagger (without: {flat.iteration_s * 1e3:.2f} ms at "
                 f"{flat_partition >> 10} KiB)")
    # What the later choices keep of the earlier ones: stagger (a positional argument) and waves.
    kept = ((() if stagger is None else (stagger,)), ({"waves": True} if waves else {}))
    server_credit = None
    if windowed:
        tried = [best.iteration_s]
        for factor in SERVER_WINDOWS[1:]:
            bound = min(tried) * (1.0 - tolerance)
            tried.append(score(best.groups, partition, *kept[0], bound=bound, server_credit=factor * partition,
                               **kept[1]))
        wins = [i for i, t in enumerate(tried) if t < tried[0] * (1.0 - tolerance)]
        if wins:
            at = min(wins, key=lambda i: tried[i])
            server_credit = SERVER_WINDOWS[at] * partition
            best = Candidate(best.label, best.groups, tried[at])
        note += "; window per server: " + ", ".join(
            f"{f} partition{'s' if f > 1 else ''} {t * 1e3:.2f} ms" for f, t in zip(SERVER_WINDOWS, tried))
    tail_credit = None
    if tailed:
        window = {} if server_credit is None else {"server_credit": server_credit}
        untailed = score(best.groups, partition, *kept[0], bound=best.iteration_s * (1.0 - tolerance), tail=False,
                         **window, **kept[1])
        if untailed < best.iteration_s * (1.0 - tolerance):
            tail_credit = False
            best = Candidate(best.label, best.groups, untailed)
        note += (f"; {'without' if tail_credit is False else 'with'} the tail credit"
                 + (f" (without: {untailed * 1e3:.2f} ms)" if math.isfinite(untailed) else ""))
    starts, ends = simulate_fifo(best.groups, [float(s) for s in sizes], [float(t) for t in ready], cost_model)
    chosen = Plan(groups=best.groups, predicted_end=ends[-1], method="optimal", group_start=starts,
                  group_end=ends, note=note, partition_bytes=partition if partitioned else None, stagger=stagger,
                  server_credit_bytes=server_credit, tail_credit=tail_credit, waves=waves)
    return chosen, scored
