"""Session 9: ResNet-18 imerge at W=16 in the simulator, by partition size (the W=16 cell of
``bench-session9-w16.json``: its calibrated PS model, duplex cap, startup and sharing CV).

Rows: the plan the engine's search picks at 256 KiB .. 4 MiB partitions, and the DP plan alone
(``plan_search=False``, as ``IMERGE_PLAN_SEARCH=0``) at 1 and 4 MiB; s/iter with fair sharing and
the mean of 3 draws of the measured uneven sharing::

    python benchmarks/results/experiments-session9/w16_partition.py
"""

from __future__ import annotations

import sys
from pathlib import Path

# The W=16 cell is loaded as in session 10's experiments (one loader for both).
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "experiments-session10"))
from w16_cell import load  # noqa: E402

from benchmarks import run  # noqa: E402
from imerge_hooks import simulate  # noqa: E402

MiB = 1 << 20


def main() -> None:
    psm, cell, spec, base = load()
    base["startup_s"] = cell["startup_s"]
    plan = run.engine_plan("resnet18", 16, 2, "imerge", 1.0, psm)
    print(f"resnet18 W=16 imerge: measured {cell['measured_s']:.2f} s/iter; the engine's search picks "
          f"{len(plan['groups'])} groups at {plan['partition_bytes']} B")

    def one(label: str, **kw) -> None:
        fair = simulate.simulate(spec, simulate.ClusterSpec(**base), "imerge", cost_model=psm, timeline=False, **kw)
        uneven = [simulate.simulate(spec, simulate.ClusterSpec(share_cv=cell["share_cv"], share_seed=seed, **base),
                                    "imerge", cost_model=psm, timeline=False, **kw).iteration_s for seed in range(3)]
        print(f"  {label:32s} {len(fair.keys):4d} keys  fair {fair.iteration_s:.3f}  "
              f"uneven {sum(uneven) / len(uneven):.3f}")

    for size in sorted({plan["partition_bytes"], MiB // 4, MiB, 2 * MiB, 4 * MiB}):
        one(f"search's plan, {size // 1024} KiB", groups=plan["groups"], partition_bytes=size)
    for size in (MiB, 4 * MiB):
        one(f"DP plan, {size // 1024} KiB", partition_bytes=size, plan_search=False)


if __name__ == "__main__":
    main()
