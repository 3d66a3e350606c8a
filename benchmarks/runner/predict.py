"""Predictions: the calibrated PS models (cache, else a stored run's own), the simulator's run of
one configuration (IMerge's schedules and the all-reduce peers), the plan a measured run is
validated with, and the simulated grid (every model, W in ``--sim-workers`` and schedule)."""

from __future__ import annotations

import glob
import statistics
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from benchmarks.netlab import netlab as nl
from benchmarks.runner.grid import FALLBACK_STARTUP_S, PEERS, PROFILES, log

if TYPE_CHECKING:
    import argparse
    from collections.abc import Callable

    from benchmarks.runner.document import Bench
    from imerge_hooks.internals import PSModel
    from imerge_hooks.simulate import ClusterSpec, ModelSpec, SimResult


def cached_psmodel(cache_dir: Path, workers: int, servers: int) -> PSModel | None:
    """The newest PS model calibrated for (W, S) in the cache, None if there is none or it is unreadable."""
    from imerge_hooks.internals import PSModel

    paths = sorted(glob.glob(str(cache_dir / f"psmodel-{workers}w-{servers}s-*.json")))
    if not paths:
        return None
    try:
        return PSModel.from_json(paths[-1])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def stored_psmodels(calibration: dict, servers_of: Callable[[int], int]) -> dict[int, PSModel]:
    """The PS models a run's JSON recorded (its ``calibration``: table and fit per W), by W.

    ``--resume --no-measure`` falls back on them where ``<out-dir>/cache`` has no model for that W
    (the cache is not tracked), so the tables and the validation of a stored run can be printed
    again from its JSON alone."""
    from imerge_hooks.internals import PSModel

    out = {}
    for w, c in calibration.items():
        try:
            out[int(w)] = PSModel(workers=int(w), servers=servers_of(int(w)), sizes=list(c["table"]["bytes"]),
                                  times=list(c["table"]["time_s"]), a=c["a_s"],
                                  bandwidth=c["bandwidth_Bps_per_server"])
        except (KeyError, TypeError, ValueError):
            continue
    return out


def startup_for(workers: int, psmodels: dict, fallback: float) -> tuple[float, str]:
    """Per-push server startup: calibrated a / W at this W, else the median over calibrated W."""
    if workers in psmodels:
        return psmodels[workers].a / workers, f"calibrated W={workers}"
    if psmodels:
        return statistics.median(m.a / w for w, m in psmodels.items()), \
            f"median of calibrated W={sorted(psmodels)}"
    return fallback, "fallback (no calibration)"


def simulate_one(model: str, workers: int, servers: int, schedule: str, bandwidth_Bps: float, startup_s: float,
                 time_scale: float, cost_model=None, timeline: bool = False, fabric_Bps: float | None = None,
                 share: tuple[float, float] | None = None, plan: dict | None = None, seed: int = 0,
                 goodput: float = nl.GOODPUT) -> SimResult:
    """One simulated run; ``plan`` ({"groups", "partition_bytes"}, see :func:`engine_plan`) fixes the
    plan instead of letting the simulator search one on this cluster. The links carry ``goodput``
    of ``bandwidth_Bps`` as TCP payload (the runner passes its lab MTU's, ``args.goodput``)."""
    from imerge_hooks.simulate import ClusterSpec, ModelSpec, simulate

    spec = ModelSpec.from_profile_json(PROFILES / f"{model}-cpu.json")
    cv, period = share if share is not None else (0.0, 1.0)
    cluster = ClusterSpec(workers=workers, servers=servers, bandwidth_Bps=bandwidth_Bps * goodput,
                          startup_s=startup_s, time_scale=time_scale, fabric_Bps=fabric_Bps,
                          share_cv=cv, share_period_s=period, share_seed=seed)
    if schedule in PEERS:
        return simulate_peer(spec, cluster, schedule, plan)
    fixed = {}
    if plan is not None:
        fixed["groups"] = plan["groups"]
        if plan.get("partition_bytes"):
            fixed["partition_bytes"] = plan["partition_bytes"]
        if plan.get("stagger") is not None:
            fixed["stagger"] = plan["stagger"]
        if plan.get("waves"):
            fixed["waves"] = True
        if plan.get("tail_credit") is False:
            fixed["tail_credit_bytes"] = None
    return simulate(spec, cluster, schedule, cost_model=cost_model, timeline=timeline, **fixed)


def simulate_peer(spec: ModelSpec, cluster: ClusterSpec, schedule: str, plan: dict | None = None) -> SimResult:
    """A peer on the simulator's ring all-reduce model (``imerge_hooks.simulate.allreduce``).
    ``ddp-tuned``: the cap that a launch chose (``plan["bucket_cap_mb"]``), else the fastest
    simulated cap of ``peers.ddp_caps``, as worker_replay tunes it on the emulated cluster."""
    from benchmarks.peers import ddp_caps
    from imerge_hooks.simulate import simulate_allreduce

    if schedule == "mpi-allreduce":
        return simulate_allreduce(spec, cluster, "mpi-allreduce")
    caps = [25.0] if schedule == "ddp" else ddp_caps(spec.total_bytes)
    if plan and plan.get("bucket_cap_mb"):
        caps = [plan["bucket_cap_mb"]]
    runs = [simulate_allreduce(spec, cluster, "ddp", bucket_bytes=int(cap * 1024 * 1024)) for cap in caps]
    return min(runs, key=lambda r: r.iteration_s)


def engine_plan(model: str, workers: int, servers: int, schedule: str, time_scale: float,
                cost_model) -> dict | None:
    """The plan the engine's replan would install for a searched schedule (adaptive-ps, imerge):
    the plan search on the cluster the calibrated cost model describes (``plan.choice.cluster_for``,
    as ``choose_plan`` does), not on the cluster being predicted. None for the other schedules
    (their plans do not depend on the cluster) or without a calibrated model."""
    from imerge_hooks.internals import SCHEDULE_TRAITS, cluster_for
    from imerge_hooks.simulate import ModelSpec, simulate

    cluster = cluster_for(cost_model, workers, servers) if cost_model is not None else None
    if SCHEDULE_TRAITS[schedule].planner != "optimal" or cluster is None:
        return None
    spec = ModelSpec.from_profile_json(PROFILES / f"{model}-cpu.json")
    res = simulate(spec, replace(cluster, time_scale=time_scale), schedule, cost_model=cost_model, timeline=False)
    return {"groups": res.groups, "partition_bytes": res.plan.partition_bytes if res.plan else None,
            "stagger": res.plan.stagger if res.plan else None, "waves": res.plan.waves if res.plan else None,
            "tail_credit": res.plan.tail_credit if res.plan else None}


def validation_plan(run: dict, servers: int, time_scale: float, cost_model) -> tuple[dict | None, str]:
    """The plan a measured run is validated with, and where it comes from: the plan the launch
    installed (``worker_replay`` reports it), else, for runs measured before it did, the one
    :func:`engine_plan` re-derives (which can differ: the search saw another profile, or the launch
    set ``IMERGE_PLAN_SEARCH`` / ``IMERGE_PARTITION_BYTES``), else the schedule's own."""
    if run["schedule"] in PEERS:
        cap = run.get("bucket_cap_mb")
        return ({"bucket_cap_mb": cap}, "the launch's bucket cap") if cap else (None, "the peer's rule")
    installed = run.get("plan")
    if installed and installed.get("groups"):
        return installed, "installed"
    plan = engine_plan(run["model"], run["workers"], servers, run["schedule"], time_scale, cost_model)
    return plan, "the engine's search" if plan else "the schedule's"


def startup_of(args: argparse.Namespace, workers: int, psmodels: dict) -> tuple[float, str]:
    """The simulator's per-push server startup at W and where it comes from: ``--sim-startup-us``
    if given, else :func:`startup_for` the calibrated models."""
    if args.sim_startup_us is not None:
        return args.sim_startup_us * 1e-6, "--sim-startup-us"
    return startup_for(workers, psmodels, FALLBACK_STARTUP_S)


def calibrated_models(bench: Bench) -> dict[int, PSModel]:
    """The PS models by W (measured and simulated W): the cache's, else the ones a resumed JSON
    recorded. Recorded in the document and printed."""
    args, sw = bench.args, bench.servers
    psmodels = {w: m for w in sorted(set(args.workers) | set(args.sim_workers))
                if (m := cached_psmodel(bench.cache_dir, w, sw(w))) is not None}
    for w, m in stored_psmodels(bench.calibration_kept, sw).items():  # a fresh clone re-reporting a stored run
        if w not in psmodels and w in set(args.workers) | set(args.sim_workers):
            psmodels[w] = m
    bench.doc["calibration"] = {str(w): {"a_s": m.a, "bandwidth_Bps_per_server": m.bandwidth,
                                         "startup_per_push_s": m.a / w,
                                         "table": {"bytes": m.sizes, "time_s": m.times}} for w, m in psmodels.items()}
    if psmodels:
        print("\nCalibrated PS models (cache " + str(bench.cache_dir) + "):")
        for w, m in psmodels.items():
            print(f"  {m.describe()}  -> startup per push a/W = {m.a / w * 1e6:.0f} us")
    return psmodels


def simulate_grid(bench: Bench, psmodels: dict) -> tuple[list[dict], dict]:
    """Every model, W in ``--sim-workers`` and schedule on the simulator: the runs, and the
    one-worker throughput by model (batch / compute). Recorded in the document."""
    args = bench.args
    sim_runs = []
    log(f"simulating W {args.sim_workers} ...")
    for W in args.sim_workers:
        for m in args.models:
            st, src = startup_of(args, W, psmodels)
            for s in args.all_schedules:
                r = simulate_one(m, W, bench.servers(W), s, args.bandwidth_Bps, st, args.time_scale,
                                 cost_model=psmodels.get(W), goodput=args.goodput)
                sim_runs.append({"model": m, "workers": W, "servers": bench.servers(W), "schedule": s,
                                 "iteration_s": r.iteration_s,
                                 "samples_per_s": r.throughput, "startup_s": st, "startup_source": src,
                                 "groups": len(r.groups), "keys": len(r.keys),
                                 "cost_model": "calibrated" if W in psmodels else "simulated calibration"})
    sim_base = {m: bench.facts[m]["batch_size"] / bench.facts[m]["compute_s"] for m in args.models}
    bench.doc["simulated"] = {"runs": sim_runs, "baseline": sim_base}
    return sim_runs, sim_base
