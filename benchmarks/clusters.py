"""IMerge on the cluster shapes users have: several workers per host, servers beside the workers or
on hosts of their own; side by side with DDP (gloo) and the ``mpi-allreduce`` peer in one launch.

    sudo .venv/bin/python benchmarks/clusters.py                      # cells a, b, c, e; three models
    sudo .venv/bin/python benchmarks/clusters.py --cells a,c --models synthetic --ab
    .venv/bin/python benchmarks/clusters.py --dry-run                 # the launches, nothing run

Cells (``CELLS``): (a) 2 hosts x 2 workers + 2 server hosts; (b) 4 hosts, each with one worker and
one server; (c) 2 hosts x 2 workers with one server on each; (d) 4 hosts x 2 workers + 4 server
hosts (12 ranks: only when asked for); (e) one worker per host and a server host per worker, S = W;
(f) one worker per host and a server host per two workers, S = W/2.
Every host is a network namespace of ``benchmarks/netlab`` with one shaped link each way; the ranks
of a host share it, and their traffic to each other stays inside the host. Ranks are ordered with
each host's workers together, so DDP's ring crosses every host link once each way (its best case).

Per cell and model, one launch of ``worker_replay.py`` runs ``ddp``, ``mpi-allreduce`` and ``imerge``
(``--ab``: a second launch with ``IMERGE_HOST_AGGREGATION=0``). Each gets:

* seconds per iteration and its own bound: a PS, max(compute, the busiest host link's bytes / rate)
  from where the servers are and the bytes each host pushes (M per host with host aggregation, M
  per worker without); the ring, max(compute, 2(W-1)/W x M / rate); beside them the bound of a
  hierarchy-aware all-reduce, 2(N-1)/N x M over N hosts, which NCCL approaches on GPU clusters;
* the bytes each host link carried per timed iteration, up and down (the link monitor);
* the CPU seconds per iteration of the ranks that did the work (DDP and mpi-allreduce: the workers;
  IMerge: workers and servers, from the launch's process tree).

Prints the table and writes ``results/clusters.json``. ``--simulate`` adds to every stored row what
``imerge_hooks.simulate`` predicts for it (the cell's hosts, links at the lab's TCP goodput; the peers
on ``simulate_allreduce``'s ring, which crosses each host link once each way as the ordered ranks do)
and the error against the measurement (``--simulate --no-measure`` on a stored JSON: no root).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.netlab import netlab as nl  # noqa: E402
from benchmarks.netlab.cpumon import CpuMonitor  # noqa: E402
from benchmarks.netlab.linkmon import LinkMonitor  # noqa: E402
from benchmarks.runner.grid import load_profile, tagged_json  # noqa: E402
from imerge_hooks.internals import link_bytes  # noqa: E402

WORKER = REPO / "benchmarks" / "worker_replay.py"
RESULTS = REPO / "benchmarks" / "results"
SCHEDULES = ("ddp", "mpi-allreduce", "imerge")


@dataclass(frozen=True)
class Cell:
    """Where each rank runs: ``workers[i]`` is worker i's host, ``servers[j]`` server j's."""

    title: str
    workers: tuple[int, ...]
    servers: tuple[int, ...]

    @property
    def host_of(self) -> list[int]:
        return list(self.workers) + list(self.servers)

    @property
    def hosts(self) -> int:
        return max(self.host_of) + 1


CELLS = {
    "a": Cell("2 hosts x 2 workers + 2 server hosts", (0, 0, 1, 1), (2, 3)),
    "b": Cell("4 hosts, each 1 worker + 1 server", (0, 1, 2, 3), (0, 1, 2, 3)),
    "c": Cell("2 hosts x 2 workers, a server on each", (0, 0, 1, 1), (0, 1)),
    "d": Cell("4 hosts x 2 workers + 4 server hosts", (0, 0, 1, 1, 2, 2, 3, 3), (4, 5, 6, 7)),
    "e": Cell("4 worker hosts + 4 server hosts (S = W)", (0, 1, 2, 3), (4, 5, 6, 7)),
    "f": Cell("4 worker hosts + 2 server hosts (S = W/2)", (0, 1, 2, 3), (4, 5)),
}


def bounds(cell: Cell, facts: dict, rate_Bps: float, aggregate: bool) -> dict:
    """Each schedule's own bound (module doc), seconds per iteration."""
    m, w = facts["bytes"], len(cell.workers)
    worker_hosts = len(set(cell.workers))
    ps = max(link_bytes(cell.host_of, w, m, aggregate))
    ring = 2 * (w - 1) / w * m
    hier = 2 * (worker_hosts - 1) / worker_hosts * m
    c = facts["compute_s"]
    return {"compute_s": c, "ps_s": max(c, ps / rate_Bps), "ring_s": max(c, ring / rate_Bps),
            "hierarchical_s": max(c, hier / rate_Bps), "ps_link_bytes": ps, "ring_link_bytes": ring,
            "hierarchical_link_bytes": hier}


def model_facts(model: str, time_scale: float) -> dict:
    p = load_profile(model)
    compute = sum(layer["forward_s"] + layer["backward_s"] for layer in p["layers"]) * time_scale
    return {"compute_s": compute, "bytes": sum(prm["bytes"] for layer in p["layers"] for prm in layer["params"])}


def window_bytes(samples: list, start: float, end: float) -> list[tuple[int, int]] | None:
    """(up, down) bytes of every host between the link samples nearest ``start`` and ``end``."""
    inside = [s for s in samples if start <= s[0] <= end]
    if len(inside) < 2:
        return None
    (t0, a), (t1, b) = inside[0], inside[-1]
    scale = (end - start) / (t1 - t0) if t1 > t0 else 1.0  # the samples span a little less than the window
    return [((y[0] - x[0]) * scale, (y[1] - x[1]) * scale) for x, y in zip(a, b)]


def window_cpu(cpu: CpuMonitor, start: float, end: float) -> float | None:
    inside = [s for s in cpu.samples if start <= s[0] <= end]
    if len(inside) < 2:
        return None
    (w0, _, _, c0), (w1, _, _, c1) = inside[0], inside[-1]
    return (c1 - c0) * (end - start) / (w1 - w0) if w1 > w0 else None


def launch(cell_id: str, model: str, args, aggregate: bool, timeline: str | None = None) -> list[dict]:
    """One mpiexec over the lab: every schedule of ``args.schedules`` for one cell and model (``timeline``:
    ``imerge`` alone, traced to that file, and the report of where its iterations go printed)."""
    cell = CELLS[cell_id]
    schedules = args.schedules if aggregate and timeline is None else ["imerge"]
    argv = [sys.executable, str(WORKER), "--model", model, "--schedules", ",".join(schedules),
            "--time-scale", repr(args.time_scale[model]), "--iters", str(args.iters), "--warmup", "1",
            "--profile-steps", "2"]
    env = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "IMERGE_NUM_SERVERS": str(len(cell.servers)),
           "IMERGE_COST_MODEL_PATH": str(RESULTS / "cache" / "psmodel-{workers}w-{servers}s-{hosts}.json"),
           "IMERGE_TIMEOUT_S": "600", "PYTHONPATH": str(REPO), "MASTER_ADDR": nl.host_addr(0),
           "GLOO_SOCKET_IFNAME": nl.IFACE, "IMERGE_HOST_AGGREGATION": "1" if aggregate else "0"}
    if timeline is not None:
        env["IMERGE_TIMELINE"] = timeline
    host_of = cell.host_of
    cmd = nl.mpiexec_cmd([argv] * len(host_of), hosts=cell.hosts, prefix=args.prefix, extra_env=env,
                         host_of=host_of)
    tag = f"{cell_id}-{model}" + ("" if aggregate else "-noagg") + ("" if timeline is None else "-timeline")
    logs = RESULTS / "logs" / "clusters"
    logs.mkdir(parents=True, exist_ok=True)
    (logs / f"{tag}.cmd").write_text(shlex.join(cmd) + "\n")
    if args.dry_run:
        print(f"{tag}: {len(host_of)} ranks on {cell.hosts} hosts, schedules {','.join(schedules)}")
        return []
    nl.up(cell.hosts, bandwidth=args.bandwidth, mtu=args.mtu, prefix=args.prefix)
    monitor = LinkMonitor(cell.hosts, args.prefix, interval_s=0.1).start()
    results: list[dict] = []
    with open(logs / f"{tag}.stderr", "w") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True, preexec_fn=os.setsid)
        cpu = CpuMonitor(proc.pid, interval_s=0.25).start()
        try:
            for line in proc.stdout:
                for kind, doc in tagged_json(line):
                    if kind == "RESULT":
                        results.append(doc)
                        print(f"   {tag} {doc['schedule']:<14} {doc['iteration_s']:7.3f} s/iter", file=sys.stderr,
                              flush=True)
            rc = proc.wait(timeout=args.timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            rc = None
        cpu.stop()
    monitor.stop()
    if rc != 0:
        print(f"   !! {tag}: exit code {rc}; see {logs / f'{tag}.stderr'}", file=sys.stderr)
    if timeline is not None:
        from imerge_hooks.tools.timeline_report import format_report, report

        print(format_report(report(timeline)))
        return []
    facts = model_facts(model, args.time_scale[model])
    rate = nl.parse_rate(args.bandwidth) / 8 * nl.goodput(args.mtu)
    b = bounds(cell, facts, rate, aggregate)
    rows = []
    for r in results:
        start, end = r["timed_monotonic_s"]
        per_host = window_bytes(monitor.samples, start, end)
        ranks_cpu = window_cpu(cpu, start, end)
        peer = r["schedule"] in ("ddp", "mpi-allreduce")  # the rest are PS schedules
        workers_cpu = r["worker_cpu_s_per_iter"] * len(cell.workers)
        bound = b["ring_s"] if peer else b["ps_s"]
        rows.append({
            "cell": cell_id, "title": cell.title, "model": model, "schedule": r["schedule"],
            "host_aggregation": aggregate if not peer else None, "workers": len(cell.workers),
            "servers": len(cell.servers), "hosts": cell.hosts, "iteration_s": r["iteration_s"],
            "bound_s": bound, "efficiency": bound / r["iteration_s"], "bounds": b,
            "link_bytes_per_iter": None if per_host is None else
            [[round(u / r["iters"]), round(d / r["iters"])] for u, d in per_host],
            "cpu_s_per_iter": workers_cpu if peer or ranks_cpu is None else ranks_cpu / r["iters"],
            "workers_cpu_s_per_iter": workers_cpu, "iters": r["iters"], "time_scale": args.time_scale[model],
            "bandwidth": args.bandwidth, "mtu": args.mtu,
            # what the engine installed (groups, partitions, stagger, waves, windows, tail credit)
            "plan": r.get("plan")})
    return rows


SIM_STARTUP_S = 200e-6  # the servers' per-push work (run.py's fallback when no model is calibrated)


def simulate_row(row: dict) -> float:
    """Seconds per iteration that the simulator predicts for one measured row."""
    from benchmarks.runner.grid import PROFILES
    from imerge_hooks.simulate import ALLREDUCE_SCHEDULES, ClusterSpec, ModelSpec, simulate, simulate_allreduce

    cell = CELLS[row["cell"]]
    spec = ModelSpec.from_profile_json(PROFILES / f"{row['model']}-cpu.json")
    rate = nl.parse_rate(row["bandwidth"]) / 8 * nl.goodput(row["mtu"])
    cluster = ClusterSpec(workers=len(cell.workers), servers=len(cell.servers), bandwidth_Bps=rate,
                          startup_s=SIM_STARTUP_S, time_scale=row["time_scale"], hosts=tuple(cell.host_of),
                          host_aggregation=bool(row["host_aggregation"]))
    if row["schedule"] in ALLREDUCE_SCHEDULES:
        return simulate_allreduce(spec, cluster, row["schedule"]).iteration_s
    return simulate(spec, cluster, row["schedule"], timeline=False).iteration_s


def table(rows: list[dict]) -> str:
    """One line per (cell, model): each schedule's s/iter (efficiency), IMerge's ratio to DDP, the
    busiest link's MB per iteration and the CPU seconds per iteration."""
    out = ["| cell | model | DDP | mpi-allreduce | IMerge | IMerge vs DDP | hierarchical bound | busiest link "
           "MB/iter (IMerge, DDP) | CPU s/iter (IMerge, DDP) | simulated IMerge, DDP (error) |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    cells: dict = {}
    for r in rows:
        name = r["schedule"] + ("" if r["host_aggregation"] in (None, True) else " (no host aggregation)")
        cells.setdefault((r["cell"], r["model"]), {})[name] = r
    for (cell, model), row in cells.items():
        def cell_text(name: str, row: dict = row) -> str:
            r = row.get(name)
            return "-" if r is None else f"{r['iteration_s']:.2f} s ({100 * r['efficiency']:.0f}%)"

        def simulated(name: str, row: dict = row) -> str:
            r = row.get(name)
            if r is None or r.get("simulated_s") is None:
                return "-"
            return f"{r['simulated_s']:.2f} s ({100 * (r['simulated_s'] / r['iteration_s'] - 1):+.0f}%)"

        def busiest(name: str, row: dict = row) -> str:
            r = row.get(name)
            if r is None or not r["link_bytes_per_iter"]:
                return "-"
            return f"{max(max(u, d) for u, d in r['link_bytes_per_iter']) / 1e6:.0f}"

        imerge, ddp = row.get("imerge"), row.get("ddp")
        ratio = f"{ddp['iteration_s'] / imerge['iteration_s']:.2f}x" if imerge and ddp else "-"
        hier = next(iter(row.values()))["bounds"]["hierarchical_s"]
        cpu = (f"{imerge['cpu_s_per_iter']:.2f}, {ddp['cpu_s_per_iter']:.2f}" if imerge and ddp else "-")
        text = f"| ({cell}) {CELLS[cell].title} | {model} | {cell_text('ddp')} | {cell_text('mpi-allreduce')} | "
        text += f"{cell_text('imerge')} | {ratio} | {hier:.2f} s | {busiest('imerge')}, {busiest('ddp')} | {cpu} | "
        text += f"{simulated('imerge')}, {simulated('ddp')} |"
        out.append(text)
        if "imerge (no host aggregation)" in row:
            name = "imerge (no host aggregation)"
            out.append(f"| | | | | without host aggregation: {cell_text(name)} | | | {busiest(name)} | | "
                       f"{simulated(name)} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cells", default="a,b,c,e")
    ap.add_argument("--models", default="synthetic,resnet50,vgg16")
    ap.add_argument("--schedules", default=",".join(SCHEDULES))
    ap.add_argument("--bandwidth", default="500mbit", help="per host and direction")
    ap.add_argument("--mtu", type=int, default=9000)
    ap.add_argument("--time-scale", default="synthetic=2.25,resnet50=0.45,vgg16=0.9",
                    help="MODEL=FACTOR,...: compute about one gradient's transfer over a link")
    ap.add_argument("--iters", type=int, default=6)
    ap.add_argument("--ab", action="store_true", help="also IMerge without host aggregation (cells with L > 1)")
    ap.add_argument("--timeout", type=float, default=1800.0)
    ap.add_argument("--prefix", default="imclu")
    ap.add_argument("--out", default=str(RESULTS / "clusters.json"))
    ap.add_argument("--dry-run", action="store_true")
    ap.add_argument("--timeline", default=None, metavar="CELL:MODEL",
                    help="trace imerge on one cell, print where its iterations go (results/timeline-clusters-*)")
    ap.add_argument("--simulate", action="store_true", help="add the simulator's prediction to every stored row")
    ap.add_argument("--no-measure", action="store_true", help="launch nothing: the stored JSON's table (no root)")
    args = ap.parse_args(argv)
    args.schedules = args.schedules.split(",")
    args.time_scale = {k: float(v) for k, v in (p.split("=") for p in args.time_scale.split(","))}
    rows: list[dict] = []
    out = Path(args.out)
    commands: list[str] = []
    if out.exists() and not args.dry_run:
        stored = json.loads(out.read_text())
        rows, commands = stored["rows"], stored.get("commands", [])
    commands.append(" ".join(["benchmarks/clusters.py", *(argv if argv is not None else sys.argv[1:])]))
    started = time.monotonic()
    if args.no_measure or args.timeline:
        args.models = ""
    if args.timeline:
        cell_id, model = args.timeline.split(":")
        launch(cell_id, model, args, True, str(RESULTS / f"timeline-clusters-{cell_id}-{model}.json"))
    try:
        for model in filter(None, args.models.split(",")):
            for cell_id in args.cells.split(","):
                runs = [True] + ([False] if args.ab and len(set(CELLS[cell_id].workers)) < len(CELLS[cell_id].workers)
                                 else [])
                for aggregate in runs:
                    new = launch(cell_id, model, args, aggregate)
                    keys = {(r["cell"], r["model"], r["schedule"], r["host_aggregation"]) for r in new}
                    rows = [r for r in rows if (r["cell"], r["model"], r["schedule"], r["host_aggregation"])
                            not in keys] + new
                    if not args.dry_run:
                        out.write_text(json.dumps({"rows": rows, "commands": commands}, indent=1))
    finally:
        if not args.dry_run and (not args.no_measure or args.timeline):
            nl.down(args.prefix)
    if args.simulate:
        for r in rows:
            r["simulated_s"] = simulate_row(r)
        out.write_text(json.dumps({"rows": rows, "commands": commands}, indent=1))
    print(table(rows))
    print(f"({time.monotonic() - started:.0f} s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
