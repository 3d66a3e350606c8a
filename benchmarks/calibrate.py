"""PS communication table for several worker and server counts on this machine, with a plot.

    python benchmarks/calibrate.py [--workers 1,2,4,8] [--servers 1,2] [--max-bytes 64MiB]
                                   [--budget-s S] [--out-dir benchmarks/results] [--timeout 900]

For every (W, S) it launches ``mpiexec -n W+S python -m imerge_hooks.plan.calibrate --out <tmp json>``
(mpiexec next to ``sys.executable``, env ``IMERGE_NUM_SERVERS=S``, ``OMP_NUM_THREADS=1``) and
loads the ``PSModel`` it writes: for each message size m on the calibration grid (1 KiB, 4 KiB,
... up to ``--max-bytes``), the time T(m) of one push + pull of m bytes by every worker at once
(slowest worker's median), and the fit ``T(m) = a + W*m/(S*B)``. ``--budget-s`` stops each run as
the start-up calibration does (``imerge_hooks.plan.calibrate.STARTUP_BUDGET_S``): the sizes it did
not measure are extended along the measured bandwidth, marked ``+`` in the table and
``"measured": false`` in the JSON.

It prints one table (workers, servers, message size, measured time, fitted time), one summary
line per (W, S) with a (us) and B (MB/s per server), and saves ``calibrate.json`` (rows, fitted
parameters, machine info) and ``calibrate.png`` (log-log time against message size, one subplot
per S, one colour per W: markers = measured, dashed = fit) under ``--out-dir``.

All W+S ranks run on this one machine: when W+S exceeds its cores they oversubscribe them, so
those numbers include CPU contention (and IMerge's polling back-off sleeps), not just copying.

A (W, S) run that fails or times out is reported (exit code, stderr tail) and recorded in the
JSON under ``failures``; the others still run, and the script then exits with status 1. When
the run wrote its model before failing (e.g. it crashed on the way out), its rows are kept,
marked ``*`` in the table and ``"clean_exit": false`` in the JSON.

The library is measured as installed: nothing here patches it.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # run as a script
    sys.path.insert(0, str(REPO))

from benchmarks.jobs import run_job  # noqa: E402
from benchmarks.machine import machine_info, mpiexec_path  # noqa: E402

DEFAULT_OUT_DIR = REPO / "benchmarks" / "results"

_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mb": 1 << 20,
          "mib": 1 << 20, "g": 1 << 30, "gb": 1 << 30, "gib": 1 << 30}


def parse_size(text: str) -> int:
    """``65536``, ``64KiB``, ``64MiB``, ``1g`` -> bytes (binary units)."""
    s = text.strip().lower().replace(" ", "")
    num = s.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = s[len(num):]
    if not num or unit not in _UNITS:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (use e.g. 65536, 64KiB, 64MiB)")
    try:
        value = float(num) * _UNITS[unit]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"size must be >= 1 byte, got {text!r}")
    return int(value)


def parse_counts(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a comma-separated list of integers, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return sorted(set(values))


def human_size(nbytes: float) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            value = nbytes / scale
            return f"{value:.0f} {unit}" if value == int(value) else f"{value:.1f} {unit}"
    return f"{int(nbytes)} B"


def human_time(us: float) -> str:
    """A time in microseconds as a short axis label: 300 us, 4 ms, 1.5 s."""
    if us >= 1e6:
        return f"{us / 1e6:g} s"
    if us >= 1e3:
        return f"{us / 1e3:g} ms"
    return f"{us:g} us"


# ---------------------------------------------------------------------- one (W, S) run
def run_one(workers: int, servers: int, max_bytes: int, timeout: float, tmpdir: str,
            budget_s: float | None = None) -> dict:
    """Run the calibration for one (W, S); returns a dict with ``ok`` and the model or the failure."""
    out = os.path.join(tmpdir, f"psmodel-{workers}w-{servers}s.json")
    env = dict(os.environ)
    env.update({"IMERGE_NUM_SERVERS": str(servers), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"})
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    cmd = [mpiexec_path(), "-n", str(workers + servers), sys.executable, "-m", "imerge_hooks.plan.calibrate",
           "--out", out, "--max-bytes", str(max_bytes)] + ([] if budget_s is None else ["--budget-s", str(budget_s)])
    job = run_job(cmd, env, timeout)
    timed_out = job["timed_out"]
    result = {"workers": workers, "servers": servers, "cmd": " ".join(cmd), "wall_s": job["wall_s"],
              "returncode": job["returncode"], "timed_out": timed_out, "stdout": job["stdout"],
              "stderr": job["stderr"], "model": None, "model_error": None}
    if os.path.exists(out):
        from imerge_hooks.internals import PSModel

        try:
            result["model"] = PSModel.from_json(out)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            result["model_error"] = f"unreadable model JSON {out}: {exc}"
    clean_exit = not timed_out and job["returncode"] == 0
    result["ok"] = clean_exit and result["model"] is not None
    if result["ok"]:
        result["reason"] = None
    else:
        why = (f"timed out after {timeout:.0f} s" if timed_out else
               f"exit code {job['returncode']}" if job["returncode"] != 0 else "exit code 0")
        if result["model"] is not None:
            why += " after the model was written (rows kept; the failure is in the exit path)"
        else:
            why += f", {result['model_error'] or 'no model written'}"
        result["reason"] = why
    return result


def fitted_time(model, nbytes: float) -> float:
    """The fit alone, ``a + W*m/(S*B)`` (not the table interpolation of ``PSModel.time``)."""
    return model.a + model.workers * float(nbytes) / (model.servers * model.bandwidth)


def model_rows(model) -> list[dict]:
    return [{"workers": model.workers, "servers": model.servers, "bytes": int(m), "size": human_size(m),
             "time_s": float(t), "fit_s": fitted_time(model, m), "measured": i < model.measured}
            for i, (m, t) in enumerate(zip(model.sizes, model.times))]


# ---------------------------------------------------------------------- output
def oversubscription_note(nproc: int | None, configs: list[tuple[int, int]]) -> str:
    over = [f"W={w},S={s}" for w, s in configs if nproc and w + s > nproc]
    text = (f"NOTE: all W+S ranks run on this one machine with {nproc} CPU core(s). "
            f"Runs with W+S > {nproc} oversubscribe the cores")
    if over:
        text += f" (here: {', '.join(over)})"
    return text + ("; their times include CPU contention between ranks (and IMerge's polling back-off "
                   "sleeps), so large-W numbers overstate what W workers on W machines would see.")


def format_table(rows: list[dict]) -> str:
    head = f"{'workers':>7} {'servers':>7} {'size':>9} {'bytes':>10} {'time_us':>12} {'fit_us':>12}"
    lines = [head, "-" * len(head)]
    last = None
    for r in rows:
        if last is not None and (r["workers"], r["servers"]) != last:
            lines.append("")
        last = (r["workers"], r["servers"])
        mark = ("" if r.get("clean_exit", True) else " *") + ("" if r.get("measured", True) else " +")
        lines.append(f"{r['workers']:>7} {r['servers']:>7} {r['size']:>9} {r['bytes']:>10} "
                     f"{r['time_s'] * 1e6:>12.1f} {r['fit_s'] * 1e6:>12.1f}{mark}")
    if any(not r.get("clean_exit", True) for r in rows):
        lines += ["", "* measured and written, but the run then failed (see below)"]
    if any(not r.get("measured", True) for r in rows):
        lines += ["", "+ not measured (--budget-s): extended along the measured bandwidth"]
    return "\n".join(lines)


def format_summary(model, wall_s: float) -> str:
    total = f" ({model.servers * model.bandwidth / 1e6:.1f} MB/s over all servers)" if model.servers > 1 else ""
    return (f"W={model.workers} S={model.servers}: a = {model.a * 1e6:.1f} us, "
            f"B = {model.bandwidth / 1e6:.1f} MB/s per server{total}; run took {wall_s:.1f} s")


def plot(models: list, servers: list[int], workers: list[int], nproc: int | None, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    from matplotlib.lines import Line2D
    from matplotlib.ticker import FuncFormatter, NullFormatter

    cmap = plt.get_cmap("tab10")
    colour = {w: cmap(i % 10) for i, w in enumerate(workers)}
    fig, axes = plt.subplots(1, len(servers), figsize=(6.2 * len(servers), 5.0), sharey=True, squeeze=False)
    for ax, s in zip(axes[0], servers):
        for model in sorted((m for m in models if m.servers == s), key=lambda m: m.workers):
            c = colour[model.workers]
            x = np.asarray(model.sizes, dtype=float)
            y = np.asarray(model.times, dtype=float) * 1e6
            ax.plot(x, y, "o-", color=c, lw=1.2, ms=5,
                    label=f"W={model.workers}: a={model.a * 1e6:.0f} us, B={model.bandwidth / 1e6:.0f} MB/s")
            xf = np.logspace(np.log10(x[0]), np.log10(x[-1]), 200)
            ax.plot(xf, (model.a + model.workers * xf / (model.servers * model.bandwidth)) * 1e6,
                    "--", color=c, lw=1.2, alpha=0.9)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("message size per worker (bytes)")
        ax.set_title(f"S = {s} server{'s' if s > 1 else ''}")
        ax.grid(True, which="major", alpha=0.35)
        ax.grid(True, which="minor", alpha=0.12)
        ticks = [2 ** k for k in range(10, 31, 2)]
        lo, hi = ax.get_xlim()
        ax.set_xticks([t for t in ticks if lo <= t <= hi])
        ax.set_xticklabels([human_size(t).replace(" ", "") for t in ax.get_xticks()])
        handles, _ = ax.get_legend_handles_labels()
        if handles:
            handles = handles + [Line2D([], [], color="grey", ls="--", label="fit a + W·m/(S·B)")]
            ax.legend(handles=handles, fontsize=8, loc="upper left")
        else:
            ax.text(0.5, 0.5, "no successful run", transform=ax.transAxes, ha="center")
    axes[0][0].set_ylabel("time of one push + pull, slowest worker")
    fmt = FuncFormatter(lambda v, _: human_time(v))
    ax0 = axes[0][0]
    ax0.yaxis.set_major_formatter(fmt)
    lo, hi = ax0.get_ylim()
    # Minor labels (2x, 3x, ...) only when the axis spans little more than a decade; else they crowd.
    ax0.yaxis.set_minor_formatter(fmt if hi / lo < 12 else NullFormatter())
    fig.suptitle(f"IMerge PS communication time on {socket.gethostname()} ({nproc} cores)\n"
                 f"points: measured, dashed: fit; runs with W+S > {nproc} ranks oversubscribe the cores",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---------------------------------------------------------------------- driver
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=parse_counts, default=[1, 2, 4, 8], help="e.g. 1,2,4,8")
    parser.add_argument("--servers", type=parse_counts, default=[1, 2], help="e.g. 1,2")
    parser.add_argument("--max-bytes", type=parse_size, default=64 << 20,
                        help="largest message on the grid 1KiB*4^i (default 64MiB)")
    parser.add_argument("--out-dir", type=Path, default=DEFAULT_OUT_DIR)
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per (W, S) run (default 900)")
    parser.add_argument("--budget-s", type=float, default=None,
                        help="stop each run as the start-up calibration does (default: the whole grid)")
    args = parser.parse_args(argv)
    if args.max_bytes < 1024:
        parser.error("--max-bytes must be at least 1024 (the calibration grid starts at 1 KiB)")

    info = machine_info()
    configs = [(w, s) for s in args.servers for w in args.workers]
    note = oversubscription_note(info["nproc"], configs)
    print(f"IMerge PS calibration on {info['hostname']}: {info['nproc']} cores, MPICH {info['mpich_version']}, "
          f"W in {args.workers}, S in {args.servers}, grid 1 KiB .. {human_size(args.max_bytes)}", flush=True)
    print(note, flush=True)

    total_start = time.perf_counter()
    results = []
    with tempfile.TemporaryDirectory(prefix="imerge-calib-") as tmpdir:
        for w, s in configs:
            print(f"  running W={w} S={s} ({w + s} ranks) ...", end=" ", flush=True)
            res = run_one(w, s, args.max_bytes, args.timeout, tmpdir, args.budget_s)
            results.append(res)
            print(f"{'ok' if res['ok'] else 'FAILED: ' + res['reason']} ({res['wall_s']:.1f} s)", flush=True)
            if not res["ok"]:
                print("    stderr: " + (res["stderr"].strip().splitlines() or ["(empty)"])[0], flush=True)
    total_wall = time.perf_counter() - total_start
    try:
        with open("/proc/loadavg") as fh:
            info["loadavg_at_end"] = fh.read().split()[:3]
    except OSError:
        info["loadavg_at_end"] = None

    ok = [r for r in results if r["model"] is not None]  # measured, possibly with a failure after that
    failed = [r for r in results if not r["ok"]]
    rows = [dict(row, clean_exit=r["ok"]) for r in ok for row in model_rows(r["model"])]
    print()
    print(format_table(rows) if rows else "(no successful run)")
    print()
    for r in ok:
        print(format_summary(r["model"], r["wall_s"]) + ("" if r["ok"] else "  [run then FAILED: see below]"))
    for r in failed:
        print(f"W={r['workers']} S={r['servers']}: FAILED: {r['reason']}\n  command: {r['cmd']}")
        print("--- stderr (tail) ---\n" + (r["stderr"][-4000:].rstrip() or "(empty)"))
        print("--- stdout (tail) ---\n" + (r["stdout"][-2000:].rstrip() or "(empty)"))
    print()
    print(note)
    print(f"total wall time {total_wall:.1f} s")

    args.out_dir.mkdir(parents=True, exist_ok=True)
    json_path = args.out_dir / "calibrate.json"
    png_path = args.out_dir / "calibrate.png"
    payload = {
        "description": "IMerge PS cost-model calibration: time of one push + pull of m bytes by every worker "
                       "at once (slowest worker's median), fit T(m) = a + W*m/(S*B)",
        "note": note,
        "machine": info,
        "args": {"workers": args.workers, "servers": args.servers, "max_bytes": args.max_bytes,
                 "timeout_s": args.timeout, "budget_s": args.budget_s},
        "total_wall_s": total_wall,
        "fits": [{"workers": r["model"].workers, "servers": r["model"].servers, "a_s": r["model"].a,
                  "bandwidth_Bps_per_server": r["model"].bandwidth, "hosts": r["model"].hosts,
                  "measured_points": r["model"].measured, "wall_s": r["wall_s"], "clean_exit": r["ok"]}
                 for r in ok],
        "rows": rows,
        "failures": [{"workers": r["workers"], "servers": r["servers"], "reason": r["reason"],
                      "model_salvaged": r["model"] is not None,
                      "returncode": r["returncode"], "timed_out": r["timed_out"], "wall_s": r["wall_s"],
                      "cmd": r["cmd"], "stderr_tail": r["stderr"][-8000:], "stdout_tail": r["stdout"][-4000:]}
                     for r in failed],
    }
    with open(json_path, "w") as fh:
        json.dump(payload, fh, indent=1)
    plot([r["model"] for r in ok], args.servers, args.workers, info["nproc"], png_path)
    print(f"saved {json_path} and {png_path}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
