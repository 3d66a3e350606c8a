"""Session 9: why mgwfbp is below threshold for VGG-16 at W=8, in the simulator (max-min fair sharing).

For each schedule it prints the plan's groups and, on server 0 in a steady iteration, how long
its ingress (pushes) and egress (results) were busy and how long both were busy at once::

    python benchmarks/results/experiments-session9/vgg_fusion.py [MODEL] [SCHEDULES]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))

from benchmarks import run  # noqa: E402
from imerge_hooks import simulate  # noqa: E402
from imerge_hooks.costmodel import PSModel  # noqa: E402

GRID = json.loads((ROOT / "benchmarks/results/bench-session8.json").read_text())


def busy(spans: list[tuple[float, float]]) -> float:
    """Length of the union of ``spans``."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(spans):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def main(model: str, schedules: list[str]) -> None:
    table = GRID["calibration"]["8"]["table"]
    psm = PSModel.fit(8, 2, table["bytes"], table["time_s"])
    spec = simulate.ModelSpec.from_profile_json(run.PROFILES / f"{model}-cpu.json")
    names = [f"{layer.name}[{i}]" for layer in spec.layers for i in range(len(layer.param_bytes))]
    sizes = spec.tensor_bytes
    print(f"{model} W=8 S=2, fair sharing; server 0 in the second iteration")
    for schedule in schedules:
        cell = next(v for v in GRID["validation"]
                    if v["model"] == model and v["workers"] == 8 and v["schedule"] == schedule)
        cluster = simulate.ClusterSpec(workers=8, servers=2, bandwidth_Bps=125e6 * run.GOODPUT,
                                       startup_s=cell["startup_s"], fabric_Bps=cell["fabric_Bps"])
        res = simulate.simulate(spec, cluster, schedule, cost_model=psm, timeline=True, iterations=3)
        first = f"forward {spec.layers[0].name}"
        starts = sorted(e.start for e in res.timeline if e.track == "worker 0" and e.name == first)
        t0, t1 = starts[1], starts[2]

        server0 = [e for e in res.timeline if e.track == "server 0" and e.end > t0 and e.start < t1]
        push, pull = ([(max(e.start, t0), min(e.end, t1)) for e in server0 if e.kind == kind]
                      for kind in ("push", "pull"))
        both = busy(push) + busy(pull) - busy(push + pull)
        print(f"  {schedule}: iteration {t1 - t0:.2f} s (measured {cell['measured_s']:.2f}); ingress busy "
              f"{busy(push):.2f} s, egress busy {busy(pull):.2f} s, both {both:.2f} s")
        for g, members in enumerate(res.groups):
            mib = sum(sizes[i] for i in members) / 2**20
            print(f"    group {g}: {len(members):2d} tensors {names[members[0]]} .. {names[members[-1]]}, "
                  f"{mib:.1f} MiB")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "vgg16",
         sys.argv[2].split(",") if len(sys.argv) > 2 else ["threshold", "mgwfbp"])
