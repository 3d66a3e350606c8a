"""The simulator's fold against simulating every worker (``imerge_hooks.simulate.fold_factor``).

    python benchmarks/fold_check.py [--workers 32,64] [--out benchmarks/results/fold-check.json]

For every benchmark profile, W and S in (W, W/2), on the cluster ``benchmarks/plan_time.py`` uses
(1 Gbit/s links, 200 us startup, the simulator's calibration as cost model): the iteration time of
``wfbp`` (no stagger: the fold is exact) and ``imerge`` (the DP plan, with stagger: exact where the
simulated workers are a multiple of S, else servers are folded too, approximately: ``orbits``) simulated
folded and with every worker, the same plan in both, and the seconds each took.
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
    args = parser.parse_args()
    rows = []
    print(f"{'profile':<10} {'W':>4} {'S':>4} {'schedule':<8} {'fold':>4} {'orbits':>6} {'every worker':>13} "
          f"{'folded':>9} {'error':>8} "
          f"{'s (every)':>10} {'s (fold)':>9}")
    for profile in PROFILES:
        spec = ModelSpec.from_profile_json(REPO / "benchmarks" / "profiles" / f"{profile}-cpu.json")
        for workers in map(int, args.workers.split(",")):
            for servers in (workers, workers // 2):
                cluster = ClusterSpec(workers=workers, servers=servers, bandwidth_Bps=1.25e9, startup_s=2e-4)
                model = calibrate_model(cluster)
                for schedule in ("wfbp", "imerge"):
                    t = time.perf_counter()
                    full = simulate(spec, cluster, schedule, cost_model=model, timeline=False, plan_search=False,
                                    fold_workers=False)
                    full_s = time.perf_counter() - t
                    partition = full.plan.partition_bytes if full.plan and full.plan.partition_bytes else 4 << 20
                    t = time.perf_counter()
                    folded = simulate(spec, cluster, schedule, cost_model=model, timeline=False, plan_search=False,
                                      groups=full.groups, partition_bytes=partition)
                    fold_s = time.perf_counter() - t
                    error = folded.iteration_s / full.iteration_s - 1
                    rows.append({"profile": profile, "workers": workers, "servers": servers, "schedule": schedule,
                                 "fold": folded.fold, "server_orbits": folded.server_orbits,
                                 "every_worker_s": full.iteration_s,
                                 "folded_s": folded.iteration_s, "error": error, "cpu_every_s": full_s,
                                 "cpu_folded_s": fold_s})
                    print(f"{profile:<10} {workers:>4} {servers:>4} {schedule:<8} {folded.fold:>4} "
                          f"{folded.server_orbits or '-':>6} {full.iteration_s:>13.4f} "
                          f"{folded.iteration_s:>9.4f} {100 * error:>+7.2f}% {full_s:>10.2f} {fold_s:>9.2f}",
                          flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"command": "python benchmarks/fold_check.py " + " ".join(sys.argv[1:]),
                                              "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
