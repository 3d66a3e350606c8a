"""The measured part of a run: the lab held for this run alone, every launch still to run, then the
fabric probe per W, the scale check and the timeline launch; ``netlab.down`` in a ``finally``."""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING

from benchmarks.netlab import netlab as nl
from benchmarks.runner.emulator_check import scale_check
from benchmarks.runner.grid import FALLBACK_STARTUP_S, fmt_s, log
from benchmarks.runner.launch import Job, plan_jobs, print_jobs, run_job
from benchmarks.runner.predict import cached_psmodel, simulate_one, startup_for
from imerge_hooks.tools.timeline_report import format_report
from imerge_hooks.tools.timeline_report import report as timeline_report

if TYPE_CHECKING:
    from benchmarks.runner.document import Bench


def measure(bench: Bench) -> int | None:
    """Measure what is missing on the emulated cluster (the document is saved after every launch).

    Returns the exit code where the run ends here: 2 without root or netlab, or when another run
    holds the lab; 0 after ``--dry-run`` listed the launches. None: go on to the report."""
    args = bench.args
    why = None if os.geteuid() == 0 else "needs root (network namespaces)"
    why = why or nl.netlab_available()
    if why:
        log(f"netlab unavailable: {why}")
        return 2
    jobs = plan_jobs(bench)
    total_est = sum(j.estimate_s for j in jobs)
    log(f"{len(jobs)} launches; estimated {fmt_s(total_est)} of measurement (simulator-based estimate; "
        "calibration and a loaded CPU add to it)")
    if args.dry_run:
        print_jobs(jobs, bench)
        return 0
    held = nl.exclusive(args.prefix)  # a second run.py on this lab would take it down under us
    try:
        held.__enter__()
    except nl.NetlabError as exc:
        log(f"netlab: {exc}")
        return 2
    try:
        run_jobs(bench, jobs, total_est)
        probe_fabric(bench)
        if args.scale_check:
            bench.doc["scale_check"] = scale_check(args, bench.measured_runs, bench.servers, bench.facts,
                                                   bench.log_dir)
            bench.save()
        if args.timeline:
            timeline_launch(bench)
    finally:
        nl.down(prefix=args.prefix)
        held.__exit__(None, None, None)
    return None


def run_jobs(bench: Bench, jobs: list[Job], total_est: float) -> None:
    """Every launch, the lab brought up again where the number of hosts changes; the one-worker
    baseline of a model is measured in its first launch."""
    args, sw = bench.args, bench.servers
    current_hosts = None
    spent_est = 0.0
    for k, job in enumerate(jobs, 1):
        hosts = job.workers + sw(job.workers)
        if hosts != current_hosts:
            nl.up(hosts=hosts, bandwidth=args.bandwidth, prefix=args.prefix, mtu=args.mtu)
            current_hosts = hosts
        elapsed = time.perf_counter() - bench.t_start
        rate = elapsed / spent_est if spent_est > 0 else 1.0
        left = (total_est - spent_est) * max(rate, 1.0)
        log(f"[{k}/{len(jobs)}] measured {job.model} W={job.workers} S={sw(job.workers)} "
            f"({len(job.schedules)} schedules: "
            f"{','.join(job.schedules)}); estimate {fmt_s(job.estimate_s)}; elapsed {fmt_s(elapsed)}, "
            f"ETA ~{fmt_s(left)}")
        out = run_job(job, args, bench.cache_dir, bench.log_dir, baseline=job.model not in bench.baseline_runs)
        spent_est += job.estimate_s
        for r in out["results"]:
            r.update(bandwidth=args.bandwidth, loadavg=out["info"].get("loadavg_after"))
            if r["schedule"] == "local":
                r["measured_in_launch"] = f"W={job.workers} S={sw(job.workers)} (worker 0 alone, others idle)"
                bench.baseline_runs[job.model] = r
            else:
                bench.measured_runs.append(r)
        bench.launches.append(out["info"])
        bench.save()


def probe_fabric(bench: Bench) -> None:
    """What the lab moves with every link busy both ways (``netlab/duplex_probe.py``), per measured
    W not probed yet: the emulator check and the emulator's bound compare with it."""
    args, B = bench.args, bench.args.bandwidth_Bps
    fabric = bench.doc.setdefault("fabric", {})
    for W in [w for w in args.workers if str(w) not in fabric]:
        S = bench.servers(W)
        nl.up(hosts=W + S, bandwidth=args.bandwidth, prefix=args.prefix, mtu=args.mtu)
        fabric[str(W)] = nl.duplex_probe(W, S, prefix=args.prefix)
        fabric[str(W)]["nominal_Bps"] = 2 * min(W, S) * B  # the busier side's ports, both ways
        fabric[str(W)]["servers"] = S
        log(f"[fabric] W={W} S={S}: every link both ways at once moves "
            f"{fabric[str(W)]['aggregate_Bps'] / 1e6:.0f} MB/s in all (the servers' ports carry at most "
            f"{2 * S * B * args.goodput / 1e6:.0f} MB/s of TCP payload both ways)")
        bench.save()


def timeline_launch(bench: Bench) -> None:
    """``--timeline``: one more launch of MODEL:W:SCHEDULE with ``IMERGE_TIMELINE`` set, the
    simulator's trace of the same configuration beside it, and where the traced iteration went."""
    args, ts, B = bench.args, bench.args.time_scale, bench.args.bandwidth_Bps
    spec = args.timeline
    if spec == "auto":
        first = "imerge" if "imerge" in args.all_schedules else args.all_schedules[0]
        spec = f"{args.models[0]}:{max(args.workers)}:{first}"
    tm, tw, tsched = spec.split(":")
    tw = int(tw)
    S = bench.servers(tw)
    nl.up(hosts=tw + S, bandwidth=args.bandwidth, prefix=args.prefix, mtu=args.mtu)
    stem = bench.out_dir / f"timeline-{tm}-w{tw}-s{S}-{tsched}"
    log(f"[timeline] measured {tm} W={tw} {tsched} with IMERGE_TIMELINE={stem}-measured.json")
    out = run_job(Job(tm, tw, [tsched], 600.0, bench.facts[tm]["bytes"]), args, bench.cache_dir, bench.log_dir,
                  timeline_path=f"{stem}-measured.json")
    psm = cached_psmodel(bench.cache_dir, tw, S)
    st, _ = startup_for(tw, {tw: psm} if psm else {}, FALLBACK_STARTUP_S)
    sres = simulate_one(tm, tw, S, tsched, B, st, ts, cost_model=psm, timeline=True, goodput=args.goodput)
    sres.to_chrome_trace(f"{stem}-simulated.json")
    bench.doc["timeline"] = {"model": tm, "workers": tw, "servers": S, "schedule": tsched,
                             "measured_trace": f"{stem}-measured.json",
                             "simulated_trace": f"{stem}-simulated.json",
                             "measured": out["results"], "simulated_iteration_s": sres.iteration_s,
                             "info": out["info"]}
    print(f"\nTimeline {tm} W={tw} S={S} {tsched}: measured "
          f"{out['results'][0]['iteration_s'] if out['results'] else float('nan'):.3f} s/iter "
          f"(with tracing), simulated {sres.iteration_s:.3f} s/iter\n  {stem}-measured.json\n"
          f"  {stem}-simulated.json  (open in https://ui.perfetto.dev)")
    raw_links = (out["info"].get("links") or {}).get("raw")
    try:
        bench.doc["timeline"]["report"] = timeline_report(f"{stem}-measured.json", raw_links,
                                                          args.bandwidth_Bps * args.goodput)
        print(format_report(bench.doc["timeline"]["report"]))
    except (OSError, ValueError, KeyError) as exc:  # e.g. the launch failed before writing the trace
        log(f"[timeline] no report: {exc}")
    bench.save()
