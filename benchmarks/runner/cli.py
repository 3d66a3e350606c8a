"""The runner's command line (``benchmarks/run.py --help``)."""

from __future__ import annotations

import argparse
import os
import sys

from benchmarks.netlab import netlab as nl
from benchmarks.runner.grid import (
    DEFAULT_OUT,
    FUSION,
    MODELS,
    PEERS,
    PROFILES,
    RUN_ORDER,
    SCHEDULES,
    parse_list,
    servers_for,
)


def parse_args(argv: list[str] | None, description: str) -> argparse.Namespace:
    """The command line, checked, with what follows from it: lists parsed, every schedule to run in
    run order, the link rate in bytes/s, the time scale and why, the lab's TCP goodput."""
    ap = argparse.ArgumentParser(description=description,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--workers", default="2,4,8", help="measured W (emulated cluster)")
    ap.add_argument("--servers", default="W",
                    help="S: an int, or W (one server per worker) or W/2 (S grows with W, at least 1)")
    ap.add_argument("--bandwidth", default="1gbit", help="per-host link rate in each direction (tc syntax)")
    ap.add_argument("--mtu", type=int, default=9000,
                    help="the lab's MTU (9000: jumbo frames, as in a data centre; TCP goodput 0.993 of the link rate, "
                         "and the fabric probe reaches >= 95%% of the nominal rate, which it does not at 1500)")
    ap.add_argument("--time-scale", type=float, default=None, help="factor on the profiled compute times")
    ap.add_argument("--real-bandwidth", default="10gbit", help="link rate of the cluster being emulated")
    ap.add_argument("--speedup", type=float, default=10.0, help="its devices' speed over the CPU profile")
    ap.add_argument("--fusion-schedules", default=",".join(FUSION))
    ap.add_argument("--schedules", default=",".join(PEERS + SCHEDULES),
                    help="table 2's columns: IMerge's schedules and the all-reduce peers " + ", ".join(PEERS))
    ap.add_argument("--iters", type=int, default=2, help="timed iterations per schedule (at least)")
    ap.add_argument("--min-timed-s", type=float, default=8.0,
                    help="raise the timed iterations of a launch until they take about this long (estimate)")
    ap.add_argument("--max-iters", type=int, default=8, help="cap for that")
    ap.add_argument("--warmup", type=int, default=1, help="untimed iterations (after profiling, for planned)")
    ap.add_argument("--profile-steps", type=int, default=2, help="profiled iterations of planned schedules")
    ap.add_argument("--sim-workers", default="4,8,16,32")
    ap.add_argument("--validate-workers", default="4,8")
    ap.add_argument("--sim-startup-us", type=float, default=None,
                    help="server startup per push for the simulator (default: calibrated a/W)")
    ap.add_argument("--no-measure", action="store_true",
                    help="no netlab, no root: the simulated tables, and with --resume the stored measured runs' "
                         "tables, validation and plots again")
    ap.add_argument("--timeline", nargs="?", const="auto", default=None, metavar="MODEL:W:SCHEDULE",
                    help="one extra measured launch with IMERGE_TIMELINE + the simulator's trace")
    ap.add_argument("--quick", action="store_true",
                    help="smoke run: alexnet, W=2, S=1, 10gbit, default+imerge (+adaptive-ps), 2 iterations")
    ap.add_argument("--out-dir", default=str(DEFAULT_OUT))
    ap.add_argument("--name", default=None, help="file stem (default bench, or quick)")
    ap.add_argument("--prefix", default=os.environ.get("NETLAB_PREFIX", "imlab"), help="netlab prefix")
    ap.add_argument("--job-timeout", type=float, default=None, help="seconds per launch (default from estimate)")
    ap.add_argument("--imerge-timeout", type=float, default=600.0, help="IMERGE_TIMEOUT_S of the ranks")
    ap.add_argument("--rank-env", action="append", default=[], metavar="IMERGE_X=VALUE",
                    help="extra IMERGE_* setting for every rank (repeatable), e.g. IMERGE_PARTITION_BYTES=1048576")
    ap.add_argument("--no-share-params", dest="share_params", action="store_false",
                    help="give every worker its own parameter memory (default: one shared mapping, saves RAM)")
    ap.add_argument("--max-load", type=float, default=None,
                    help="before each launch wait (up to 15 min) until the 1-min load average is below this")
    ap.add_argument("--isolate-above-mb", type=float, default=300.0,
                    help="models with more gradient MB than this run one schedule per launch (RAM)")
    ap.add_argument("--mem-wait", type=float, default=300.0, help="seconds to wait for free RAM before skipping")
    ap.add_argument("--mem-fraction", type=float, default=0.95,
                    help="run a launch only if its estimated peak RAM is below this fraction of MemAvailable "
                         "(ranks also set oom_score_adj=1000, so an OOM kills a benchmark rank first)")
    ap.add_argument("--resume", action="store_true", help="keep measured runs already in the JSON")
    ap.add_argument("--recalibrate", action="store_true", help="delete the cached PS models first")
    ap.add_argument("--no-plots", action="store_true")
    ap.add_argument("--alternate", default=None, metavar="FIELD=VALUE[,...]",
                    help="A/B inside each launch of a partitioned schedule: worker_replay alternates the engine's "
                         "SchedulePolicy with these fields every two timed iterations (e.g. "
                         "tail_credit_bytes=none); the JSON gets both series")
    ap.add_argument("--link-monitor", type=float, default=0.1, metavar="SECONDS",
                    help="sample the switch ports' byte counters this often during each launch (0: off); the "
                         "summary (utilisation, push-share dispersion) goes into the JSON, the samples next to "
                         "the logs")
    ap.add_argument("--share-cv", type=float, default=None,
                    help="uneven incast sharing for the simulator's validation when no launch at that W was "
                         "monitored (default: measured by the link monitor)")
    ap.add_argument("--share-period", type=float, default=1.0, help="seconds a share persists (with --share-cv)")
    ap.add_argument("--scale-check", default=None, metavar="MODEL:W:SCHEDULE",
                    help="after the launches, run this measured cell again at half the link rate and twice the "
                         "compute: a faithful emulator gives twice the iteration time (within 5%%)")
    ap.add_argument("--dry-run", action="store_true", help="list the launches with time and RAM estimates, run nothing")
    args = ap.parse_args(argv)
    given = {a.split("=")[0] for a in (argv if argv is not None else sys.argv[1:]) if a.startswith("--")}
    if args.quick:
        quick = {"--models": ("models", "alexnet"), "--workers": ("workers", "2"), "--servers": ("servers", 1),
                 "--bandwidth": ("bandwidth", "10gbit"), "--time-scale": ("time_scale", 1.0),
                 "--schedules": ("schedules", "default,imerge"), "--fusion-schedules": ("fusion_schedules", ""),
                 "--iters": ("iters", 2), "--profile-steps": ("profile_steps", 1),
                 "--sim-workers": ("sim_workers", "4,8"), "--validate-workers": ("validate_workers", "2"),
                 "--name": ("name", "quick")}
        for flag, (attr, value) in quick.items():
            if flag not in given:
                setattr(args, attr, value)
    args.name = args.name or "bench"
    rank_env = {}
    for item in args.rank_env:
        key, sep, value = item.partition("=")
        if not sep or not key.startswith("IMERGE_"):
            ap.error(f"--rank-env wants IMERGE_NAME=VALUE, got {item!r}")
        rank_env[key] = value
    args.rank_env = rank_env
    args.models = parse_list(args.models)
    for m in args.models:
        if not (PROFILES / f"{m}-cpu.json").exists():
            ap.error(f"no profile benchmarks/profiles/{m}-cpu.json")
    args.workers = sorted(set(parse_list(args.workers, int)))
    args.sim_workers = sorted(set(parse_list(args.sim_workers, int)))
    args.validate_workers = sorted(set(parse_list(args.validate_workers, int)))
    args.fusion = parse_list(args.fusion_schedules)
    args.table2 = parse_list(args.schedules)
    from imerge_hooks import SCHEDULES as KNOWN

    for s in args.fusion + args.table2:
        if s not in KNOWN + PEERS:
            ap.error(f"unknown schedule {s!r} (known: {', '.join(PEERS + KNOWN)})")
    try:
        servers_for(args.servers, 2)
    except ValueError:
        ap.error(f"--servers wants an int, W or W/2, got {args.servers!r}")
    args.all_schedules = [s for s in RUN_ORDER if s in set(args.fusion) | set(args.table2)]
    args.all_schedules += [s for s in dict.fromkeys(args.table2 + args.fusion) if s not in args.all_schedules]
    args.bandwidth_Bps = nl.parse_rate(args.bandwidth) / 8.0
    if args.time_scale is None:
        args.time_scale = (nl.parse_rate(args.real_bandwidth) / nl.parse_rate(args.bandwidth)) / args.speedup
        args.time_scale_why = (f"time scale {args.time_scale:g} = ({args.real_bandwidth} / {args.bandwidth}) / "
                               f"speedup {args.speedup:g}: the emulation has the communication/computation "
                               f"ratio of a cluster with {args.real_bandwidth} links whose devices run the "
                               f"batch-{8} iteration {args.speedup:g}x faster than the profiled CPU")
    else:
        equiv = nl.parse_rate(args.real_bandwidth) / nl.parse_rate(args.bandwidth) / args.time_scale
        args.time_scale_why = (f"time scale {args.time_scale:g} (given): at {args.bandwidth} this is the "
                               f"communication/computation ratio of a cluster with {args.real_bandwidth} links "
                               f"whose devices are {equiv:g}x faster than the profiled CPU")
    if args.iters < 1 or args.warmup < 0 or args.profile_steps < 1:
        ap.error("--iters >= 1, --warmup >= 0, --profile-steps >= 1")
    args.goodput = nl.goodput(args.mtu)  # TCP payload per byte on the wire at the lab's MTU
    return args
