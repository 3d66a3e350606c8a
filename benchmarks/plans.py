"""The plans the engine and the simulator choose for the benchmark profiles, side by side.

    python benchmarks/plans.py [--json plans.json] [--cells 4x2,8x2]

For every profile in ``benchmarks/profiles`` and every planned schedule, on a simulated cluster
of W workers and S servers (1 Gbit/s links, 200 us startup; its PS cost model is the
simulator's calibration of that cluster):

* the engine's plan: ``plan.choice.choose_plan`` on the profile's tensors in ready order, as
  ``plan.replan.Replanner`` calls it after profiling (one layer per tensor, no forward times);
* the simulator's plan: ``simulate.simulate`` on the profile's layers, with its keys and the
  predicted iteration time.

The JSON (and the SHA-1 printed last) is the same before and after a change that must not
change any plan.
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
from pathlib import Path

from imerge_hooks import Config
from imerge_hooks.internals import SCHEDULE_TRAITS, choose_plan, planner_model
from imerge_hooks.simulate import ClusterSpec, ModelSpec, calibrate_model, simulate

PROFILES = Path(__file__).resolve().parent / "profiles"
PLANNED = [s for s, traits in SCHEDULE_TRAITS.items() if traits.planner != "none"]


def tensor_names(profile: dict) -> list[str]:
    return [p["name"] if "." in p["name"] else f'{layer["name"]}.{p["name"]}'
            for layer in profile["layers"] for p in layer.get("params", [])]


def plans_of(path: Path, workers: int, servers: int) -> dict:
    spec = ModelSpec.from_profile_json(path)
    names = tensor_names(json.loads(path.read_text()))
    sizes = spec.tensor_bytes
    suffix = list(itertools.accumulate(reversed([layer.backward_s for layer in spec.layers])))[::-1]
    ready = [suffix[i] for i, layer in enumerate(spec.layers) for _ in layer.param_bytes]
    order = list(reversed(range(len(sizes))))  # ready order: the last layer's tensors first
    cluster = ClusterSpec(workers=workers, servers=servers, bandwidth_Bps=1.25e9, startup_s=2e-4)
    model = calibrate_model(cluster)
    out = {}
    for schedule in PLANNED:
        chosen = choose_plan([sizes[i] for i in order], [ready[i] for i in order], [names[i] for i in order],
                             planner_model(SCHEDULE_TRAITS[schedule].planner, model), Config(schedule=schedule),
                             workers, servers)
        sim = simulate(spec, cluster, schedule, cost_model=model, timeline=False)
        out[schedule] = {
            "engine": {"groups": [[order[j] for j in g] for g in chosen.groups], "partition": chosen.partition_bytes},
            "simulator": {"groups": sim.groups, "partition": sim.plan.partition_bytes if sim.plan else None,
                          "keys": [(k.group, k.nbytes, k.server) for k in sim.keys],
                          "iteration_s": round(sim.iteration_s, 9)}}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", help="write every plan here")
    ap.add_argument("--cells", default="4x2,8x2", help="WxS cells, comma-separated")
    args = ap.parse_args()
    cells = [tuple(int(v) for v in c.split("x")) for c in args.cells.split(",")]
    result: dict = {}
    print("| profile | W x S | schedule | engine: groups / partition | simulator: groups / partition / keys | "
          "simulated s/iter |")
    print("|---|---|---|---|---|---|")
    for path in sorted(PROFILES.glob("*.json")):
        for workers, servers in cells:
            plans = plans_of(path, workers, servers)
            result[f"{path.stem} {workers}x{servers}"] = plans
            for schedule, p in plans.items():
                e, s = p["engine"], p["simulator"]
                print(f"| {path.stem} | {workers}x{servers} | {schedule} "
                      f"| {len(e['groups'])} / {e['partition'] or '-'} "
                      f"| {len(s['groups'])} / {s['partition'] or '-'} / {len(s['keys'])} | {s['iteration_s']:.4f} |",
                      flush=True)
    text = json.dumps(result, sort_keys=True)
    if args.json:
        Path(args.json).write_text(text)
    print("sha1", hashlib.sha1(text.encode()).hexdigest())


if __name__ == "__main__":
    main()
