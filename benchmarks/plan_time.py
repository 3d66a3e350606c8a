"""How long worker 0 takes to choose a plan, and how good the plan is, at W = 4..256.

    python benchmarks/plan_time.py [--workers 4,8,...] [--profiles resnet50,...] [--timeout 600]
                                   [--out benchmarks/results/plan-time.json]

For every benchmark profile, W and S in (W, W/2): ``plan.choice.choose_plan`` for the ``imerge``
schedule on the profile's tensors in ready order, as ``plan.replan.Replanner`` calls it after
profiling, with the cost model the benchmarks use (the simulator's calibration of a cluster of
1 Gbit/s links and 200 us startup). Each cell runs in a child process under ``--timeout``; it
reports the CPU and wall seconds of ``choose_plan`` and the simulated iteration time of the
chosen plan (``simulate`` with those groups and that partition size).

It also runs what worker 0 blocks on: the search under the default CPU budget
(``Config.plan_search_budget_s``). Where the budget runs out, training starts on the fastest plan
simulated within it, or the DP's plan (``interim_iteration_s``, simulated the same way) while the
whole search (``cpu_s``) finishes in a background process; ``foreground_cpu_s`` is the budgeted
search plus the DP.
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

from benchmarks.cells import run_cell  # noqa: E402

PROFILES = ("alexnet", "resnet18", "resnet50", "vgg16", "synthetic")


def cell(profile: str, workers: int, servers: int) -> dict:
    from benchmarks.calibrate_budget import profile_inputs
    from imerge_hooks import Config
    from imerge_hooks.internals import SearchBudgetSpent, choose_plan
    from imerge_hooks.internals import plan_groups as plan
    from imerge_hooks.simulate import ClusterSpec, ModelSpec, calibrate_model, simulate

    path = REPO / "benchmarks" / "profiles" / f"{profile}-cpu.json"
    spec = ModelSpec.from_profile_json(path)
    sizes, ready, names = profile_inputs(path)  # ready order: the last layer's tensors first
    order = list(reversed(range(len(sizes))))
    cluster = ClusterSpec(workers=workers, servers=servers, bandwidth_Bps=1.25e9, startup_s=2e-4)
    model = calibrate_model(cluster)
    cfg = Config(schedule="imerge")

    def simulated(chosen) -> float:
        groups = [[order[j] for j in g] for g in chosen.groups]
        return simulate(spec, cluster, "imerge", cost_model=model, timeline=False, groups=groups,
                        partition_bytes=chosen.partition_bytes or cfg.partition_bytes, iterations=3,
                        stagger=chosen.stagger, waves=chosen.waves, server_credit_bytes=chosen.server_credit_bytes,
                        **({"tail_credit_bytes": None} if chosen.tail_credit is False else {})).iteration_s

    foreground, interim = time.thread_time(), None
    try:
        choose_plan(sizes, ready, names, model, cfg, workers, servers, cpu_budget_s=cfg.plan_search_budget_s)
    except SearchBudgetSpent as spent:  # as the engine: the fastest plan simulated so far, or the DP's
        interim = spent.best or plan(sizes, ready, model, "optimal")
    foreground = time.thread_time() - foreground
    cpu, wall = time.process_time(), time.perf_counter()
    chosen = choose_plan(sizes, ready, names, model, cfg, workers, servers)
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    sim_start = time.perf_counter()
    iteration_s = simulated(chosen)
    return {"profile": profile, "workers": workers, "servers": servers, "tensors": len(sizes), "cpu_s": cpu,
            "wall_s": wall, "groups": len(chosen.groups), "partition_bytes": chosen.partition_bytes,
            "iteration_s": iteration_s, "simulate_s": time.perf_counter() - sim_start,
            "budget_s": cfg.plan_search_budget_s, "foreground_cpu_s": foreground, "background": interim is not None,
            "interim_iteration_s": simulated(interim) if interim is not None else iteration_s}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workers", default="4,8,16,32,64,128,256")
    parser.add_argument("--profiles", default=",".join(PROFILES))
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument("--cell", help="profile,W,S: run one cell here and print its JSON")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.cell:
        profile, w, s = args.cell.split(",")
        print(json.dumps(cell(profile, int(w), int(s))), flush=True)
        return
    rows = []
    for profile in args.profiles.split(","):
        for workers in map(int, args.workers.split(",")):
            for servers in sorted({workers, max(1, workers // 2)}, reverse=True):
                row = run_cell(__file__, f"{profile},{workers},{servers}",
                               {"profile": profile, "workers": workers, "servers": servers}, args.timeout,
                               "not finished in {timeout_s:.0f} s")
                rows.append(row)
                shown = (f"search cpu {row['cpu_s']:7.2f} s wall {row['wall_s']:7.2f} s  foreground cpu "
                         f"{row['foreground_cpu_s']:5.2f} s{' (then background)' if row['background'] else ''}  "
                         f"iteration {row['iteration_s']:.5f} s, meanwhile {row['interim_iteration_s']:.5f} s"
                         if "error" not in row else row["error"])
                print(f"{profile:<10} W={workers:<4} S={servers:<4} {shown}", flush=True)
                if args.out:
                    Path(args.out).write_text(json.dumps({"command": "python benchmarks/plan_time.py "
                                                          + " ".join(sys.argv[1:]), "cells": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
