"""What the start-up calibration's budget costs the planner: the budgeted model against the whole grid.

    python benchmarks/calibrate_budget.py [--model psmodel.json ...] [--cluster 4x2@250mbit ...]
                                          [--budget-s 3] [--barrier-us 5000] [--profiles resnet18-cpu,...]

Each input is a PS table over the whole calibration grid: a JSON that
``python -m imerge_hooks.plan.calibrate --out`` wrote (no ``--budget-s``), or the simulator's
calibration of a cluster ``WxS@RATE`` (``simulate.calibrate_model``; links of RATE, 200 us
startup). For each it replays ``plan.calibrate.measure_grid`` on that table with a clock that
advances as the real calibration's would (the warm-up of the first half of the grid, then per
size a warm-up and the samples, each after a barrier of ``--barrier-us``), and prints how many
sizes the budget measures, the seconds it takes against the whole grid, and the fitted a and B
of the whole table and of the budgeted one (``costmodel.extend_table``).

Then, for every benchmark profile and the schedules whose planner uses the model
(``adaptive-ps``, ``imerge``, ``mgwfbp``), the plan ``plan.choice.choose_plan`` picks with each
model (as ``benchmarks/plans.py`` calls it); where they differ, both plans' simulated
iteration time under the whole-grid model (the score ``plan.choice.search_plan`` ranks plans by).
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.plans import tensor_names  # noqa: E402
from imerge_hooks import Config  # noqa: E402
from imerge_hooks.internals import (  # noqa: E402
    PSModel,
    calibrate,
    choose_plan,
    cluster_for,
    extend_table,
    model_spec_from_profile,
    planner_model,
)
from imerge_hooks.simulate import ClusterSpec, ModelSpec, calibrate_model, simulate  # noqa: E402

PROFILES = REPO / "benchmarks" / "profiles"
SCHEDULES = ("mgwfbp", "adaptive-ps", "imerge")
_RATES = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9}


def parse_cluster(text: str) -> tuple[int, int, float]:
    """``4x2@250mbit`` -> (workers, servers, bytes/s)."""
    try:
        shape, rate = text.lower().split("@")
        workers, servers = (int(v) for v in shape.split("x"))
        unit = next(u for u in _RATES if rate.endswith(u))
        return workers, servers, float(rate[: -len(unit)]) * _RATES[unit] / 8
    except (ValueError, StopIteration):
        raise argparse.ArgumentTypeError(f"expected WxS@RATE such as 4x2@250mbit, got {text!r}") from None


def replay(model: PSModel, budget_s: float, barrier_s: float) -> tuple[list[float], float, float]:
    """The times ``measure_grid`` keeps on ``model``'s table, its seconds, and the whole grid's seconds."""
    sizes, times = [int(m) for m in model.sizes], list(model.times)

    def run(budget: float | None) -> tuple[list[float], float]:
        clock = [sum(times[: len(sizes) // 2])]

        def sample(index: int, repeats: int) -> tuple[float, float, float]:
            clock[0] += (repeats + 1) * times[index] + repeats * barrier_s
            return times[index], clock[0], barrier_s

        kept = calibrate.measure_grid(sizes, sample, budget)
        return kept, clock[0]

    kept, spent = run(budget_s)
    return kept, spent, run(None)[1]


def profile_inputs(path: Path) -> tuple[list[int], list[float], list[str]]:
    """A profile's tensors in ready order (sizes, ready times, names), as benchmarks/plans.py builds them."""
    spec = ModelSpec.from_profile_json(path)
    names = tensor_names(json.loads(path.read_text()))
    sizes = spec.tensor_bytes
    suffix = list(itertools.accumulate(reversed([layer.backward_s for layer in spec.layers])))[::-1]
    ready = [suffix[i] for i, layer in enumerate(spec.layers) for _ in layer.param_bytes]
    order = list(reversed(range(len(sizes))))
    return [sizes[i] for i in order], [ready[i] for i in order], [names[i] for i in order]


def iteration_s(plan, sizes, ready, names, model: PSModel, cfg: Config) -> float:
    """The plan's simulated iteration time on the cluster ``model`` describes (search_plan's score)."""
    n = len(sizes)
    return simulate(model_spec_from_profile(sizes, ready, names), cluster_for(model, model.workers, model.servers),
                    cfg.schedule, partition_bytes=plan.partition_bytes or cfg.partition_bytes,
                    credit_bytes=cfg.credit_bytes,
                    tail_credit_bytes=cfg.tail_credit_bytes, cost_model=model, iterations=3,
                    overlap_forward=cfg.overlap, timeline=False, groups=[[n - 1 - i for i in g] for g in plan.groups],
                    stagger=plan.stagger).iteration_s


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", action="append", default=[], help="whole-grid PSModel JSON (repeatable)")
    ap.add_argument("--cluster", action="append", default=[], type=parse_cluster,
                    help="simulated cluster WxS@RATE (repeatable; default 3x1@250mbit and 4x2@250mbit)")
    ap.add_argument("--budget-s", type=float, default=calibrate.STARTUP_BUDGET_S)
    ap.add_argument("--barrier-us", type=float, default=5000.0, help="seconds per sample beyond its time, in us")
    ap.add_argument("--profiles", default=None, help="comma-separated profile names (default: all)")
    args = ap.parse_args(argv)
    inputs = [(path, PSModel.from_json(path)) for path in args.model]
    for workers, servers, rate in args.cluster or ([] if inputs else [parse_cluster("3x1@250mbit"),
                                                                       parse_cluster("4x2@250mbit")]):
        cluster = ClusterSpec(workers=workers, servers=servers, bandwidth_Bps=rate, startup_s=2e-4)
        inputs.append((f"simulated {workers}x{servers} at {rate * 8 / 1e6:g} Mbit/s", calibrate_model(cluster)))
    wanted = set(args.profiles.split(",")) if args.profiles else None
    profiles = [p for p in sorted(PROFILES.glob("*.json")) if wanted is None or p.stem in wanted]
    worst = 0.0
    for name, whole in inputs:
        if whole.measured < len(whole.sizes):
            print(f"{name}: measured only {whole.measured} of {len(whole.sizes)} sizes; need a whole-grid table")
            return 2
        kept, spent, whole_s = replay(whole, args.budget_s, args.barrier_us * 1e-6)
        grid = [int(m) for m in whole.sizes]
        budgeted = PSModel.fit(whole.workers, whole.servers, grid, extend_table(grid[:len(kept)], kept, grid),
                               measured=len(kept))
        print(f"== {name}: W={whole.workers} S={whole.servers}, measures {len(kept)}/{len(grid)} sizes in "
              f"~{spent:.1f} s (whole grid ~{whole_s:.1f} s); a {whole.a * 1e6:.0f} -> {budgeted.a * 1e6:.0f} us, "
              f"B {whole.bandwidth / 1e6:.1f} -> {budgeted.bandwidth / 1e6:.1f} MB/s per server", flush=True)
        if len(kept) == len(grid):
            print("   the whole grid fits the budget: the same model, the same plans")
            continue
        for path in profiles:
            sizes, ready, names = profile_inputs(path)
            for schedule in SCHEDULES:
                cfg = Config(schedule=schedule)
                plans = [choose_plan(sizes, ready, names, planner_model(cfg.traits.planner, m), cfg,
                                     whole.workers, whole.servers) for m in (whole, budgeted)]
                same = len({(str(p.groups), p.partition_bytes, p.stagger) for p in plans}) == 1
                line = f"   {path.stem:14} {schedule:12} {len(plans[0].groups):>4} groups"
                if same:
                    print(line + ": same plan", flush=True)
                    continue
                t_whole, t_budget = (iteration_s(p, sizes, ready, names, whole, cfg) for p in plans)
                worst = max(worst, t_budget / t_whole - 1)
                print(line + f" / partition {plans[0].partition_bytes}, stagger {plans[0].stagger}: "
                      f"{t_whole * 1e3:.2f} ms; budgeted: {len(plans[1].groups)} groups / partition "
                      f"{plans[1].partition_bytes}, stagger {plans[1].stagger}: {t_budget * 1e3:.2f} ms "
                      f"({(t_budget / t_whole - 1) * 100:+.2f}% under the whole-grid model)", flush=True)
    print(f"worst slowdown of a budgeted model's plan under the whole-grid model: {worst * 100:+.2f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
