"""Launches on the emulated cluster: the list of launches still to run with their time and RAM
estimates, and one mpiexec launch of ``worker_replay.py`` over the lab (its RESULT records, link
and CPU monitors, veth byte counters, logs)."""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

from benchmarks.machine import loadavg
from benchmarks.netlab import netlab as nl
from benchmarks.netlab.cpumon import CpuMonitor
from benchmarks.netlab.linkmon import LinkMonitor
from benchmarks.netlab.linkmon import summarize as summarize_links
from benchmarks.runner.grid import (
    FALLBACK_STARTUP_S,
    PLANNED,
    REPO,
    WORKER,
    fmt_list,
    fmt_s,
    log,
    servers_for,
    tagged_json,
)
from benchmarks.runner.predict import cached_psmodel, simulate_one, startup_for

if TYPE_CHECKING:
    from benchmarks.runner.document import Bench


class Job:
    """One mpiexec launch: these schedules of one model at W, one after the other."""

    def __init__(self, model: str, workers: int, schedules: list[str], estimate_s: float, nbytes: int) -> None:
        self.model, self.workers, self.schedules, self.estimate_s = model, workers, schedules, estimate_s
        self.nbytes = nbytes
        self.iters: int | None = None  # timed iterations (None: --iters)


def mem_available() -> float | None:
    """MemAvailable of /proc/meminfo in bytes, None where there is none."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return float(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def estimate_peak_memory(nbytes: int, workers: int, servers: int, shared: bool) -> float:
    """Peak RAM of one launch, from what was measured on this box (VGG-16, W=8, S=2): a rank is
    ~0.4 GB of Python + torch; a worker holds its gradients' flat buffer and result buffer (2x
    the gradient bytes) plus up to ~0.6x more while a new plan's buffers are built or the first
    gradients are allocated, plus its parameters unless they are shared (then one shared copy);
    a server holds 2x its share of the bytes, and up to ~6x around plan epoch changes (old keys'
    buffers are kept until their result sends complete)."""
    base = 0.4e9
    worker = base + 2.6 * nbytes + (0 if shared else nbytes)
    server = base + 6.0 * nbytes / servers
    return workers * worker + servers * server + (nbytes if shared else 0)


def plan_jobs(bench: Bench) -> list[Job]:
    """The launches still to run, the largest W first, each with its time estimate (from the
    simulator) and timed iterations (about ``--min-timed-s`` of timed run per schedule). A model
    above ``--isolate-above-mb`` gets one launch per schedule."""
    args, facts, sw = bench.args, bench.facts, bench.servers
    B, ts = args.bandwidth_Bps, args.time_scale
    startup0 = (args.sim_startup_us * 1e-6 if args.sim_startup_us is not None else
                startup_for(0, {w: m for w in args.workers if (m := cached_psmodel(bench.cache_dir, w, sw(w)))},
                            FALLBACK_STARTUP_S)[0])
    done = {(r["model"], r["workers"], r["schedule"]) for r in bench.measured_runs}
    jobs: list[Job] = []
    for W in sorted(args.workers, reverse=True):  # the largest W first (table 2 at W=8 matters most)
        for m in args.models:
            todo = [s for s in args.all_schedules if (m, W, s) not in done]
            if not todo:
                continue
            sim_t = {s: simulate_one(m, W, sw(W), s, B, startup0, ts, goodput=args.goodput).iteration_s
                     for s in set(todo) | {"wfbp"}}
            # more timed iterations where they are cheap: about --min-timed-s of timed run per schedule
            iters = max(args.iters, min(args.max_iters, math.ceil(args.min_timed_s / statistics.median(
                sim_t[s] for s in todo))))
            # launch (W+S Python processes importing torch on few cores) + the one-worker baseline
            launch_s = 20.0 + 3.0 * (W + sw(W)) + (args.warmup + iters) * facts[m]["compute_s"]
            run_s = {s: (args.warmup + iters) * sim_t[s] + (args.profile_steps * sim_t["wfbp"] if s in PLANNED
                                                             else 0) for s in todo}
            if "ddp-tuned" in run_s:  # worker_replay times 3 iterations of every candidate cap first
                from benchmarks.peers import ddp_caps

                run_s["ddp-tuned"] += 3 * len(ddp_caps(facts[m]["bytes"])) * sim_t["ddp-tuned"]
            # Big models: one launch per schedule. The ranks' memory then starts afresh for each
            # schedule; seven schedules in one VGG-16 launch at W=8 ran this 24 GB machine out of RAM.
            isolate = facts[m]["bytes"] > args.isolate_above_mb * 1e6
            for part in ([[s] for s in todo] if isolate else [todo]):
                job = Job(m, W, part, launch_s + sum(run_s[s] for s in part), facts[m]["bytes"])
                job.iters = iters
                jobs.append(job)
    return jobs


def print_jobs(jobs: list[Job], bench: Bench) -> None:
    """``--dry-run``: every launch with its time, timed iterations, peak RAM and schedules."""
    for j in jobs:
        ram = estimate_peak_memory(j.nbytes, j.workers, bench.servers(j.workers), bench.args.share_params)
        print(f"  {j.model:<9} W={j.workers:<3} {fmt_s(j.estimate_s):>9}  {j.iters} timed iters  peak RAM ~"
              f"{ram / 1e9:.1f} GB  {','.join(j.schedules)}")


def run_job(job: Job, args: argparse.Namespace, cache_dir: Path, log_dir: Path, timeline_path: str | None = None,
            baseline: bool = False) -> dict:
    """One mpiexec launch over the lab: every schedule of ``job`` for one model and W."""
    W = job.workers
    S = servers_for(args.servers, W)
    hosts = W + S
    argv = [sys.executable, str(WORKER), "--model", job.model, "--schedules", ",".join(job.schedules),
            "--time-scale", repr(args.time_scale), "--iters", str(job.iters or args.iters),
            "--warmup", str(args.warmup),
            "--profile-steps", str(args.profile_steps)] + (["--baseline"] if baseline else []) + \
        (["--alternate", args.alternate] if args.alternate else [])
    env = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "IMERGE_NUM_SERVERS": str(S),
           "IMERGE_COST_MODEL_PATH": str(cache_dir / "psmodel-{workers}w-{servers}s-{hosts}.json"),
           "IMERGE_TIMEOUT_S": str(int(args.imerge_timeout)), "PYTHONPATH": str(REPO),
           # the peers' gloo group (DDP) meets at worker 0's lab address, over the lab's veths
           "MASTER_ADDR": nl.host_addr(0), "GLOO_SOCKET_IFNAME": nl.IFACE}
    env.update(args.rank_env)
    if timeline_path:
        env["IMERGE_TIMELINE"] = timeline_path
    tag = f"{job.model}-w{W}-s{S}" + ("-timeline" if timeline_path else "")
    if args.max_load is not None:
        t_wait = time.perf_counter()
        while (la := loadavg()) and la[0] > args.max_load and time.perf_counter() - t_wait < 900:
            if time.perf_counter() - t_wait < 1:
                log(f"   {tag}: waiting (up to 15 min) for the 1-min load average {la[0]:.1f} to drop "
                    f"below {args.max_load:g}")
            time.sleep(15.0)
    need = estimate_peak_memory(job.nbytes, W, S, args.share_params)
    waited = 0.0
    while (avail := mem_available()) is not None and need > args.mem_fraction * avail:
        if waited >= args.mem_wait:
            msg = (f"skipped: needs ~{need / 1e9:.1f} GB of RAM, MemAvailable {avail / 1e9:.1f} GB "
                   f"(waited {waited:.0f} s); running it could invoke the OOM killer")
            log(f"   !! {tag} {msg}")
            return {"results": [], "info": {"model": job.model, "workers": W, "servers": S, "rc": None,
                                            "schedules": job.schedules, "missing": job.schedules, "skipped": msg}}
        if waited == 0:
            log(f"   {tag}: waiting for RAM (needs ~{need / 1e9:.1f} GB, MemAvailable {avail / 1e9:.1f} GB)")
        time.sleep(10.0)
        waited += 10.0
    share = None
    if args.share_params:
        share = f"/dev/shm/imerge-bench-{job.model}-{os.getpid()}.params"
        with open(share, "wb") as fh:
            fh.truncate(job.nbytes)
        argv += ["--share-params", share]
    cmd = nl.mpiexec_cmd([argv] * hosts, hosts=hosts, prefix=args.prefix, extra_env=env)
    (log_dir / f"{tag}.cmd").write_text(shlex.join(cmd) + "\n")
    try:
        return _launch(job, args, cmd, tag, log_dir, need)
    finally:
        if share:
            os.unlink(share)


def _launch(job: Job, args: argparse.Namespace, cmd: list[str], tag: str, log_dir: Path, need: float) -> dict:
    W = job.workers
    S = servers_for(args.servers, W)
    hosts = W + S
    counters0 = [nl.link_counters(i, args.prefix) for i in range(hosts)]
    monitor = LinkMonitor(hosts, args.prefix, interval_s=args.link_monitor).start() if args.link_monitor > 0 else None
    load0, t0, t_mono0 = loadavg(), time.perf_counter(), time.monotonic()
    timeout = args.job_timeout or max(300.0, 3.0 * job.estimate_s + 240.0)
    results: list[dict] = []
    rankinfo: list[dict] = []
    with open(log_dir / f"{tag}.stderr", "w") as err, open(log_dir / f"{tag}.stdout", "w") as out:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True, preexec_fn=os.setsid)
        cpu_monitor = CpuMonitor(proc.pid, interval_s=0.25).start()
        timed_out = threading.Event()

        def kill_after() -> None:
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                timed_out.set()
                try:
                    os.killpg(proc.pid, 9)
                except ProcessLookupError:
                    pass

        threading.Thread(target=kill_after, daemon=True).start()
        assert proc.stdout is not None
        for line in proc.stdout:
            out.write(line)
            out.flush()
            for kind, doc in tagged_json(line):
                if kind == "RESULT":
                    doc["_ended"] = time.monotonic()  # link-monitor clock: this schedule's samples end here
                    results.append(doc)
                    log(f"      {job.model} W={W} {doc['schedule']:<12} {doc['iteration_s']:8.3f} s/iter "
                        f"{doc['samples_per_s']:8.2f} samples/s  ({fmt_s(time.perf_counter() - t0)} into the launch)")
                    if doc.get("alternate"):
                        ab = doc["alternate"]
                        log(f"      A/B in one plan: A (engine's policy) {fmt_list(ab['a_s'])} s/iter, "
                            f"B ({args.alternate}) {fmt_list(ab['b_s'])} s/iter")
                else:
                    rankinfo.append(doc)
        rc = proc.wait()
    wall = time.perf_counter() - t0
    cpu_monitor.stop()
    for r in results:  # how busy the whole machine was during each schedule's timed iterations
        window = r.get("timed_monotonic_s")
        r["machine_busy"] = cpu_monitor.busy_fraction(*window) if window else None
        r["ranks_cpu"] = cpu_monitor.ranks_fraction(*window) if window else None
    links = None
    if monitor is not None:
        monitor.stop()
        (log_dir / f"{tag}.links.json").write_text(json.dumps(monitor.samples))
        links = summarize_links(monitor.samples, W, S, args.bandwidth_Bps * args.goodput)
        links["raw"] = str(log_dir / f"{tag}.links.json")
        begun = t_mono0
        for r in results:  # each schedule's own share of the samples (profile, warm-up and timed iterations)
            part = [x for x in monitor.samples if begun <= x[0] <= r["_ended"]]
            if r["schedule"] != "local" and len(part) >= 3:
                r["links"] = summarize_links(part, W, S, args.bandwidth_Bps * args.goodput)
                del r["links"]["upload_utilisation"], r["links"]["download_utilisation"]
            begun = r["_ended"]
        if links.get("worker_push_cv") is not None:
            sat = links["server_ingress_saturated_fraction"]
            egress = links["server_egress_utilisation_while_ingress_saturated"]
            log(f"      links: server ingress saturated {100 * sat:.0f}% of the time, egress meanwhile at "
                f"{100 * egress:.0f}%; workers' push rates CV {links['worker_push_cv']:.2f}, persisting "
                f"~{links['share_period_s'] or 0:.1f} s")
    counters1 = [nl.link_counters(i, args.prefix) for i in range(hosts)]
    tx = [c1["tx_bytes"] - c0["tx_bytes"] for c0, c1 in zip(counters0, counters1)]
    rx = [c1["rx_bytes"] - c0["rx_bytes"] for c0, c1 in zip(counters0, counters1)]
    cpu = sum(r.get("cpu_s", 0.0) for r in rankinfo)
    info = {"model": job.model, "workers": W, "servers": S, "schedules": job.schedules, "rc": rc,
            "timed_out": timed_out.is_set(), "wall_s": wall, "estimate_s": job.estimate_s,
            "loadavg_before": load0, "loadavg_after": loadavg(), "veth_tx_bytes": tx, "veth_rx_bytes": rx,
            "rank_cpu_s": cpu, "cpu_utilisation": cpu / (wall * (os.cpu_count() or 1)) if wall > 0 else None,
            "max_rss_mb": max((r.get("maxrss_mb", 0.0) for r in rankinfo), default=None),
            "estimated_peak_ram_gb": need / 1e9, "shared_params": bool(args.share_params),
            "rankinfo": rankinfo, "links": links, "log": str(log_dir / f"{tag}.stderr")}
    for r in results:
        r.pop("_ended", None)
    missing = [s for s in job.schedules if s not in {r["schedule"] for r in results}]
    if rc != 0 or missing:
        tail = (log_dir / f"{tag}.stderr").read_text()[-3000:]
        log(f"   !! launch {tag} exit code {rc}{' (timed out)' if timed_out.is_set() else ''}; "
            f"missing {missing}; stderr tail:\n{tail}")
        info["missing"] = missing
    return {"results": results, "info": info}
