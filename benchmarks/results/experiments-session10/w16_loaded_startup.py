"""Session 10: does a server startup higher than the calibrated one explain the W=16 ResNet-18 A/B?

The calibration (W=16: 1.11 ms per push) runs while the workers do nothing else; in training 16
workers' CPU (0.41-0.55 CPU-s per iteration each, ~1.5 of the host's 2 cores) competes with the
servers'. Each launch's installed plan (``"plan"`` in its JSON) simulated with the calibrated
startup times 1 / 2 / 2.5 / 3, fair sharing and the mean of 3 draws of the measured uneven sharing,
next to what the launch measured::

    python benchmarks/results/experiments-session10/w16_loaded_startup.py
"""

from __future__ import annotations

import json

from w16_cell import ROOT, load

from imerge_hooks import simulate

LAUNCHES = ("ab-w16-search2-session9", "ab-w16-handoff-session10", "ab-w16-dp1m-session9", "ab-w16-dp1m2-session9")


def main() -> None:
    psm, cell, spec, base = load()
    for name in LAUNCHES:
        doc = json.loads((ROOT / f"benchmarks/results/{name}.json").read_text())
        row = next(r for r in doc["measured"]["runs"] if r["model"] == "resnet18" and r["schedule"] == "imerge")
        plan = row.get("plan")
        if plan is None:  # the first DP launch predates installed plans: the DP plan at 1 MiB, as its twin
            twin = json.loads((ROOT / "benchmarks/results/ab-w16-dp1m2-session9.json").read_text())
            plan = next(r for r in twin["measured"]["runs"] if r["schedule"] == "imerge")["plan"]
        cells = []
        for factor in (1.0, 2.0, 2.5, 3.0):
            kw = dict(groups=plan["groups"], partition_bytes=plan["partition_bytes"] or 4 << 20)
            cluster = dict(base, startup_s=cell["startup_s"] * factor)
            fair = simulate.simulate(spec, simulate.ClusterSpec(**cluster), "imerge", cost_model=psm,
                                     timeline=False, **kw)
            uneven = [simulate.simulate(spec, simulate.ClusterSpec(share_cv=cell["share_cv"], share_seed=seed,
                                                                   **cluster), "imerge", cost_model=psm,
                                        timeline=False, **kw).iteration_s for seed in range(3)]
            cells.append(f"x{factor:g} {fair.iteration_s:.2f}/{sum(uneven) / len(uneven):.2f}")
        print(f"{name:26s} {row['keys']:4d} keys  measured {row['iteration_s']:.3f}  simulated fair/uneven: "
              + "  ".join(cells), flush=True)


if __name__ == "__main__":
    main()
