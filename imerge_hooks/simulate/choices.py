"""The ways one cluster can synchronise gradients, each predicted by the simulator: the rows of
``imerge-whatif``.

A :class:`Cluster` is what a user describes: W workers, G per host behind one NIC. An :class:`Option`
is an all-reduce (``ddp``, ``mpi-allreduce``: the ring over the workers, laid out host by host, its
hops inside a host on the host's local link; ``hierarchical``: inside the hosts, then across them;
:mod:`.allreduce`) or a PS schedule with S servers placed ``colocated`` (one
server process on each of S worker hosts, spread evenly) or ``dedicated`` (a host of its own each).
:func:`predict_all` predicts every option, each PS option under a share of a CPU budget.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace

from .allreduce import ALLREDUCE_SCHEDULES, simulate_allreduce
from .cpu_budget import CpuBudgetSpent, can_limit, cpu_limit
from .run import simulate
from .specs import ClusterSpec, ModelSpec

PLACEMENTS = ("colocated", "colocated-half", "dedicated")
MIN_CELL_CPU_S = 1.0  # a PS cell is not started with less than this left of its share


@dataclass(frozen=True)
class Cluster:
    """W workers, ``per_host`` on each host behind one NIC of ``link_Bps`` each way; the servers' work per
    push; a host's local link (shared by its workers) and a worker's summing rate (``ClusterSpec``'s
    ``local_Bps``, ``reduce_Bps``); the factor on the model's compute times."""

    workers: int
    per_host: int
    link_Bps: float
    startup_s: float
    local_Bps: float = ClusterSpec.local_Bps
    reduce_Bps: float = ClusterSpec.reduce_Bps
    time_scale: float = 1.0

    @property
    def hosts(self) -> int:
        return self.workers // self.per_host


@dataclass(frozen=True)
class Option:
    """One row: ``schedule`` with ``servers`` servers ``placement`` (``None`` for an all-reduce)."""

    schedule: str
    placement: str | None = None
    servers: int = 0

    @property
    def is_allreduce(self) -> bool:
        return self.schedule in ALLREDUCE_SCHEDULES

    def describe(self, cluster: Cluster) -> str:
        """The servers in words."""
        if self.is_allreduce:
            if self.schedule == "hierarchical" and cluster.per_host == 1:
                return "- (one worker per host: the ring over the hosts)"
            return "-"
        count = f"{self.servers} server{'s' if self.servers > 1 else ''}"
        if self.placement == "dedicated":
            return f"{count} on hosts of their own" if self.servers > 1 else f"{count} on a host of its own"
        if self.servers == cluster.hosts:
            return f"{count}, one on each worker host" if self.servers > 1 else f"{count} on the worker host"
        return f"{count} on {self.servers} of the {cluster.hosts} worker hosts"


@dataclass
class Outcome:
    """An option's prediction: ``iteration_s`` and ``throughput`` (samples/s), or why it has none."""

    option: Option
    iteration_s: float | None = None
    throughput: float | None = None
    cpu_s: float = 0.0
    fold: int = 1
    skipped: str | None = None


def server_layouts(cluster: Cluster, placements: list[str], server_hosts: int) -> list[tuple[str, int]]:
    """(placement, S) for each placement asked for, without repeats: ``colocated`` S = hosts,
    ``colocated-half`` S = ceil(hosts / 2), ``dedicated`` S = ``server_hosts``."""
    seen: list[tuple[str, int]] = []
    for placement in placements:
        if placement == "colocated":
            layout = ("colocated", cluster.hosts)
        elif placement == "colocated-half":
            layout = ("colocated", math.ceil(cluster.hosts / 2))
        elif placement == "dedicated":
            if server_hosts < 1:
                raise ValueError("dedicated servers need server hosts (server_hosts >= 1)")
            layout = ("dedicated", server_hosts)
        else:
            raise ValueError(f"unknown placement {placement!r}; choose from {', '.join(PLACEMENTS)}")
        if layout not in seen:
            seen.append(layout)
    return seen


def options(cluster: Cluster, schedules: list[str], placements: list[str], server_hosts: int) -> list[Option]:
    """DDP, the hierarchical all-reduce and any other all-reduce asked for, then every PS schedule asked
    for at every server layout."""
    rows = [Option(s) for s in dict.fromkeys(["ddp", "hierarchical", *schedules]) if s in ALLREDUCE_SCHEDULES]
    layouts = server_layouts(cluster, placements, server_hosts)
    for schedule in dict.fromkeys(s for s in schedules if s not in ALLREDUCE_SCHEDULES):
        rows += [Option(schedule, placement, servers) for placement, servers in layouts]
    return rows


def cluster_spec(cluster: Cluster, option: Option) -> ClusterSpec:
    """The simulator's cluster for ``option``: worker w on host w // G; colocated servers on worker hosts
    spread evenly, dedicated ones on hosts after them. Without hosts where every rank has a host of its
    own, so that the simulator may fold alike workers (``fold_factor``)."""
    servers = max(option.servers, 1)  # an all-reduce uses no server; ClusterSpec wants one
    base = ClusterSpec(workers=cluster.workers, servers=servers, bandwidth_Bps=cluster.link_Bps,
                       startup_s=cluster.startup_s, time_scale=cluster.time_scale, local_Bps=cluster.local_Bps,
                       reduce_Bps=cluster.reduce_Bps)
    worker_hosts = tuple(w // cluster.per_host for w in range(cluster.workers))
    if option.placement == "colocated":
        server_hosts = tuple(s * cluster.hosts // servers for s in range(servers))
    else:
        server_hosts = tuple(range(cluster.hosts, cluster.hosts + servers))
    if cluster.per_host == 1 and option.placement != "colocated":
        return base
    return replace(base, hosts=worker_hosts + server_hosts)


def predict(model: ModelSpec, cluster: Cluster, option: Option, cpu_s: float | None = None) -> Outcome:
    """Predict one option; a PS option stops after ``cpu_s`` CPU seconds (None: no cap) and is then
    ``skipped``."""
    spec = cluster_spec(cluster, option)
    start = time.process_time()
    try:
        with cpu_limit(None if option.is_allreduce else cpu_s):
            if option.is_allreduce:
                result = simulate_allreduce(model, spec, option.schedule, in_host_hops=True)
            else:
                result = simulate(model, spec, option.schedule, timeline=False)
    except CpuBudgetSpent:
        return Outcome(option, cpu_s=time.process_time() - start,
                       skipped=f"not simulated within its {cpu_s:.0f} s share of the CPU budget")
    return Outcome(option, result.iteration_s, result.throughput, time.process_time() - start,
                   getattr(result, "fold", 1))


def predict_all(model: ModelSpec, cluster: Cluster, rows: list[Option], cpu_budget_s: float) -> list[Outcome]:
    """Every option in order. The all-reduces are closed forms and always run; each PS option gets an
    equal share of what is left of ``cpu_budget_s`` (what one leaves over goes to the ones after it)."""
    spent = 0.0
    outcomes = []
    ps_left = sum(not o.is_allreduce for o in rows)
    for option in rows:
        if option.is_allreduce:
            outcomes.append(predict(model, cluster, option))
            continue
        share = (cpu_budget_s - spent) / ps_left
        ps_left -= 1
        if share < MIN_CELL_CPU_S:
            outcomes.append(Outcome(option, skipped=f"skipped: the CPU budget ({cpu_budget_s:.0f} s) is spent"))
            continue
        outcome = predict(model, cluster, option, share if can_limit() else None)
        spent += outcome.cpu_s
        outcomes.append(outcome)
    return outcomes


def recommend(outcomes: list[Outcome]) -> tuple[Outcome, Outcome | None]:
    """The option with the smallest predicted iteration (the earlier row on a tie: DDP before the others)
    and the runner-up; ValueError when nothing was predicted."""
    done = [o for o in outcomes if o.iteration_s is not None and math.isfinite(o.iteration_s)]
    if not done:
        raise ValueError("no option was predicted")
    ranked = sorted(done, key=lambda o: o.iteration_s)  # stable: ties keep the table's order
    return ranked[0], (ranked[1] if len(ranked) > 1 else None)
