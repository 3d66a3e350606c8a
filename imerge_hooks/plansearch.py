"""Pick a fusion plan by simulating candidates, not by the one-channel DP alone.

Why: the ``optimal`` DP (:mod:`imerge_hooks.planner`) is exact for ONE FIFO channel that
pays the measured startup ``a(W)`` per message. The runtime is not one channel: keys go
to S servers and many are in flight at once (credit window), so startups overlap and a
plan fused for the FIFO model can be slower than sending tensors as they are ready
(ResNet-50 at W=8: 161 tensors fused into 8 groups lost to unfused wfbp by 10-20%).

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
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from .config import Config
from .costmodel import CostModel, LinearModel, PSModel
from .planner import Plan, _times, plan, simulate_fifo

if TYPE_CHECKING:  # simulate imports this module's callers lazily; avoid an import cycle at runtime
    from .simulate import ClusterSpec, ModelSpec

log = logging.getLogger("imerge")

# Startup factors of the DP candidates: 1 is the published DP on the measured model.
STARTUP_FACTORS = (1.0, 0.5, 0.25, 0.125, 1 / 16, 1 / 64)
# Bucket sizes of the "merge only small gradients" candidates (bytes).
SMALL_BUCKETS = (64 << 10, 256 << 10, 1 << 20, 4 << 20)
# Partition sizes tried for the best plan (partitioned schedules), relative to the current size.
PARTITION_FACTORS = (1.0, 0.5, 0.25, 2.0)
MIN_PARTITION_BYTES = 256 << 10
SEARCH_ROUNDS = 4  # alternations of partition size and plan (search)
TIE_TOLERANCE = 0.005  # relative: a later candidate must beat an earlier one by more than this
# A partition size other than the current one must win by more than this: the simulator charges a
# message only the server's startup, not the per-message CPU work of the workers' and servers' Python
# loops (measured on netlab, AlexNet W=8: 512 KiB partitions cost each worker 1.18 CPU-s per
# iteration against 0.89 at 1 MiB, for a predicted gain of 0.6%, and ran 4-7% slower).
PARTITION_TOLERANCE = 0.02


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


def module_of(name: str) -> str:
    """The module that owns parameter ``name`` (``layer1.0.conv1.weight`` -> ``layer1.0.conv1``)."""
    return name.rsplit(".", 1)[0] if "." in name else ""


def model_spec_from_profile(sizes: Sequence[int], ready: Sequence[float], names: Sequence[str],
                            forward_times: Mapping[str, float] | None = None) -> ModelSpec:
    """A simulator ModelSpec with one layer per tensor, from tensors given in READY order.

    Layer ``l`` (forward order) is tensor ``n-1-l``; its backward time is the gap between
    its ready time and the previous tensor's, so the simulator reproduces the profiled
    ready times. A module's measured forward time goes to its front-most tensor.
    """
    from .simulate import LayerSpec, ModelSpec

    n = len(sizes)
    forward_times = dict(forward_times or {})
    layers = []
    seen_modules: set[str] = set()
    for layer in range(n):
        k = n - 1 - layer
        gap = float(ready[k]) - (float(ready[k - 1]) if k > 0 else 0.0)
        module = module_of(names[k])
        fwd = 0.0
        if module not in seen_modules:
            seen_modules.add(module)
            fwd = float(forward_times.get(module, 0.0))
        layers.append(LayerSpec(name=names[k], param_bytes=[int(sizes[k])],
                                forward_s=max(fwd, 0.0) if math.isfinite(fwd) else 0.0,
                                backward_s=max(gap, 0.0) if math.isfinite(gap) else 0.0))
    return ModelSpec(layers=layers, batch_size=1, name="profiled")


def cluster_for(model: CostModel, workers: int, servers: int) -> ClusterSpec | None:
    """The simulated cluster a cost model describes, or None when it describes none."""
    from .simulate import ClusterSpec

    if isinstance(model, PSModel) and model.bandwidth > 0:
        bandwidth = 2.0 * model.bandwidth * max(1.0, servers / workers)
        return ClusterSpec(workers=workers, servers=servers, bandwidth_Bps=bandwidth,
                           startup_s=model.a / workers)
    if isinstance(model, LinearModel) and model.beta > 0:
        return ClusterSpec(workers=workers, servers=servers, bandwidth_Bps=2.0 / model.beta,
                           startup_s=model.alpha / workers)
    return None


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


def partition_sizes(configured: int) -> list[int]:
    """Partition sizes to try: the configured one first, then smaller and larger ones."""
    out: list[int] = []
    for factor in PARTITION_FACTORS:
        size = max(MIN_PARTITION_BYTES, int(configured * factor))
        if size not in out:
            out.append(size)
    return out


def search(candidates: Sequence[tuple[str, list[list[int]]]], score: Callable[[list[list[int]], int], float],
           partition_bytes: int, partitioned: bool) -> tuple[Candidate, list[Candidate], int, str]:
    """Score every candidate plan at ``partition_bytes``; for partitioned schedules, then
    alternate: the best plan at neighbouring partition sizes, and every plan again at the size
    that won, until neither the size nor the plan changes (at most ``SEARCH_ROUNDS`` times).
    Plan and partition size interact (simulated, ResNet-18 at W=8: the plan-then-size pick runs
    2.18 s per iteration, the pair found together 1.79 s). Returns the winner, every plan's score at the chosen
    size, the size and a one-line explanation."""
    cache: dict[tuple[int, int], float] = {}

    def rank(size: int) -> list[Candidate]:
        out = []
        for i, (label, groups) in enumerate(candidates):
            if (i, size) not in cache:
                cache[(i, size)] = score(groups, size)
            out.append(Candidate(label, groups, cache[(i, size)]))
        return out

    chosen_partition = partition_bytes
    scored = rank(chosen_partition)
    best = pick(scored)
    sizes_note = ""
    if partitioned:
        for _ in range(SEARCH_ROUNDS):
            at = scored.index(best)
            sizes = partition_sizes(chosen_partition)
            tried = []
            for size in sizes:
                if (at, size) not in cache:
                    cache[(at, size)] = score(best.groups, size)
                tried.append(Candidate(f"{size >> 10} KiB", best.groups, cache[(at, size)]))
            sizes_note = "; partitions: " + ", ".join(f"{c.label} {c.iteration_s * 1e3:.2f} ms" for c in tried)
            size = sizes[tried.index(pick(tried, PARTITION_TOLERANCE))]
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
                  score: Callable[[list[list[int]], int], float], sizes: Sequence[float],
                  ready: Sequence[float], cost_model: CostModel, partition_bytes: int,
                  partitioned: bool) -> tuple[Plan, list[Candidate]]:
    """:func:`search`, as a Plan: the winner's groups with their FIFO-model start/end times,
    ``method`` ``optimal``, the chosen ``partition_bytes`` (partitioned schedules) and the
    explanation as ``note``; plus every candidate's score."""
    best, scored, partition, note = search(candidates, score, partition_bytes, partitioned)
    starts, ends = simulate_fifo(best.groups, [float(s) for s in sizes], [float(t) for t in ready], cost_model)
    chosen = Plan(groups=best.groups, predicted_end=ends[-1], method="optimal", group_start=starts,
                  group_end=ends, note=note, partition_bytes=partition if partitioned else None)
    return chosen, scored


def search_plan(sizes: Sequence[int], ready: Sequence[float], names: Sequence[str], cost_model: CostModel,
                cfg: Config, workers: int, servers: int, *, dtypes: Sequence[str] | None = None,
                forward_times: Mapping[str, float] | None = None) -> tuple[Plan, list[Candidate]]:
    """The fastest of the candidate plans under the simulator, and every candidate's score.

    Tensors are given in ready order (``sizes`` bytes, ``ready`` seconds, ``names``);
    ``cfg`` supplies the schedule's traits, partition and credit sizes and overlap. The
    returned Plan has the FIFO-model start/end times of the chosen groups (as every plan),
    ``method`` ``optimal``, the chosen ``partition_bytes`` (partitioned schedules) and a
    ``note`` that says which candidate won and why.
    """
    from .simulate import simulate

    cluster = cluster_for(cost_model, workers, servers)
    if cluster is None or len(sizes) < 2:
        return plan(sizes, ready, cost_model, "optimal", dtypes=dtypes), []
    spec = model_spec_from_profile(sizes, ready, names, forward_times)
    n = len(sizes)

    def score(groups: list[list[int]], partition: int) -> float:
        # The spec's tensor t (registration order) is ready-order position n-1-t.
        return simulate(spec, cluster, cfg.schedule, partition_bytes=partition, credit_bytes=cfg.credit_bytes,
                        result_window_bytes=cfg.result_window_bytes, tail_credit_bytes=cfg.tail_credit_bytes,
                        cost_model=cost_model, iterations=3, overlap_forward=cfg.overlap, timeline=False,
                        groups=[[n - 1 - i for i in g] for g in groups]).iteration_s

    chosen, scored = searched_plan(candidate_plans(sizes, ready, cost_model, dtypes), score, sizes, ready,
                                   cost_model, cfg.partition_bytes, cfg.traits.partition)
    log.info("IMerge: plan %s", chosen.note)
    return chosen, scored


def choose_plan(sizes: Sequence[int], ready: Sequence[float], names: Sequence[str], cost_model: CostModel,
                cfg: Config, workers: int, servers: int, *, dtypes: Sequence[str] | None = None,
                forward_times: Mapping[str, float] | None = None) -> Plan:
    """The plan the engine installs: simulation-scored for the ``optimal`` planner when
    ``cfg.plan_search`` is on, otherwise the schedule's planner method as is."""
    method = cfg.traits.planner
    if method == "optimal" and cfg.plan_search and servers > 0:
        return search_plan(sizes, ready, names, cost_model, cfg, workers, servers,
                           dtypes=dtypes, forward_times=forward_times)[0]
    return plan(sizes, ready, cost_model, method, fusion_threshold_bytes=cfg.fusion_threshold_bytes,
                dtypes=dtypes)
