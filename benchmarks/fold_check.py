"""The simulator's fold against simulating every worker (``imerge_hooks.simulate.fold_factor``).

    python benchmarks/fold_check.py [--workers 32,64] [--partitions 0,256] [--out benchmarks/results/fold-check.json]
    python benchmarks/fold_check.py --hosts --workers 128,256 [--out benchmarks/results/fold-check-hosts.json]

For every benchmark profile, W and S in (W, W/2), on the cluster ``benchmarks/plan_time.py`` uses
(1 Gbit/s links, 200 us startup, the simulator's calibration as cost model): the iteration time of
``wfbp`` (no stagger: the fold is exact) and ``imerge`` (the DP plan, with stagger: exact where the
simulated workers are a multiple of S, else servers are folded too, approximately: ``orbits``; and
``imerge+waves``, staggered in waves, ``schedule.key_slots``) simulated folded and with every worker, the
same plan in both, and the seconds each took. ``--partitions`` (KiB; 0: the configured size): the
partition sizes of the ``imerge`` rows; 256 KiB is the floor, where the plan search on the fold goes
most often and where the fold with stagger is furthest off.

``--gpu``: the same on ``benchmarks/gpu_tables.py``'s cluster (GPU-speed compute, 10 Gbit/s links), where
communication binds and the fold with stagger is furthest off at small partitions.

``--hosts``: the fold of alike hosts (``imerge_hooks.simulate.run.host_fold``) on ``host_tables.py``'s
layout (hosts of 8 workers, one server on each, host aggregation, 1 Gbit/s NICs at TCP goodput), where
it is approximate with or without stagger; ``imerge`` at the configured partition size and at 1 and
16 MiB, the sizes the plan search weighs, and in waves at the configured size.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from imerge_hooks.simulate import ClusterSpec, ModelSpec, calibrate_model, simulate  # noqa: E402

PROFILES = ("alexnet", "resnet18", "resnet50", "vgg16", "synthetic")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workers", default="32,64")
    parser.add_argument("--out", default=None)
    parser.add_argument("--hosts", action="store_true", help="hosts of 8 with a server each (the fold of alike hosts)")
    parser.add_argument("--partitions", default="0,256", help="KiB, for the imerge rows (0: the configured size)")
    parser.add_argument("--gpu", action="store_true",
                        help="GPU-speed compute on 10 Gbit/s links (benchmarks/gpu_tables.py's cluster), where "
                             "communication binds")
    args = parser.parse_args()
    if args.hosts:
        return hosts_check(args)
    rows = []
    print(f"{'profile':<10} {'W':>4} {'S':>4} {'schedule':<12} {'KiB':>5} {'fold':>4} {'orbits':>6} "
          f"{'every worker':>13} {'folded':>9} {'error':>8} {'s (every)':>10} {'s (fold)':>9}")
    sizes = [int(k) << 10 or None for k in args.partitions.split(",")]
    cases = [("wfbp", None)] + [(s, p) for p in sizes for s in ("imerge", "imerge+waves")]
    for profile in PROFILES:
        spec = ModelSpec.from_profile_json(REPO / "benchmarks" / "profiles" / f"{profile}-cpu.json")
        for workers in map(int, args.workers.split(",")):
            for servers in (workers, workers // 2):
                cluster = gpu_cluster(profile, spec, workers, servers) if args.gpu else \
                    ClusterSpec(workers=workers, servers=servers, bandwidth_Bps=1.25e9, startup_s=2e-4)
                model = calibrate_model(cluster)
                for schedule, size in cases:
                    full, folded, size, full_s, fold_s = compare(spec, cluster, schedule, model, size,
                                                                 time.perf_counter)
                    error = folded.iteration_s / full.iteration_s - 1
                    size = size if schedule != "wfbp" else None
                    rows.append({"profile": profile, "workers": workers, "servers": servers, "schedule": schedule,
                                 "partition_bytes": size, "fold": folded.fold, "server_orbits": folded.server_orbits,
                                 "every_worker_s": full.iteration_s,
                                 "folded_s": folded.iteration_s, "error": error, "cpu_every_s": full_s,
                                 "cpu_folded_s": fold_s})
                    print(f"{profile:<10} {workers:>4} {servers:>4} {schedule:<12} {size >> 10 if size else '-':>5} "
                          f"{folded.fold:>4} {folded.server_orbits or '-':>6} {full.iteration_s:>13.4f} "
                          f"{folded.iteration_s:>9.4f} {100 * error:>+7.2f}% {full_s:>10.2f} {fold_s:>9.2f}",
                          flush=True)
    write(args.out, rows)


def gpu_cluster(profile: str, spec: ModelSpec, workers: int, servers: int) -> ClusterSpec:
    """``benchmarks/gpu_tables.py``'s S = W cluster at 10 Gbit/s: the profile at GPU speed, a host per rank."""
    from benchmarks.gpu_speed import time_scale
    from benchmarks.gpu_tables import FALLBACK_STARTUP_S, link_Bps

    return ClusterSpec(workers=workers, servers=servers, bandwidth_Bps=link_Bps(10), startup_s=FALLBACK_STARTUP_S,
                       time_scale=time_scale(profile, spec))


def compare(spec: ModelSpec, cluster: ClusterSpec, schedule: str, model, partition: int | None, clock) -> tuple:
    """``schedule`` (``imerge+waves``: ``imerge`` staggered in waves) simulated with every worker (at ``partition``,
    None: the configured size), then folded on the same plan and partition size: (every worker's result, the
    folded one, the partition size, each one's seconds on ``clock``)."""
    extra: dict = {} if partition is None else {"partition_bytes": partition}
    if schedule == "imerge+waves":
        schedule, extra["stagger"], extra["waves"] = "imerge", True, True
    t = clock()
    full = simulate(spec, cluster, schedule, cost_model=model, timeline=False, plan_search=False, fold_workers=False,
                    **extra)
    full_s = clock() - t
    if partition is None:
        partition = full.plan.partition_bytes if full.plan and full.plan.partition_bytes else 4 << 20
    t = clock()
    folded = simulate(spec, cluster, schedule, cost_model=model, timeline=False, plan_search=False,
                      groups=full.groups, **{**extra, "partition_bytes": partition})
    return full, folded, partition, full_s, clock() - t


def write(out: str | None, rows: list[dict]) -> None:
    if out:
        Path(out).write_text(json.dumps({"command": "python benchmarks/fold_check.py " + " ".join(sys.argv[1:]),
                                         "rows": rows}, indent=1) + "\n")


def hosts_check(args: argparse.Namespace) -> None:
    from benchmarks.netlab.netlab import GOODPUT

    per_host = 8
    rows = []
    print(f"{'profile':<10} {'W':>4} {'S':>3} {'schedule':<12} {'part':>4} {'fold':>4} {'every worker':>13} "
          f"{'folded':>9} {'error':>8} {'s (every)':>10} {'s (fold)':>9}")
    for workers in map(int, args.workers.split(",")):
        hosts = workers // per_host
        cluster = ClusterSpec(workers=workers, servers=hosts, bandwidth_Bps=1.25e8 * GOODPUT, startup_s=2e-4,
                              hosts=tuple(w // per_host for w in range(workers)) + tuple(range(hosts)))
        model = calibrate_model(cluster)
        for profile in PROFILES:
            spec = ModelSpec.from_profile_json(REPO / "benchmarks" / "profiles" / f"{profile}-cpu.json")
            for schedule, partition in (("wfbp", None), ("imerge", None), ("imerge", 1 << 20), ("imerge", 16 << 20),
                                        ("imerge+waves", None)):
                full, folded, partition, full_s, fold_s = compare(spec, cluster, schedule, model, partition,
                                                                  time.process_time)
                error = folded.iteration_s / full.iteration_s - 1
                part = partition >> 20 if schedule != "wfbp" else "-"
                rows.append({"profile": profile, "workers": workers, "servers": hosts, "schedule": schedule,
                             "partition_bytes": partition if schedule != "wfbp" else None, "fold": folded.fold,
                             "server_orbits": folded.server_orbits, "every_worker_s": full.iteration_s,
                             "folded_s": folded.iteration_s, "error": error, "cpu_every_s": full_s,
                             "cpu_folded_s": fold_s})
                print(f"{profile:<10} {workers:>4} {hosts:>3} {schedule:<12} {part:>4} {folded.fold:>4} "
                      f"{full.iteration_s:>13.4f} {folded.iteration_s:>9.4f} {100 * error:>+7.2f}% "
                      f"{full_s:>10.2f} {fold_s:>9.2f}", flush=True)
    write(args.out, rows)


if __name__ == "__main__":
    main()
