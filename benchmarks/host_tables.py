"""The simulated tables on hosts as clusters have them: 8 workers per host behind one NIC, one server
colocated on each host (S = hosts), host aggregation on.

    python benchmarks/host_tables.py [--workers 8,16,...] [--models resnet50,...] [--timeout 900]
                                     [--out benchmarks/results/hosts.json]

Every cell (model, W, schedule) runs ``imerge_hooks.simulate`` in a child process under
``--timeout`` (the PS schedules; ``imerge`` searches its plan on that layout, as the engine does)
on ``ClusterSpec(hosts=...)``: W/8 hosts (one host of W workers below 8) with 1 Gbit/s NICs at TCP
goodput and 200 us per-push startup, as the one-rank-per-host tables. The peers (``ddp``,
``ddp-tuned``, ``mpi-allreduce``) run the ring model over the workers: a ring laid out host by host
crosses each NIC once each way, so the NIC carries what it carries with one rank per host, and the
hops inside a host are taken as free (NVLink), which favours the peers. Speed-up is against one
worker's compute-only throughput. Writes the JSON and, with ``--plot``, throughput and speed-up
against W.
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

MODELS = ("synthetic", "alexnet", "resnet18", "resnet50", "vgg16")
SCHEDULES = ("ddp", "ddp-tuned", "mpi-allreduce", "default", "wfbp", "priority", "imerge")
WORKERS_PER_HOST = 8
LINK_BPS = 1.25e8  # 1 Gbit/s
STARTUP_S = 200e-6


def cell(model: str, workers: int, schedule: str) -> dict:
    from benchmarks.netlab.netlab import GOODPUT
    from benchmarks.runner.grid import PEERS
    from benchmarks.runner.predict import simulate_peer
    from imerge_hooks.simulate import ClusterSpec, ModelSpec, simulate

    spec = ModelSpec.from_profile_json(REPO / "benchmarks" / "profiles" / f"{model}-cpu.json")
    hosts = max(1, workers // WORKERS_PER_HOST)
    start = time.process_time()
    if schedule in PEERS:
        flat = ClusterSpec(workers=workers, servers=1, bandwidth_Bps=LINK_BPS * GOODPUT, startup_s=STARTUP_S)
        result = simulate_peer(spec, flat, schedule)
    else:
        rank_hosts = [w * hosts // workers for w in range(workers)] + list(range(hosts))
        cluster = ClusterSpec(workers=workers, servers=hosts, bandwidth_Bps=LINK_BPS * GOODPUT, startup_s=STARTUP_S,
                              hosts=tuple(rank_hosts), host_aggregation=True)
        result = simulate(spec, cluster, schedule, timeline=False)
    compute = sum(layer.forward_s + layer.backward_s for layer in spec.layers)
    return {"model": model, "workers": workers, "servers": 0 if schedule in PEERS else hosts, "hosts": hosts,
            "schedule": schedule, "iteration_s": result.iteration_s, "samples_per_s": result.throughput,
            "speedup": result.throughput / (spec.batch_size / compute), "cpu_s": time.process_time() - start}


def plot(rows: list[dict], out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    models = list(dict.fromkeys(r["model"] for r in rows))
    for what, label in (("samples_per_s", "samples/s"), ("speedup", "speed-up vs one worker's compute")):
        fig, axes = plt.subplots(1, len(models), figsize=(4 * len(models), 3.4), squeeze=False)
        for ax, model in zip(axes[0], models):
            for schedule in SCHEDULES:
                pts = sorted((r["workers"], r[what]) for r in rows if r["model"] == model and r["schedule"] == schedule
                             and "error" not in r)
                if pts:
                    ax.plot(*zip(*pts), marker="o", label=schedule)
            ax.set_xscale("log", base=2)
            ax.set_title(model)
            ax.set_xlabel("workers (8 per host, a server on each host)")
            ax.set_ylabel(label)
        axes[0][0].legend(fontsize=7)
        fig.tight_layout()
        path = out.with_name(out.stem + ("-throughput.png" if what == "samples_per_s" else "-speedup.png"))
        fig.savefig(path, dpi=90)
        written.append(path)
    return written


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workers", default="8,16,32,64,128,256")
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--schedules", default=",".join(SCHEDULES))
    parser.add_argument("--timeout", type=float, default=900.0)
    parser.add_argument("--cell", help="model,W,schedule: run one cell here and print its JSON")
    parser.add_argument("--out", default=None)
    parser.add_argument("--resume", action="store_true", help="keep the cells --out already has")
    parser.add_argument("--plot", action="store_true")
    args = parser.parse_args()
    if args.cell:
        model, workers, schedule = args.cell.split(",")
        print(json.dumps(cell(model, int(workers), schedule)), flush=True)
        return
    out = Path(args.out) if args.out else None
    rows: list[dict] = []
    if args.resume and out is not None and out.exists():
        rows = [r for r in json.loads(out.read_text())["cells"] if "error" not in r]
    done = {(r["model"], r["workers"], r["schedule"]) for r in rows}
    for workers in map(int, args.workers.split(",")):
        for model in args.models.split(","):
            for schedule in args.schedules.split(","):
                if (model, workers, schedule) in done:
                    continue
                row = run_cell(__file__, f"{model},{workers},{schedule}",
                               {"model": model, "workers": workers, "schedule": schedule}, args.timeout,
                               "not simulated within {timeout_s:.0f} s")
                rows.append(row)
                shown = (f"{row['iteration_s']:.4f} s/iter  {row['samples_per_s']:9.1f} samples/s  speed-up "
                         f"{row['speedup']:6.1f}  ({row['cpu_s']:.0f} s cpu)" if "error" not in row else row["error"])
                print(f"{model:<10} W={workers:<4} {schedule:<14} {shown}", flush=True)
                if out is not None:
                    out.write_text(json.dumps({"command": "python benchmarks/host_tables.py " + " ".join(sys.argv[1:]),
                                               "cells": rows}, indent=1) + "\n")
    if args.plot and out is not None:
        for path in plot(rows, out):
            print(f"wrote {path}")


if __name__ == "__main__":
    main()
