"""The plan the engine installs: the profiled model as a simulator spec, each candidate plan of
:mod:`imerge_hooks.plan.search` scored by :func:`imerge_hooks.simulate.search_by_simulation` with the
schedule's own traits, the fastest kept.

The search rules (candidates, ties, partition sizes) are :mod:`imerge_hooks.plan.search`'s,
which the simulator also uses when it plans; this module is where the engine's profile and
cost model meet the simulator.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Mapping, Sequence

from ..core.config import Config
from ..simulate import ClusterSpec, LayerSpec, ModelSpec, search_by_simulation
from .costmodel import CostModel, LinearModel, PSModel
from .planner import Plan, plan, simulate_fifo
from .search import Candidate, SearchBudgetSpent

log = logging.getLogger("imerge")


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


def cluster_for(model: CostModel, workers: int, servers: int, hosts: Sequence[int] | None = None,
                host_aggregation: bool = True) -> ClusterSpec | None:
    """The simulated cluster a cost model describes, or None when it describes none. ``hosts``: the host
    index of every rank (workers, then servers), so plans are scored on the job's real layout."""
    if isinstance(model, PSModel) and model.bandwidth > 0:
        return ClusterSpec.from_psmodel(model, workers=workers, servers=servers, hosts=hosts,
                                        host_aggregation=host_aggregation)
    if isinstance(model, LinearModel) and model.beta > 0:
        return ClusterSpec(workers=workers, servers=servers, bandwidth_Bps=2.0 / model.beta,
                           startup_s=model.alpha / workers, hosts=None if hosts is None else tuple(hosts),
                           host_aggregation=host_aggregation)
    return None


def search_plan(sizes: Sequence[int], ready: Sequence[float], names: Sequence[str], cost_model: CostModel,
                cfg: Config, workers: int, servers: int, *, dtypes: Sequence[str] | None = None,
                forward_times: Mapping[str, float] | None = None, hosts: Sequence[int] | None = None,
                host_aggregation: bool = True, cpu_budget_s: float | None = None) -> tuple[Plan, list[Candidate]]:
    """The fastest of the candidate plans under the simulator, and every candidate's score.

    Tensors are given in ready order (``sizes`` bytes, ``ready`` seconds, ``names``);
    ``cfg`` supplies the schedule's traits, partition and credit sizes and overlap. The
    returned Plan has the FIFO-model start/end times of the chosen groups (as every plan),
    ``method`` ``optimal``, the chosen ``partition_bytes`` (partitioned schedules) and a
    ``note`` that says which candidate won and why. ``cpu_budget_s``: raise
    :class:`SearchBudgetSpent` once the search has used this much of the calling thread's CPU.
    """
    deadline = None if cpu_budget_s is None else time.thread_time() + cpu_budget_s
    cluster = cluster_for(cost_model, workers, servers, hosts, host_aggregation)
    if cluster is None or len(sizes) < 2:
        return plan(sizes, ready, cost_model, "optimal", dtypes=dtypes), []
    spec = model_spec_from_profile(sizes, ready, names, forward_times)
    n = len(sizes)
    best: list = []  # (score, groups, partition, stagger) of the fastest plan simulated so far

    def keep_fastest(seconds: float, groups: list[list[int]], partition: int, stagger: bool | None) -> None:
        if not best or seconds < best[0]:
            best[:] = [seconds, groups, partition, stagger]

    try:  # the spec's tensor t (registration order) is ready-order position n-1-t
        chosen, scored = search_by_simulation(
            spec, cluster, cfg.schedule, [n - 1 - j for j in range(n)], sizes, ready, cost_model,
            partition_bytes=cfg.partition_bytes, credit_bytes=cfg.credit_bytes,
            tail_credit_bytes=cfg.tail_credit_bytes, overlap_forward=cfg.overlap, iterations=3, dtypes=dtypes,
            cpu_deadline=deadline, on_scored=keep_fastest)
    except SearchBudgetSpent:
        raise _spent(cpu_budget_s, best, sizes, ready, cost_model, cfg) from None
    log.info("IMerge: plan %s", chosen.note)
    return chosen, scored


def _spent(budget: float | None, best: list, sizes: Sequence[int], ready: Sequence[float], cost_model: CostModel,
           cfg: Config) -> SearchBudgetSpent:
    """The budget ran out: the exception carries the fastest plan simulated so far (``best``), if any."""
    spent = SearchBudgetSpent(f"IMerge: the plan search used its {budget:g} s of CPU")
    if best:
        seconds, groups, partition, stagger = best
        starts, ends = simulate_fifo(groups, [float(x) for x in sizes], [float(t) for t in ready], cost_model)
        spent.best = Plan(groups=groups, predicted_end=ends[-1], method="optimal", group_start=starts,
                          group_end=ends, partition_bytes=partition if cfg.traits.partition else None, stagger=stagger,
                          note=f"the fastest plan simulated within the budget ({seconds * 1e3:.2f} ms/iteration), "
                               "while the search runs in the background")
    return spent


def choose_plan(sizes: Sequence[int], ready: Sequence[float], names: Sequence[str], cost_model: CostModel,
                cfg: Config, workers: int, servers: int, *, dtypes: Sequence[str] | None = None,
                forward_times: Mapping[str, float] | None = None, hosts: Sequence[int] | None = None,
                host_aggregation: bool = True, cpu_budget_s: float | None = None) -> Plan:
    """The plan the engine installs: simulation-scored for the ``optimal`` planner when
    ``cfg.plan_search`` is on, otherwise the schedule's planner method as is. ``cpu_budget_s``: as
    :func:`search_plan` (raises :class:`SearchBudgetSpent`)."""
    method = cfg.traits.planner
    if method == "optimal" and cfg.plan_search and servers > 0:
        return search_plan(sizes, ready, names, cost_model, cfg, workers, servers, dtypes=dtypes,
                           forward_times=forward_times, hosts=hosts, host_aggregation=host_aggregation,
                           cpu_budget_s=cpu_budget_s)[0]
    return plan(sizes, ready, cost_model, method, fusion_threshold_bytes=cfg.fusion_threshold_bytes,
                dtypes=dtypes)
