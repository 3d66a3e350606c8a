"""Is the emulator faithful, and how do its links share a server's port: the fabric and CPU check of
every measured cell, the scale check (half the link rate and twice the compute must take twice as
long), and the connection-share statistics the simulator's uneven-sharing model takes from the
link monitor."""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable
from pathlib import Path

from benchmarks.netlab import netlab as nl
from benchmarks.runner.grid import PEERS, log
from benchmarks.runner.launch import Job, run_job

FABRIC_OK = 0.95  # a faithful emulator: the fabric probe moves at least this fraction of the links' nominal rate
CPU_OK = 0.5  # ... and the machine is less than this busy during the timed iterations


def transfer_class(schedule: str) -> str:
    """How a schedule's pushes share a server's port: "partitioned" (credit-limited partitions) or
    "whole" (whole-group messages). TCP incast shares a port far more unevenly, and for longer, under
    the second (the link monitor's connection-share CV per W and class: ``shares`` in the JSON,
    ``results/RESULTS.md``), so the simulator's sharing model takes its CV per class."""
    from imerge_hooks.internals import SCHEDULE_TRAITS

    if schedule in PEERS:
        return "all-reduce"
    return "partitioned" if SCHEDULE_TRAITS[schedule].partition else "whole"


def _monitored(links: dict | None) -> bool:
    return bool(links) and (links.get("dispersion_windows") or 0) >= 4 and bool(links.get("share_period_s"))


def measured_shares(runs: list[dict], launches: list[dict], workers: list[int],
                    args: argparse.Namespace) -> dict[tuple[int, str], tuple[float, float, str]]:
    """Per (W, transfer class): (connection share CV, share period s, source) for the simulator's
    uneven-sharing model.

    The median over the measured runs of that class at that W whose link monitor saw enough
    saturated windows; else the median over whole launches at that W; else
    ``--share-cv``/``--share-period`` when given.
    """
    out = {}
    for W in workers:
        per_launch = [li["links"] for li in launches if li.get("workers") == W and _monitored(li.get("links"))]
        for cls in ("partitioned", "whole"):
            got = [r["links"] for r in runs if r.get("workers") == W and transfer_class(r["schedule"]) == cls
                   and _monitored(r.get("links"))]
            src = f"link monitor, median of {len(got)} {cls} runs"
            if not got:
                got, src = per_launch, f"link monitor, median of {len(per_launch)} launches"
            if got:
                out[(W, cls)] = (statistics.median(g["connection_share_cv"] for g in got),
                                 statistics.median(g["share_period_s"] for g in got), src)
            elif args.share_cv is not None:
                out[(W, cls)] = (args.share_cv, args.share_period, "--share-cv/--share-period")
    return out


def scale_check(args: argparse.Namespace, runs: list[dict], servers_of: Callable[[int], int], facts: dict,
                log_dir: Path) -> dict:
    """Halve the link rate and double the compute of one measured cell: if the emulator (not the
    2-core host) sets the times, the iteration takes twice as long (the check passes within 5%)."""
    import copy

    model, workers, schedule = args.scale_check.split(":")
    workers = int(workers)
    ref = next((r for r in runs if (r["model"], r["workers"], r["schedule"]) == (model, workers, schedule)), None)
    if ref is None:
        log(f"[scale check] {args.scale_check} was not measured in this run: skipped")
        return {"cell": args.scale_check, "skipped": "not measured in this run"}
    half = copy.copy(args)
    rate = nl.parse_rate(args.bandwidth) // 2
    half.bandwidth, half.bandwidth_Bps, half.time_scale = nl.format_rate(rate), rate / 8.0, 2 * args.time_scale
    cache = Path(args.out_dir).resolve() / "cache" / nl.format_rate(rate)
    cache.mkdir(parents=True, exist_ok=True)
    nl.up(hosts=workers + servers_of(workers), bandwidth=half.bandwidth, prefix=args.prefix, mtu=args.mtu)
    log(f"[scale check] {model} W={workers} {schedule} at {half.bandwidth} with time scale {half.time_scale:g}")
    job = Job(model, workers, [schedule], 4 * ref["iteration_s"] * (ref["iters"] + 6) + 120, facts[model]["bytes"])
    job.iters = ref["iters"]
    out = run_job(job, half, cache, log_dir)
    got = next((r for r in out["results"] if r["schedule"] == schedule), None)
    result = {"cell": args.scale_check, "reference_s": ref["iteration_s"], "bandwidth": half.bandwidth,
              "time_scale": half.time_scale, "measured_s": got["iteration_s"] if got else None}
    if got:
        result["ratio"] = got["iteration_s"] / (2 * ref["iteration_s"])
        result["pass"] = abs(result["ratio"] - 1) <= 0.05
        log(f"[scale check] {got['iteration_s']:.3f} s/iter against 2 x {ref['iteration_s']:.3f}: ratio "
            f"{result['ratio']:.3f} ({'ok' if result['pass'] else 'FAILS: the host, not the links, sets the time'})")
    nl.up(hosts=workers + servers_of(workers), bandwidth=args.bandwidth, prefix=args.prefix, mtu=args.mtu)
    return result


def emulator_check(fabric: dict, runs: list[dict]) -> set:
    """Print, per W, whether the emulator was faithful, and mark every run: the fabric probe moved at
    least ``FABRIC_OK`` of the nominal rate with every link busy, and the ranks used less than
    ``CPU_OK`` of the machine's cores during the run's timed iterations. Returns the (model, W,
    schedule) that failed."""
    flagged = set()
    print(f"Emulator check (every measured cell; '!' marks a cell that fails it): fabric >= {100 * FABRIC_OK:.0f}% "
          f"of the nominal rate with every link busy (netlab/duplex_probe.py), the ranks' CPU < {100 * CPU_OK:.0f}% "
          "of the machine during the timed iterations (netlab/cpumon.py; the whole machine's busy share in brackets)")
    for W in sorted({r["workers"] for r in runs}):
        fab = fabric.get(str(W))
        ratio = fab["aggregate_Bps"] / fab["nominal_Bps"] if fab and fab.get("nominal_Bps") else None
        mine = [r for r in runs if r["workers"] == W]
        for r in mine:
            r["emulator_ok"] = bool(ratio is not None and ratio >= FABRIC_OK and r.get("ranks_cpu") is not None
                                    and r["ranks_cpu"] < CPU_OK)
            if not r["emulator_ok"]:
                flagged.add((r["model"], W, r["schedule"]))
        fab_text = (f"fabric {100 * ratio:.0f}% of {fab['nominal_Bps'] / 1e6:.0f} MB/s "
                    f"({'ok' if ratio >= FABRIC_OK else 'FAILS'})" if ratio is not None
                    else "fabric not probed (FAILS)")
        print(f"  W={W}: {fab_text}")
        for r in mine:
            cpu, busy = r.get("ranks_cpu"), r.get("machine_busy")
            cpu_text = "not monitored" if cpu is None else f"{100 * cpu:.0f}%"
            busy_text = "" if busy is None else f" ({100 * busy:.0f}%)"
            print(f"     {r['model']:<9} {r['schedule']:<13} ranks' CPU {cpu_text}{busy_text}"
                  f"{'' if r['emulator_ok'] else '  FAILS'}")
    return flagged
