"""Session-9 what-ifs in the simulator: imerge at W=8, S=2 under other send policies.

Each case simulates the plan the engine's search picks (``run.engine_plan``, the calibrated W=8 PS
model of the session-8 grid) on the cluster of that grid's validation cell (goodput, duplex cap,
startup per push), once with max-min fair sharing and as the mean of 3 draws of the measured
uneven sharing (CV and period of the partitioned transfer class). Cases are JSON objects:

* ``{}``: the engine as it is;
* ``{"credit": MiB}``, ``{"tail": MiB or null}``, ``{"partition": MiB}``: other knobs;
* ``{"traits": {"priority": false}}`` (or ``stagger``): schedule traits switched;
* ``{"grant": MiB, "fifo": bool}`` needs ``grant-sim.patch``: a receiver-driven grant protocol
  (workers announce every push; each server grants them in the shared key order, or FIFO, with at
  most that many bytes granted and not yet delivered; announcements and grants are 64-byte
  messages on the same connections as the data, so they queue behind pushes and results);
* ``{"pace": f}`` needs ``pace-sim.patch``: every push flow capped at f times its fair share of a
  server port (B / W), an optimistic model of pacing each worker's sends.

    git worktree add --detach /tmp/whatif HEAD && cd /tmp/whatif
    git apply benchmarks/results/experiments-session9/grant-sim.patch   # or pace-sim.patch
    python benchmarks/results/experiments-session9/whatif.py resnet18,resnet50 '[{}, {"grant": 8}]'
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))

from benchmarks import run  # noqa: E402
from imerge_hooks import config, simulate  # noqa: E402
from imerge_hooks.costmodel import PSModel  # noqa: E402

MiB = 1 << 20
GRID = json.loads((ROOT / "benchmarks/results/bench-session8.json").read_text())


def set_experiment(case: dict) -> None:
    """Switch the patched simulator's experiment on for ``case`` (off for the others)."""
    grant = getattr(simulate, "_GRANT", None)
    if grant is not None:
        grant.clear()
        if case.get("grant"):
            grant.update(bytes=int(case["grant"] * MiB), fifo=bool(case.get("fifo", False)))
    pace = getattr(simulate, "_PACE", None)
    if pace is not None:
        pace[:] = [case["pace"]] if "pace" in case else []
    if ("grant" in case and grant is None) or ("pace" in case and pace is None):
        raise SystemExit(f"case {case} needs its patch applied (see the module doc)")


def main(models: list[str], cases: list[dict]) -> None:
    table = GRID["calibration"]["8"]["table"]
    psm = PSModel.fit(8, 2, table["bytes"], table["time_s"])
    imerge = config.SCHEDULE_TRAITS["imerge"]
    for model in models:
        cell = next(v for v in GRID["validation"]
                    if v["model"] == model and v["workers"] == 8 and v["schedule"] == "imerge")
        set_experiment({})  # the engine's plan is searched as the engine searches it
        plan = run.engine_plan(model, 8, 2, "imerge", 1.0, psm)
        spec = simulate.ModelSpec.from_profile_json(run.PROFILES / f"{model}-cpu.json")
        base = dict(workers=8, servers=2, bandwidth_Bps=125e6 * run.GOODPUT, startup_s=cell["startup_s"],
                    fabric_Bps=cell["fabric_Bps"], share_period_s=cell["share_period_s"])
        print(f"{model}: measured {cell['measured_s']:.3f} s/iter; plan {len(plan['groups'])} groups, "
              f"partition {plan['partition_bytes']} B", flush=True)
        for case in cases:
            set_experiment(case)
            config.SCHEDULE_TRAITS["imerge"] = dataclasses.replace(imerge, **case.get("traits", {}))
            kw = dict(groups=plan["groups"], timeline=False, cost_model=psm,
                      credit_bytes=int(case.get("credit", 8) * MiB),
                      partition_bytes=int(case["partition"] * MiB) if "partition" in case else plan["partition_bytes"])
            if "tail" in case:
                kw["tail_credit_bytes"] = None if case["tail"] is None else int(case["tail"] * MiB)
            try:
                fair = simulate.simulate(spec, simulate.ClusterSpec(**base), "imerge", **kw).iteration_s
                uneven = [simulate.simulate(spec, simulate.ClusterSpec(share_cv=cell["share_cv"], share_seed=seed,
                                                                      **base), "imerge", **kw).iteration_s
                          for seed in range(3)]
            finally:
                config.SCHEDULE_TRAITS["imerge"] = imerge
            print(f"  {json.dumps(case):45s} fair {fair:.3f}  uneven {sum(uneven) / len(uneven):.3f}", flush=True)
    set_experiment({})


if __name__ == "__main__":
    main(sys.argv[1].split(","), json.loads(sys.argv[2]) if len(sys.argv) > 2 else [{}])
