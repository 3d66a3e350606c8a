"""The simulated tables in the users' regime: GPU-speed compute on 10 and 25 Gbit/s links, every PS
schedule beside the all-reduce peers, W = 4..256.

    python benchmarks/gpu_tables.py [--models alexnet,...] [--workers 4,8,...] [--shapes s=w,s=w/2,hosts8]
                                    [--links 10,25] [--schedules default,...,ddp,...] [--timeout 600]
                                    [--out benchmarks/results/gpu-tables.json] [--resume] [--plot]
    python benchmarks/gpu_tables.py --table [--out ...]     # Markdown tables from the stored JSON, runs nothing

What a cell is: one model, cluster shape, link rate, W and schedule, simulated by ``imerge_hooks.simulate``
in a child process under ``--timeout`` (``benchmarks/cells.py``). It records the simulated seconds per
iteration and throughput (samples/s over all workers), the cell's own physical bound, the CPU seconds
the simulation took in the child (``time.process_time``, the profile's loading excluded), the
simulator's ``fold`` and ``server_orbits`` and, for ``imerge``, the plan it chose (groups, partition
size, stagger; ``imerge`` searches its plan on the cell's own cluster, as the engine does). A cell that
ran out of time is stored with an ``error`` and shown as such.

* **Compute at GPU speed.** Each profile (``benchmarks/profiles/<model>-cpu.json``, batch 8, measured on
  a 2-core CPU) is replayed with ``ClusterSpec.time_scale = benchmarks.gpu_speed.time_scale(model)``:
  its compute per iteration becomes a published single-GPU time (forward + backward) at batch 8,
  scaled per sample. ResNet-18/50 and VGG-16: a Titan V (GV100) in ryujaehun/pytorch-gpu-benchmark's
  README, "Training, TITAN V, single" (16.69, 50.54, 72.85 ms at batch 12); AlexNet: VGG-16's time
  times AlexNet's per-image time over VGG-16's on a V100 (Lambda's tf_cnn_benchmarks logs);
  ``synthetic``: the geometric mean of those four scales (an assumption). ``benchmarks/gpu_speed.py``
  documents them; the run prints each model's source line.
* **Links**: 10 or 25 Gbit/s per host each way, at TCP goodput (``netlab.GOODPUT`` = 1448/1514, MTU
  1500), as ``host_tables.py`` and the runner's grid. **Server startup**: 200 us per push
  (``runner/grid.py: FALLBACK_STARTUP_S``, what the runner uses without a calibration; nothing
  measured says what a GPU cluster's server takes).
* **Shapes.** ``s=w``: a server per worker, every rank a host of its own; ``s=w/2``: W/2 servers, likewise
  one rank per host (the fold of alike workers applies to both above W = 16); ``hosts8``: hosts of 8
  workers behind one NIC with one server colocated on each (S = W/8), host aggregation on, laid out as
  ``host_tables.py`` lays them out (W >= 8 only; above 16 workers the fold over alike hosts), the hosts' local
  link a GPU's PCIe 3.0 x16 (12 GB/s) per worker and sums at that rate (``GPU_LOCAL_BPS``).
* **Schedules.** PS: ``default, wfbp, mgwfbp, priority, imerge`` (``simulate``). Peers on
  ``simulate_allreduce`` with its defaults: ``ddp`` (25 MiB buckets) and ``mpi-allreduce`` (Horovod's
  fusion), rings over the workers whose hops inside a host are charged to its local link, and,
  on hosts8 only, ``hierarchical`` (inside the hosts on their local link, then a ring across the hosts).
* **Physical bound** of a cell: max(compute, comm). Comm for a PS: the busiest host link's bytes / link
  rate, ``runner/grid.py: physical_bound`` (max(W/S, 1) x gradient bytes / rate) on one rank per host,
  ``ClusterSpec.busiest_link_share`` (pushes and results crossing a NIC, after host aggregation) on
  hosts8; for ``ddp``/``mpi-allreduce`` the ring's 2(W-1)/W x bytes / rate (``physical_bound``); for
  ``hierarchical`` the ring across the N hosts, 2(N-1)/N x bytes / rate. On hosts8 the PS schedules and
  ``hierarchical`` also have the host's local link: at least 2 (G-1) x bytes (the G-1 gradients to the
  key's owner or reduce-scatter, the sum back to G-1 mates or all-gather; G = 8) / ``local_Bps``, and
  comm is the larger (``bound_local_s`` records it): 14 x the bytes at 96 GB/s, below what a 10 or
  25 Gbit/s NIC takes for its 2 x (at ``ClusterSpec``'s default 2 GB/s the local link would bind).

Reproducing the full result set (from the repository root; each cell's JSON is written as it ends, so an
interrupted run goes on with ``--resume``)::

    python benchmarks/gpu_tables.py --resume --plot              # -> benchmarks/results/gpu-tables.json, *.png
    python benchmarks/gpu_tables.py --table > benchmarks/results/gpu-tables.md

The full grid is 1,460 cells (5 models; s=w and s=w/2: 2 links x 7 W x 7 schedules = 980; hosts8: 2 links
x 6 W x 8 schedules = 480), run one after another, one core. Each child spends 2 to 3 s starting (it
imports torch) and the peers nothing more. On one rank per host (folded above W = 16) a PS cell takes
seconds and ``imerge``'s plan search up to a few minutes at W = 128..256. Hosts8 folds alike hosts above
16 workers (8 simulated hosts): its 10 Gbit/s cells took about 1.5 h of one core here, the slowest
``imerge`` cells 1 to 3 minutes; W = 64 (8 hosts, not folded) is the slowest W. ``--workers 4,8,16,32,64``
alone, or one shape and link alone, roughly an hour or two.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import math
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.cells import run_cell  # noqa: E402
from benchmarks.host_tables import WORKERS_PER_HOST  # noqa: E402
from benchmarks.runner.grid import FALLBACK_STARTUP_S, model_facts, physical_bound, servers_for  # noqa: E402

MODELS = ("alexnet", "vgg16", "resnet18", "resnet50", "synthetic")
WORKERS = (4, 8, 16, 32, 64, 128, 256)
SHAPES = ("s=w", "s=w/2", "hosts8")
LINKS_GBIT = (10.0, 25.0)
PS_SCHEDULES = ("default", "wfbp", "mgwfbp", "priority", "imerge")
PEER_SCHEDULES = ("ddp", "mpi-allreduce", "hierarchical")  # hierarchical: hosts8 only
SCHEDULES = PS_SCHEDULES + PEER_SCHEDULES
DEFAULT_OUT = REPO / "benchmarks" / "results" / "gpu-tables.json"
DEFAULT_TIMEOUT_S = 600.0
# Inside a GPU host: each GPU's PCIe 3.0 x16 link, about 12 GB/s each way, shared by the host's ranks as
# one local link of G x that (ClusterSpec.local_Bps), and sums at that rate (reduce_Bps); the rings' hops
# inside a host are charged to it too (simulate_allreduce's in_host_hops), so every schedule pays alike.
GPU_LOCAL_BPS = 12e9
SLUG = {"s=w": "s-w", "s=w/2": "s-half-w", "hosts8": "hosts8"}
SHAPE_WORDS = {"s=w": "S = W, one rank per host", "s=w/2": "S = W/2, one rank per host",
               "hosts8": f"hosts of {WORKERS_PER_HOST} workers, a server colocated on each (S = W/{WORKERS_PER_HOST})"}


def link_Bps(gbit: float) -> float:
    """TCP payload rate of a ``gbit`` Gbit/s link (netlab's goodput at MTU 1500)."""
    from benchmarks.netlab.netlab import GOODPUT

    return gbit * 1e9 / 8 * GOODPUT


def applies(shape: str, workers: int, schedule: str) -> bool:
    """Whether the grid has this cell: hosts8 needs a whole host (W >= 8, a multiple of 8); hierarchical
    all-reduce only on hosts8 (with one rank per host it is the ring)."""
    if shape == "hosts8" and (workers < WORKERS_PER_HOST or workers % WORKERS_PER_HOST):
        return False
    return schedule != "hierarchical" or shape == "hosts8"


def layout(shape: str, workers: int) -> tuple[int, tuple[int, ...] | None]:
    """(S, the host of every rank or None for one rank per host) of ``shape`` at W: on hosts8 the
    workers fill hosts of 8 in rank order and server h sits on host h (``host_tables.py``'s layout)."""
    if shape == "hosts8":
        hosts = workers // WORKERS_PER_HOST
        return hosts, tuple(w * hosts // workers for w in range(workers)) + tuple(range(hosts))
    return servers_for({"s=w": "W", "s=w/2": "W/2"}[shape], workers), None


def gpu_source(model: str) -> str:
    from benchmarks.gpu_speed import GPU_TIMES

    ref = GPU_TIMES.get(model)
    if ref is None:
        return "assumed: the geometric mean of the measured models' time scales (benchmarks/gpu_speed.py)"
    return f"{ref.seconds * 1e3:.2f} ms at batch {ref.batch_size} on {ref.gpu}: {ref.source}"


def cells(model: str, shape: str, gbit: float, workers: int, schedules: list[str]) -> list[dict]:
    """Simulate cells of one cluster here, one per schedule (the child's side of :func:`run_cell`)."""
    return [cell(model, shape, gbit, workers, schedule) for schedule in schedules]


def cell(model: str, shape: str, gbit: float, workers: int, schedule: str) -> dict:
    """Simulate one cell here."""
    from benchmarks.gpu_speed import profile_path, time_scale
    from imerge_hooks import Config
    from imerge_hooks.internals import SCHEDULE_TRAITS
    from imerge_hooks.simulate import (
        ALLREDUCE_SCHEDULES,
        ClusterSpec,
        ModelSpec,
        allreduce_bound_s,
        simulate,
        simulate_allreduce,
    )

    spec = ModelSpec.from_profile_json(profile_path(model))
    scale = time_scale(model, spec)
    servers, hosts = layout(shape, workers)
    rate = link_Bps(gbit)
    cluster = ClusterSpec(workers=workers, servers=servers, bandwidth_Bps=rate, startup_s=FALLBACK_STARTUP_S,
                          time_scale=scale, hosts=hosts, host_aggregation=True,
                          local_Bps=WORKERS_PER_HOST * GPU_LOCAL_BPS, reduce_Bps=GPU_LOCAL_BPS)
    peer = schedule in ALLREDUCE_SCHEDULES
    start = time.process_time()
    if peer:
        result = simulate_allreduce(spec, cluster, schedule, in_host_hops=True)
    else:
        result = simulate(spec, cluster, schedule, timeline=False)
    cpu_s = time.process_time() - start
    facts = model_facts(model, scale)
    local_s = 0.0  # the hosts' local link: host aggregation, or hierarchical's phases inside a host
    if hosts is not None and schedule in (*PS_SCHEDULES, "hierarchical"):
        local_s = 2 * (WORKERS_PER_HOST - 1) * facts["bytes"] / cluster.local_Bps
    if hosts is None or schedule in ("ddp", "mpi-allreduce"):
        bound = physical_bound(facts, workers, servers, rate, schedule)
    else:
        nic = (allreduce_bound_s(facts["bytes"], workers // WORKERS_PER_HOST, rate) if schedule == "hierarchical"
               else cluster.busiest_link_share() * facts["bytes"] / rate)
        comm = max(nic, local_s)
        bound = {"compute_s": facts["compute_s"], "comm_s": comm, "bound_s": max(facts["compute_s"], comm)}
    row = {"model": model, "shape": shape, "link_gbit": gbit, "workers": workers, "servers": 0 if peer else servers,
           "per_host": WORKERS_PER_HOST if hosts is not None else 1, "schedule": schedule,
           "iteration_s": result.iteration_s, "samples_per_s": result.throughput,
           "bound_s": bound["bound_s"], "bound_compute_s": bound["compute_s"], "bound_comm_s": bound["comm_s"],
           "efficiency": bound["bound_s"] / result.iteration_s if result.iteration_s > 0 else None,
           "cpu_s": cpu_s, "fold": getattr(result, "fold", 1), "server_orbits": getattr(result, "server_orbits", None),
           "bound_local_s": local_s, "groups": len(result.groups), "time_scale": scale, "link_Bps": rate,
           "local_Bps": cluster.local_Bps, "startup_s": FALLBACK_STARTUP_S}
    if schedule == "imerge":
        plan = result.plan
        row["partition_bytes"] = plan.partition_bytes if plan and plan.partition_bytes else Config().partition_bytes
        row["stagger"] = (plan.stagger if plan and plan.stagger is not None else SCHEDULE_TRAITS["imerge"].stagger)
        row["plan_method"] = plan.method if plan else None
        row["waves"] = bool(plan and plan.waves)
        row["tail_credit"] = not (plan and plan.tail_credit is False)
    return row


def key(row: dict) -> tuple:
    return row["model"], row["shape"], float(row["link_gbit"]), int(row["workers"]), row["schedule"]


def load(out: Path) -> dict:
    return json.loads(out.read_text()) if out.exists() else {"cells": []}


def save(out: Path, doc: dict) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(json.dumps(doc, indent=1) + "\n")
    tmp.replace(out)


# ------------------------------------------------------------------------------------------ tables
def fmt_cell(row: dict | None) -> str:
    if row is None:
        return "-"
    if "error" in row:
        return "timeout" if "within" in row["error"] else "error"
    return f"{row['iteration_s']:.4f}"


def ordered(values, canonical) -> list:
    present = list(dict.fromkeys(values))
    return [v for v in canonical if v in present] + [v for v in present if v not in canonical]


def tables(doc: dict) -> str:
    """Per shape, link and model: a row per W with every schedule's s/iter, imerge's speed-up over the
    fastest other schedule and over DDP (their time / imerge's: above 1, imerge is faster), and the imerge
    cell's CPU seconds."""
    cells = doc.get("cells", [])
    by_key = {key(r): r for r in cells}
    lines = []
    if doc.get("gpu_sources"):
        lines += ["GPU compute (benchmarks/gpu_speed.py):", ""]
        lines += [f"* {m}: {src}" for m, src in doc["gpu_sources"].items()]
        lines.append("")
    errors = []
    for shape in ordered((r["shape"] for r in cells), SHAPES):
        for gbit in sorted({float(r["link_gbit"]) for r in cells if r["shape"] == shape}):
            here = [r for r in cells if r["shape"] == shape and float(r["link_gbit"]) == gbit]
            for model in ordered((r["model"] for r in here), MODELS):
                mine = [r for r in here if r["model"] == model]
                scheds = ordered((r["schedule"] for r in mine), SCHEDULES)
                ok = next((r for r in mine if "error" not in r), {})
                lines.append(f"**{model}**, {SHAPE_WORDS.get(shape, shape)}, {gbit:g} Gbit/s links "
                             f"(s/iter; compute {ok.get('bound_compute_s', math.nan) * 1e3:.2f} ms per iteration)")
                lines.append("")
                head = ["W", "S", *scheds, "PS bound", "imerge over the best other", "imerge over ddp", "imerge plan",
                        "imerge cpu s"]
                lines.append("| " + " | ".join(head) + " |")
                lines.append("|" + "---|" * len(head))
                for workers in sorted({int(r["workers"]) for r in mine}):
                    row = {s: by_key.get((model, shape, gbit, workers, s)) for s in scheds}
                    good = {s: r for s, r in row.items() if r is not None and "error" not in r}
                    errors += [r for r in row.values() if r is not None and "error" in r]
                    ps = next((r for s, r in good.items() if s in PS_SCHEDULES), None)
                    servers = ps["servers"] if ps else layout(shape, workers)[0]
                    im = good.get("imerge")
                    others = {s: r["iteration_s"] for s, r in good.items() if s != "imerge"}
                    vs_best = vs_ddp = plan = cpu = "-"
                    if im is not None:
                        if others:
                            best = min(others, key=others.get)
                            vs_best = f"{others[best] / im['iteration_s']:.2f}x ({best})"
                        if "ddp" in good:
                            vs_ddp = f"{good['ddp']['iteration_s'] / im['iteration_s']:.2f}x"
                        rotation = ", waves" if im.get("waves") else ", stagger"
                        plan = (f"{im['groups']} g, {im['partition_bytes'] / 2**20:g} MiB"
                                f"{rotation if im.get('stagger') else ', no stagger'}"
                                f"{', no tail' if im.get('tail_credit') is False else ''}"
                                f"{', orbits ' + str(im['server_orbits']) if im.get('server_orbits') else ''}")
                    if row.get("imerge") is not None:
                        cpu = f"{row['imerge']['cpu_s']:.1f}" if im is not None else fmt_cell(row["imerge"])
                    bound = f"{ps['bound_s']:.4f}" if ps else "-"
                    lines.append("| " + " | ".join([str(workers), str(servers), *(fmt_cell(row[s]) for s in scheds),
                                                    bound, vs_best, vs_ddp, plan, cpu]) + " |")
                lines.append("")
    if errors:
        lines.append("Cells without a result:")
        lines += [f"* {r['model']} {r['shape']} {float(r['link_gbit']):g} Gbit/s W={r['workers']} {r['schedule']}: "
                  f"{r['error']}" for r in errors]
    return "\n".join(lines)


def plot(doc: dict, out: Path) -> list[Path]:
    """One figure per shape and link rate, a panel per model: throughput against W per schedule, and
    the PS bound's throughput dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = [r for r in doc.get("cells", []) if "error" not in r]
    written = []
    for shape in ordered((r["shape"] for r in cells), SHAPES):
        for gbit in sorted({float(r["link_gbit"]) for r in cells if r["shape"] == shape}):
            here = [r for r in cells if r["shape"] == shape and float(r["link_gbit"]) == gbit]
            models = ordered((r["model"] for r in here), MODELS)
            fig, axes = plt.subplots(1, len(models), figsize=(max(4 * len(models), 7), 3.8), squeeze=False)
            for ax, model in zip(axes[0], models):
                mine = [r for r in here if r["model"] == model]
                for schedule in ordered((r["schedule"] for r in mine), SCHEDULES):
                    pts = sorted((r["workers"], r["samples_per_s"]) for r in mine if r["schedule"] == schedule)
                    ax.plot(*zip(*pts), marker="o", markersize=3, label=schedule,
                            linewidth=2.2 if schedule == "imerge" else 1.2)
                bound = {r["workers"]: r["samples_per_s"] * r["iteration_s"] / r["bound_s"]  # W x batch / bound
                         for r in mine if r["schedule"] in PS_SCHEDULES}
                if bound:
                    ax.plot(*zip(*sorted(bound.items())), color="grey", linestyle="--", label="PS bound")
                ax.set_xscale("log", base=2)
                ax.set_yscale("log")
                ax.set_title(model)
                ax.set_xlabel("workers W")
                ax.set_ylabel("samples/s")
            axes[0][0].legend(fontsize=7)
            fig.suptitle(f"{SHAPE_WORDS.get(shape, shape)}, {gbit:g} Gbit/s, GPU-speed compute", fontsize=10)
            fig.tight_layout()
            path = out.with_name(f"{out.stem}-{SLUG.get(shape, shape)}-{gbit:g}g.png")
            fig.savefig(path, dpi=90)
            plt.close(fig)
            written.append(path)
    return written


# ------------------------------------------------------------------------------------------ main
def parse(text: str, kind=str) -> list:
    return [kind(v.strip()) for v in text.split(",") if v.strip()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--workers", default=",".join(map(str, WORKERS)))
    parser.add_argument("--shapes", default=",".join(SHAPES), help=f"of {', '.join(SHAPES)}")
    parser.add_argument("--links", default="10,25", help="link rates in Gbit/s")
    parser.add_argument("--schedules", default=",".join(SCHEDULES),
                        help="PS schedules and peers (hierarchical runs on hosts8 only)")
    parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S, help="seconds per cell")
    parser.add_argument("--jobs", type=int, default=1, help="children at once (one core each)")
    parser.add_argument("--out", default=str(DEFAULT_OUT), help="the JSON (rewritten after every cell)")
    parser.add_argument("--resume", action="store_true",
                        help="keep the cells --out already has (a timed-out one too, unless --timeout is now longer)")
    parser.add_argument("--plot", action="store_true", help="PNGs next to --out: a figure per shape and link rate")
    parser.add_argument("--table", action="store_true", help="print Markdown tables from --out; run nothing")
    parser.add_argument("--cell", help=argparse.SUPPRESS)  # model,shape,gbit,W,schedule: one cell, JSON out
    args = parser.parse_args()
    if args.cell:
        model, shape, gbit, workers, schedule = args.cell.split(",")
        print(json.dumps(cells(model, shape, float(gbit), int(workers), schedule.split("+"))), flush=True)
        return
    out = Path(args.out)
    if args.table:
        doc = load(out)
        print(tables(doc))
        if args.plot:
            for path in plot(doc, out):
                print(f"wrote {path}")
        return
    models, shapes, schedules = parse(args.models), parse(args.shapes), parse(args.schedules)
    links, workers_list = parse(args.links, float), parse(args.workers, int)
    for name, values, known in (("model", models, MODELS), ("shape", shapes, SHAPES),
                                ("schedule", schedules, SCHEDULES)):
        unknown = [v for v in values if v not in known]
        if unknown:
            parser.error(f"unknown {name} {', '.join(unknown)}; choose from {', '.join(known)}")
    from benchmarks.gpu_speed import time_scale

    sources = {m: gpu_source(m) for m in models}
    print("GPU-speed compute (benchmarks/gpu_speed.py):")
    for m in models:
        print(f"  {m:<10} time_scale {time_scale(m):.5f}  {sources[m]}")
    print(f"links at TCP goodput ({link_Bps(1) * 8 / 1e9:.4f} of the rate), {FALLBACK_STARTUP_S * 1e6:.0f} us per push",
          flush=True)
    doc = load(out) if args.resume else {"cells": []}
    kept = [r for r in doc.get("cells", []) if "error" not in r or r.get("timeout_s", 0) >= args.timeout]
    doc = {"command": "python benchmarks/gpu_tables.py " + " ".join(sys.argv[1:]),
           "gpu_sources": {**doc.get("gpu_sources", {}), **sources},
           "settings": {"startup_s": FALLBACK_STARTUP_S, "goodput_of_rate": link_Bps(1) * 8 / 1e9,
                        "workers_per_host": WORKERS_PER_HOST, "timeout_s": args.timeout},
           "cells": kept}
    done = {key(r) for r in kept}
    jobs = []  # (ident, spec, schedules): one child each
    for workers in workers_list:
        for shape in shapes:
            for gbit in links:
                for model in models:
                    todo = [x for x in schedules if applies(shape, workers, x)
                            and (model, shape, gbit, workers, x) not in done]
                    # imerge's plan search is the long one: a child of its own, the others share one
                    for batch in ([x for x in todo if x != "imerge"], [x for x in todo if x == "imerge"]):
                        if batch:
                            jobs.append(({"model": model, "shape": shape, "link_gbit": gbit, "workers": workers},
                                         f"{model},{shape},{gbit:g},{workers},{'+'.join(batch)}", batch))
    lock = threading.Lock()

    def run(job) -> None:
        ident, spec, batch = job
        got = run_cell(__file__, spec, ident, args.timeout * len(batch), "not simulated within {timeout_s:.0f} s")
        rows = got if isinstance(got, list) else [{**got, "schedule": x, "timeout_s": args.timeout} for x in batch]
        with lock:
            for row in rows:
                doc["cells"] = [r for r in doc["cells"] if key(r) != key(row)] + [row]
                shown = (f"{row['iteration_s']:.4f} s/iter {row['samples_per_s']:10.1f} samples/s  "
                         f"bound {row['bound_s']:.4f} s  ({row['cpu_s']:.1f} s cpu)"
                         if "error" not in row else row["error"])
                print(f"{row['shape']:<6} {row['link_gbit']:>3g}G {row['model']:<10} W={row['workers']:<4} "
                      f"{row['schedule']:<14} {shown}", flush=True)
            save(out, doc)

    with concurrent.futures.ThreadPoolExecutor(max_workers=args.jobs) as pool:
        list(pool.map(run, jobs))
    print(f"wrote {out}")
    if args.plot:
        for path in plot(doc, out):
            print(f"wrote {path}")


if __name__ == "__main__":
    main()
