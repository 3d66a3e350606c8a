"""How long the fusion planner's DP takes (``plan(..., "optimal")``, what the engine runs after
profiling, before any search) as the number of tensors grows.

    python benchmarks/planner_dp.py [--tensors 100,250,500,1000] [--repeat 3]
                                    [--out benchmarks/results/planner-dp.json]

Random tensor sizes (1 KiB .. 8 MiB) ready 0.2 ms apart, on two cost models: a linear one (1 GB/s,
200 us startup) and a PS table with an incast step at 256 KiB (the planner tests' models). Each cell
is the fastest of ``--repeat`` runs in CPU seconds of this process.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.machine import machine_info  # noqa: E402
from imerge_hooks.internals import LinearModel, PSModel, plan_groups  # noqa: E402

KiB, MiB = 1 << 10, 1 << 20


MODELS = {
    "linear": LinearModel(alpha=2e-4, beta=1e-9),
    "ps": PSModel.fit(16, 2, [float(KiB * 4**k) for k in range(9)],
                      [5e-5, 6e-5, 8e-5, 3e-3, 3.1e-3, 3.2e-3, 1.2e-2, 4.5e-2, 1.8e-1]),
}


def cell(model: str, tensors: int, repeat: int) -> dict:
    rng = random.Random(3)
    sizes = [float(rng.randint(KiB, 8 * MiB)) for _ in range(tensors)]
    ready = [i * 2e-4 for i in range(tensors)]
    best = float("inf")
    for _ in range(repeat):
        start = time.process_time()
        chosen = plan_groups(sizes, ready, MODELS[model], "optimal")
        best = min(best, time.process_time() - start)
    return {"model": model, "tensors": tensors, "cpu_s": best, "groups": len(chosen.groups)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tensors", default="100,250,500,1000")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "planner-dp.json"))
    args = parser.parse_args()
    counts = [int(n) for n in args.tensors.split(",")]
    rows = [cell(model, n, args.repeat) for model in MODELS for n in counts]
    print(f"{'model':8} {'tensors':>8} {'CPU s':>8} {'groups':>7}")
    for row in rows:
        print(f"{row['model']:8} {row['tensors']:8d} {row['cpu_s']:8.3f} {row['groups']:7d}")
    Path(args.out).write_text(json.dumps({"machine": machine_info(), "cells": rows}, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
