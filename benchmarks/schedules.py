"""Every IMerge schedule on ResNet-18 (synthetic images), side by side on this machine: samples/s.

    python benchmarks/schedules.py [--servers 1,2] [--rounds 3] [--schedules default,wfbp,...]
                                   [--image-size 64] [--batch-size 8] [--iters 8] [--warmup 6]
                                   [--timeout 300] [--out benchmarks/results/schedules.json]

For each S in ``--servers`` it launches, once per schedule and round,

    mpiexec -n 2+S python examples/resnet_synthetic.py --schedule X --image-size .. --batch-size ..
                                                       --warmup .. --iters ..

(mpiexec next to ``sys.executable``; env ``IMERGE_NUM_SERVERS=S``, ``OMP_NUM_THREADS=1``,
``IMERGE_COST_MODEL_PATH`` = a cache under ``--cache-dir``) and reads the ``RESULT {...}`` line
rank 0 prints (``samples_per_s``: timed iterations only; the example's planned schedules profile
and plan during the warm-up iterations). W = 2 workers throughout.

Side by side: the schedules of one round run back to back, and each round starts at a different
place in the schedule list (rotated), so slow drifts in machine load hit every schedule alike.
Each cell of the table is the median over rounds, with the min-max spread; the ratio column is
median(schedule) / median(default), with the spread of the per-round ratios (schedule / default
of the same round) in brackets.

The PS cost model (read by the planned schedules ``threshold``, ``mgwfbp``, ``adaptive-ps``,
``imerge``) is measured once per S before the rounds (``python -m imerge_hooks.plan.calibrate``) and cached under
``--cache-dir``; the runs then only read it. ``--recalibrate`` measures it again.

All ranks share one machine (shared-memory MPI): communication is a memory copy, so
overlapping or merging it gains little, and with more ranks than cores the ranks compete for
CPU. Expect small differences; this measures the library as installed (nothing is patched).

A run that fails (non-zero exit, no RESULT line) or hangs (killed after ``--timeout`` s) is
reported with its command and stderr, kept in the JSON under ``failures``, and the script
exits 1. A run that printed its RESULT and then exited non-zero is counted but marked ``*``.
Each run records the git HEAD and a hash of ``imerge_hooks/`` at launch (the package is installed
editable), and the notes warn when the library changed while the benchmark ran.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # run as a script
    sys.path.insert(0, str(REPO))

from benchmarks.calibrate import parse_counts  # noqa: E402
from benchmarks.jobs import run_job as launch  # noqa: E402
from benchmarks.machine import loadavg, machine_info, mpiexec_path  # noqa: E402

EXAMPLE = REPO / "examples" / "resnet_synthetic.py"
DEFAULT_OUT = REPO / "benchmarks" / "results" / "schedules.json"
DEFAULT_CACHE = REPO / "benchmarks" / "results" / "cache"
WORKERS = 2
# Same order as imerge_hooks.core.config.SCHEDULES; kept here so --help works without importing torch.
ALL_SCHEDULES = ("default", "wfbp", "priority", "threshold", "mgwfbp", "adaptive-ps", "imerge")
PLANNED = ("threshold", "mgwfbp", "adaptive-ps", "imerge")  # use the cost model
COST_MODEL_TEMPLATE = "schedules-psmodel-{workers}w-{servers}s-{hosts}.json"


# ---------------------------------------------------------------------- arguments
def parse_schedules(text: str) -> list[str]:
    names = [v.strip() for v in text.split(",") if v.strip()]
    if names == ["all"]:
        return list(ALL_SCHEDULES)
    bad = [n for n in names if n not in ALL_SCHEDULES]
    if not names or bad:
        raise argparse.ArgumentTypeError(f"unknown schedule(s) {bad or text!r}; choose from {', '.join(ALL_SCHEDULES)}"
                                         " or 'all'")
    out = []
    for n in names:  # keep the given order, drop duplicates
        if n not in out:
            out.append(n)
    return out


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


# ---------------------------------------------------------------------- environment
def cost_model_file(cache_dir: Path, servers: int) -> Path | None:
    """The file the library keeps for (W=2, S) in ``cache_dir``, if there is one (its name ends in a
    digest of the cluster, ``imerge_hooks.plan.calibrate.cache_path``; the library checks it on load)."""
    found = sorted(cache_dir.glob(COST_MODEL_TEMPLATE.format(workers=WORKERS, servers=servers, hosts="*")))
    return found[-1] if found else None


def library_digest() -> str:
    """sha1 over the library's source files now (the package is installed editable: edits apply at once)."""
    h = hashlib.sha1()
    for path in sorted((REPO / "imerge_hooks").rglob("*.py")):
        try:
            data = path.read_bytes()
        except OSError:
            continue
        h.update(str(path.relative_to(REPO)).encode() + b"\0" + data + b"\0")
    return h.hexdigest()[:12]


def git_head() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10,
                              cwd=str(REPO)).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def run_env(servers: int, cache_dir: Path, timeout: float) -> dict[str, str]:
    env = dict(os.environ)
    env.update({"IMERGE_NUM_SERVERS": str(servers), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
                "IMERGE_COST_MODEL_PATH": str(cache_dir / COST_MODEL_TEMPLATE)})
    # So that a hang ends in IMerge's own error (naming what it waits for) before we kill the job.
    env.setdefault("IMERGE_TIMEOUT_S", str(max(10.0, round(0.8 * timeout))))
    env.setdefault("IMERGE_STALL_WARNING_S", str(max(5.0, round(min(60.0, 0.3 * timeout)))))
    env.pop("IMERGE_SCHEDULE", None)  # the example passes --schedule; nothing else should decide it
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    return env


# ---------------------------------------------------------------------- calibration (once per S)
def calibrate(servers: int, cache_dir: Path, timeout: float, max_bytes: int | None, recalibrate: bool) -> dict:
    path = cost_model_file(cache_dir, servers)
    info = {"servers": servers, "workers": WORKERS, "path": str(path), "ran": False, "ok": True, "reason": None}
    if path is not None and not recalibrate:
        info["cached"] = True
        return info
    if path is not None:
        path.unlink()
    cache_dir.mkdir(parents=True, exist_ok=True)
    cmd = [mpiexec_path(), "-n", str(WORKERS + servers), sys.executable, "-m", "imerge_hooks.plan.calibrate"]
    if max_bytes:
        cmd += ["--max-bytes", str(max_bytes)]
    res = launch(cmd, run_env(servers, cache_dir, timeout), timeout)
    path = cost_model_file(cache_dir, servers)
    info.update(ran=True, cached=False, cmd=res["cmd"], returncode=res["returncode"], timed_out=res["timed_out"],
                wall_s=res["wall_s"], path=str(path))
    if res["timed_out"] or res["returncode"] != 0:
        why = f"timed out after {timeout:.0f} s" if res["timed_out"] else f"exit code {res['returncode']}"
        info["reason"] = why + (" after the model was written (kept)" if path is not None else ", no model written "
                                "(planned schedules will calibrate during their warm-up)")
        info["ok"] = False
        info["stderr_tail"] = res["stderr"][-4000:]
        info["stdout_tail"] = res["stdout"][-2000:]
    elif path is None:
        info.update(ok=False, reason=f"exit 0 but no model in {cache_dir}")
    return info


# ---------------------------------------------------------------------- one benchmark run
def parse_result(stdout: str) -> dict | None:
    result = None
    for line in stdout.splitlines():
        line = line.strip()
        if line.startswith("RESULT "):
            try:
                result = json.loads(line[len("RESULT "):])
            except ValueError:
                pass
    return result


def run_one(schedule: str, servers: int, rnd: int, args: argparse.Namespace) -> dict:
    cmd = [mpiexec_path(), "-n", str(WORKERS + servers), sys.executable, str(EXAMPLE), "--schedule", schedule,
           "--image-size", str(args.image_size), "--batch-size", str(args.batch_size),
           "--warmup", str(args.warmup), "--iters", str(args.iters), "--model", args.model]
    digest, head = library_digest(), git_head()
    res = launch(cmd, run_env(servers, args.cache_dir, args.timeout), args.timeout)
    parsed = parse_result(res["stdout"])
    rate = parsed.get("samples_per_s") if isinstance(parsed, dict) else None
    ok_rate = isinstance(rate, (int, float)) and rate > 0
    clean = not res["timed_out"] and res["returncode"] == 0
    run = {"schedule": schedule, "servers": servers, "workers": WORKERS, "round": rnd,
           "samples_per_s": float(rate) if ok_rate else None, "result": parsed, "clean_exit": clean,
           "ok": ok_rate, "cmd": res["cmd"], "returncode": res["returncode"], "timed_out": res["timed_out"],
           "wall_s": res["wall_s"], "loadavg_before": res["loadavg_before"], "imerge_src_sha1": digest,
           "git_head": head, "reason": None}
    if not (ok_rate and clean):
        why = (f"timed out after {args.timeout:.0f} s (job killed)" if res["timed_out"]
               else f"exit code {res['returncode']}")
        why += " after printing its RESULT" if ok_rate else ", no RESULT line"
        run["reason"] = why
        run["stderr_tail"] = res["stderr"][-8000:]
        run["stdout_tail"] = res["stdout"][-4000:]
    else:
        # keep warnings the library printed even on success (short)
        run["stderr_tail"] = res["stderr"][-2000:] if res["stderr"].strip() else ""
    return run


def rotated(items: list[str], rnd: int, rounds: int) -> list[str]:
    """Round ``rnd``'s order: the list rotated so each schedule runs early, midway and late."""
    n = len(items)
    shift = (rnd * max(1, -(-n // max(1, rounds)))) % n if n else 0
    return items[shift:] + items[:shift]


# ---------------------------------------------------------------------- summary
def summarise(runs: list[dict], schedules: list[str], servers: list[int]) -> dict:
    """Per (S, schedule): median / min / max samples/s and ratios to default (overall and per round)."""
    out: dict[str, dict[str, dict]] = {}
    for s in servers:
        cell: dict[str, dict] = {}
        by_round_default = {r["round"]: r["samples_per_s"] for r in runs
                            if r["servers"] == s and r["schedule"] == "default" and r["ok"]}
        for name in schedules:
            rates = [r["samples_per_s"] for r in runs if r["servers"] == s and r["schedule"] == name and r["ok"]]
            n_runs = sum(1 for r in runs if r["servers"] == s and r["schedule"] == name)
            entry = {"runs": n_runs, "ok_runs": len(rates),
                     "unclean_runs": sum(1 for r in runs if r["servers"] == s and r["schedule"] == name
                                         and r["ok"] and not r["clean_exit"]),
                     "median": statistics.median(rates) if rates else None,
                     "min": min(rates) if rates else None, "max": max(rates) if rates else None,
                     "samples_per_s": rates}
            paired = [r["samples_per_s"] / by_round_default[r["round"]] for r in runs
                      if r["servers"] == s and r["schedule"] == name and r["ok"] and r["round"] in by_round_default]
            entry["paired_ratios"] = paired
            entry["paired_ratio_median"] = statistics.median(paired) if paired else None
            entry["paired_ratio_min"] = min(paired) if paired else None
            entry["paired_ratio_max"] = max(paired) if paired else None
            cell[name] = entry
        base = cell.get("default", {}).get("median")
        for entry in cell.values():
            entry["ratio_to_default"] = entry["median"] / base if base and entry["median"] else None
        out[str(s)] = cell
    return out


def format_table(summary: dict, schedules: list[str], servers: list[int], rounds: int) -> str:
    def rate_cell(e: dict) -> str:
        if not e or e["median"] is None:
            return "FAILED"
        text = f"{e['median']:.2f} [{e['min']:.2f}-{e['max']:.2f}]"
        if e["ok_runs"] < rounds:
            text += f" ({e['ok_runs']}/{rounds})"
        if e["unclean_runs"]:
            text += " *"
        return text

    def ratio_cell(e: dict, name: str) -> str:
        if not e or e["ratio_to_default"] is None:
            return "-"
        if name == "default":
            return "1.00"
        if e["paired_ratios"]:
            return f"{e['ratio_to_default']:.2f} [{e['paired_ratio_min']:.2f}-{e['paired_ratio_max']:.2f}]"
        return f"{e['ratio_to_default']:.2f}"

    width_name = max(len("schedule"), *(len(n) for n in schedules))
    cols = []
    for s in servers:
        rates = [rate_cell(summary[str(s)].get(n, {})) for n in schedules]
        ratios = [ratio_cell(summary[str(s)].get(n, {}), n) for n in schedules]
        h1, h2 = f"S={s} samples/s [min-max]", f"S={s} ratio [per-round]"
        w1 = max(len(h1), *(len(x) for x in rates))
        w2 = max(len(h2), *(len(x) for x in ratios))
        cols.append((h1, w1, rates, h2, w2, ratios))
    head = f"{'schedule':<{width_name}}" + "".join(f" | {h1:>{w1}}  {h2:>{w2}}" for h1, w1, _, h2, w2, _ in cols)
    lines = [head, "-" * len(head)]
    for i, name in enumerate(schedules):
        lines.append(f"{name:<{width_name}}" + "".join(f" | {r[i]:>{w1}}  {q[i]:>{w2}}"
                                                       for _, w1, r, _, w2, q in cols))
    return "\n".join(lines)


# ---------------------------------------------------------------------- driver
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--servers", type=parse_counts, default=[1, 2], help="S values, e.g. 1,2 (W is 2)")
    parser.add_argument("--rounds", type=positive_int, default=3, help="rounds over all schedules (default 3)")
    parser.add_argument("--schedules", type=parse_schedules, default=list(ALL_SCHEDULES),
                        help="comma-separated (default: all); 'default' is added for the ratios")
    parser.add_argument("--image-size", type=positive_int, default=64)
    parser.add_argument("--batch-size", type=positive_int, default=8)
    parser.add_argument("--iters", type=positive_int, default=8, help="timed iterations per run (default 8)")
    parser.add_argument("--warmup", type=positive_int, default=6,
                        help="untimed iterations; planned schedules profile warmup-2 of them (default 6, min 3)")
    parser.add_argument("--model", default="resnet18", help="torchvision model name (default resnet18)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per run before it is killed (300)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="JSON path (a .txt table goes beside it)")
    parser.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE, help="PS cost model cache directory")
    parser.add_argument("--recalibrate", action="store_true", help="measure the cost model again")
    parser.add_argument("--calib-max-bytes", type=positive_int, default=None,
                        help="largest calibration message (default: the library's, 64 MiB)")
    args = parser.parse_args(argv)
    if args.warmup < 3:
        parser.error("--warmup must be >= 3 (the example profiles warmup-2 iterations and plans inside warm-up)")
    if args.timeout <= 0:
        parser.error("--timeout must be positive")
    schedules = args.schedules if "default" in args.schedules else ["default", *args.schedules]
    args.cache_dir = args.cache_dir.resolve()
    args.out = args.out.resolve()

    info = machine_info()
    n_runs = len(args.servers) * args.rounds * len(schedules)
    print(f"IMerge schedules on {info['hostname']}: {info['nproc']} cores, load {info['loadavg_at_start']}, "
          f"MPICH {info['mpich_version']}, torch {info['torch']}", flush=True)
    print(f"{args.model} {args.image_size}x{args.image_size}, batch {args.batch_size}/worker, warmup {args.warmup}, "
          f"timed {args.iters} iterations; W={WORKERS}, S in {args.servers}; {args.rounds} round(s) x "
          f"{len(schedules)} schedules = {n_runs} runs", flush=True)

    total_start = time.perf_counter()
    calibrations, runs = [], []
    done = 0
    for s in args.servers:
        if any(n in PLANNED for n in schedules):
            print(f"  cost model W={WORKERS} S={s} ...", end=" ", flush=True)
            cal = calibrate(s, args.cache_dir, args.timeout, args.calib_max_bytes, args.recalibrate)
            calibrations.append(cal)
            if not cal["ran"]:
                print(f"cached ({cal['path']})", flush=True)
            else:
                print(f"{'measured' if cal['ok'] else 'FAILED: ' + cal['reason']} ({cal['wall_s']:.1f} s)", flush=True)
        for rnd in range(args.rounds):
            for name in rotated(schedules, rnd, args.rounds):
                done += 1
                print(f"  [{done}/{n_runs}] S={s} round {rnd + 1}/{args.rounds} {name:<11} ...", end=" ", flush=True)
                run = run_one(name, s, rnd, args)
                runs.append(run)
                if run["ok"]:
                    print(f"{run['samples_per_s']:7.2f} samples/s  ({run['wall_s']:.1f} s, load "
                          f"{(run['loadavg_before'] or ['?'])[0]})" + ("" if run["clean_exit"] else
                                                                        f"  [then {run['reason']}]"), flush=True)
                else:
                    print(f"FAILED: {run['reason']} ({run['wall_s']:.1f} s)", flush=True)
                    last = (run["stderr_tail"].strip().splitlines() or ["(empty stderr)"])[-1]
                    print(f"      last stderr line: {last}", flush=True)
    total_wall = time.perf_counter() - total_start
    info["loadavg_at_end"] = loadavg()

    summary = summarise(runs, schedules, args.servers)
    table = format_table(summary, schedules, args.servers, args.rounds)
    problems = [r for r in runs if not (r["ok"] and r["clean_exit"])]
    failed_cal = [c for c in calibrations if not c["ok"]]
    notes = [
        f"W={WORKERS} workers + S servers, all on this machine ({info['nproc']} cores; shared-memory MPI, "
        f"OMP_NUM_THREADS=1); median over {args.rounds} round(s), [min-max] over rounds.",
        "ratio = median(schedule) / median(default); [per-round] = range of schedule/default within the same round.",
        "Communication here is a memory copy and ranks outnumber cores, so schedule differences are small and "
        "partly CPU contention; they do not predict a real network.",
    ]
    digests = list(dict.fromkeys(r["imerge_src_sha1"] for r in runs))
    if len(digests) > 1:
        notes.append(f"WARNING: imerge_hooks/ source changed during the benchmark ({len(digests)} versions, "
                     f"git HEADs {', '.join(dict.fromkeys(str(r['git_head']) for r in runs))}); runs are tagged "
                     "with imerge_src_sha1 in the JSON.")
    if any(e["unclean_runs"] for cell in summary.values() for e in cell.values()):
        notes.append("* some runs printed a RESULT and then exited non-zero (counted; see failures).")

    print()
    print(table)
    print()
    for n in notes:
        print(n)
    for c in failed_cal:
        print(f"\ncost model S={c['servers']}: FAILED: {c['reason']}\n  command: {c.get('cmd')}")
        print("--- stderr (tail) ---\n" + (c.get("stderr_tail", "").rstrip() or "(empty)"))
    for r in problems:
        print(f"\nS={r['servers']} round {r['round'] + 1} {r['schedule']}: FAILED: {r['reason']}")
        print(f"  command: {r['cmd']}")
        print("--- stderr (tail) ---\n" + (r["stderr_tail"][-4000:].rstrip() or "(empty)"))
        print("--- stdout (tail) ---\n" + (r["stdout_tail"][-1500:].rstrip() or "(empty)"))
    print(f"\ntotal wall time {total_wall:.1f} s")

    args.out.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        "description": "examples/resnet_synthetic.py samples/s per IMerge schedule, run side by side "
                       "(rotated order per round), W=2 workers, S servers, one machine",
        "command": shlex.join([sys.executable, *sys.argv]) if argv is None else
        shlex.join([sys.executable, str(Path(__file__).resolve()), *argv]),
        "args": {"servers": args.servers, "rounds": args.rounds, "schedules": schedules,
                 "image_size": args.image_size, "batch_size": args.batch_size, "iters": args.iters,
                 "warmup": args.warmup, "model": args.model, "timeout_s": args.timeout,
                 "cache_dir": str(args.cache_dir), "recalibrate": args.recalibrate,
                 "calib_max_bytes": args.calib_max_bytes, "workers": WORKERS},
        "machine": info,
        "notes": notes,
        "total_wall_s": total_wall,
        "calibrations": calibrations,
        "summary": summary,
        "table": table,
        "runs": runs,
        "failures": [{k: r.get(k) for k in ("schedule", "servers", "round", "reason", "returncode", "timed_out",
                                            "samples_per_s", "wall_s", "cmd", "stderr_tail", "stdout_tail")}
                     for r in problems],
    }
    with open(args.out, "w") as fh:
        json.dump(payload, fh, indent=1)
    txt = args.out.with_suffix(".txt")
    with open(txt, "w") as fh:
        fh.write(f"# {payload['command']}\n# {info['date']} {info['hostname']} ({info['nproc']} cores), "
                 f"load {info['loadavg_at_start']} -> {info['loadavg_at_end']}, wall {total_wall:.0f} s\n")
        fh.write(table + "\n\n" + "\n".join(notes) + "\n")
    print(f"saved {args.out} and {txt}")
    return 1 if problems or failed_cal else 0


if __name__ == "__main__":
    sys.exit(main())
