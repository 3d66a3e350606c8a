"""Session 10: can a per-message cost on the workers' comm threads explain the W=16 ResNet-18 A/B?

Measured (session 9, ``ab-w16-*-session9``): the DP plan at 1 MiB partitions (46 keys) ran
4.861 / 5.198 s/iter, the searched plan (189-190 keys of 256 KiB) 5.197 / 5.972. The simulator
without a worker cost predicts the opposite order. Rows: both plans at ``worker_message_s`` =
0 .. 8 ms (first argument, seconds, comma-separated), and the server's startup scaled by the
second argument's factors (default 1); s/iter with fair sharing and the mean of 3 draws of the
measured uneven sharing::

    python benchmarks/results/experiments-session10/w16_message_cost.py [COSTS] [STARTUP_FACTORS]
"""

from __future__ import annotations

import sys

from w16_cell import load

from benchmarks import run
from imerge_hooks import simulate

MiB = 1 << 20


def main() -> None:
    psm, cell, spec, base = load()
    base["startup_s"] = cell["startup_s"]
    plan = run.engine_plan("resnet18", 16, 2, "imerge", 1.0, psm)
    costs = [float(c) for c in sys.argv[1].split(",")] if len(sys.argv) > 1 else [0, 0.5e-3, 1e-3, 2e-3, 4e-3, 8e-3]
    factors = [float(f) for f in sys.argv[2].split(",")] if len(sys.argv) > 2 else [1.0]
    startup = base["startup_s"]
    for factor, cost in ((f, c) for f in factors for c in costs):
        base["startup_s"] = startup * factor
        for label, kw in ((f"search's plan ({len(plan['groups'])} groups), 256 KiB",
                           dict(groups=plan["groups"], partition_bytes=MiB // 4)),
                          ("DP plan, 1024 KiB", dict(partition_bytes=MiB, plan_search=False))):
            fair = simulate.simulate(spec, simulate.ClusterSpec(worker_message_s=cost, **base), "imerge",
                                     cost_model=psm, timeline=False, **kw)
            uneven = [simulate.simulate(spec, simulate.ClusterSpec(share_cv=cell["share_cv"], share_seed=seed,
                                                                   worker_message_s=cost, **base),
                                        "imerge", cost_model=psm, timeline=False, **kw).iteration_s
                      for seed in range(3)]
            print(f"startup x{factor:g}  cost {cost * 1e3:4.1f} ms  {label:36s} {len(fair.keys):4d} keys  "
                  f"fair {fair.iteration_s:.3f}  uneven {sum(uneven) / len(uneven):.3f}", flush=True)


if __name__ == "__main__":
    main()
