"""The transport check: IMerge's push-pull round trip (1 worker, 1 server) against a raw mpi4py
ping-pong over the same MPI, per message size.

    mpiexec -n 2 imerge-transport-check [--min 4KiB] [--max 64MiB] [--iters N] [--sweeps 3] [--json out.json]

(also ``python -m imerge_hooks.tools.transport_check``). Run it with the MPI, hosts and transport
variables training will use: a ratio far below 1 at large sizes means IMerge, not the network,
limits a push; the raw column is what the MPI itself moves.

Rank 0 is the worker, rank 1 the server (``init(num_servers=1, serve="stage")``, so the server
rank comes back from ``init`` and can take part in the raw phase). For every message size m
(4 KiB, 16 KiB, ... up to ``--max``) and in every sweep, both phases run back to back:

A. raw: on a duplicate of COMM_WORLD the worker ``Send``s m bytes, the server ``Recv``s them
   and ``Send``s m bytes back, the worker ``Recv``s them (numpy buffers, blocking calls). That
   is the byte pattern of one push + one pull with nothing else around it.
B. IMerge: a ``GradientEngine`` (schedule ``wfbp``) over one float32 parameter of m/4
   elements, i.e. one key; each round calls the engine's gradient hook (``_on_grad``, as
   autograd would) and ``synchronize()``: comm thread Irecv/Isend, the server's probe loop,
   receive and result send, the worker's unpack (average) into ``.grad``.

The time of a round is measured on the worker; a phase reports the median round after
warm-up. Each size takes the best median over ``--sweeps`` sweeps, for each phase separately
(the machine is noisy; drift hits both phases alike because they run back to back).
Bandwidth is 2*m / time (push + pull bytes). The server serves phase B as one "stage"
(``stages.serve_stage()``) per size and sweep; the worker tells it what comes next over the
raw communicator.

The library is measured as installed: nothing here patches it.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from datetime import datetime, timezone

import numpy as np
import torch

from .. import __version__
from ..cluster import session, startup
from ..core._mpi import MPI, ensure_initialized
from ..server import stages
from ..worker.engine import GradientEngine

WORKER, SERVER = 0, 1
RAW_TAG = 7
TARGET_RATIO = 0.8
TARGET_FROM = 1 << 20

_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mb": 1 << 20,
          "mib": 1 << 20, "g": 1 << 30, "gb": 1 << 30, "gib": 1 << 30}


def parse_size(text: str) -> int:
    """'4KiB', '64MiB', '1M', '4096' -> bytes (binary units)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (use e.g. 4KiB, 1MiB, 64MiB)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def fmt_size(nbytes: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale} {unit}"
    return f"{nbytes} B"


def sizes_between(lo: int, hi: int) -> list[int]:
    """lo, 4*lo, 16*lo, ... up to hi (4 KiB .. 64 MiB: 8 sizes)."""
    out, m = [], lo
    while m <= hi:
        out.append(m)
        m *= 4
    return out


def auto_iters(nbytes: int) -> int:
    """Timed rounds per phase when --iters is not given: ~256 MiB per direction, 10..200."""
    return max(10, min(200, (256 << 20) // nbytes))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--min", type=parse_size, default=parse_size("4KiB"), help="smallest message (default 4KiB)")
    ap.add_argument("--max", type=parse_size, default=parse_size("64MiB"), help="largest message (default 64MiB)")
    ap.add_argument("--iters", type=int, default=0,
                    help="timed rounds per phase and size (default: by size, 200 for small .. 10 for 64MiB)")
    ap.add_argument("--warmup", type=int, default=0, help="untimed rounds per phase (default: max(2, iters/10))")
    ap.add_argument("--sweeps", type=int, default=3, help="repeat the whole size sweep this often (default 3)")
    ap.add_argument("--json", default=None, help="also save the results as JSON here")
    args = ap.parse_args(argv)
    if args.min < 4 or args.min % 4 or args.max < args.min:
        ap.error("--min must be a positive multiple of 4 bytes and --max >= --min")
    if args.iters < 0 or args.warmup < 0 or args.sweeps < 1:
        ap.error("--iters and --warmup must be >= 0, --sweeps >= 1")
    return args


def plan(args: argparse.Namespace) -> list[tuple[int, int, int, int]]:
    """(sweep, size, iters, warmup) in run order; identical on both ranks."""
    steps = []
    for sweep in range(args.sweeps):
        for m in sizes_between(args.min, args.max):
            iters = args.iters or auto_iters(m)
            warmup = args.warmup or max(2, iters // 10)
            steps.append((sweep, m, iters, warmup))
    return steps


# ---------------------------------------------------------------------- phase A: raw ping-pong
def raw_worker(comm: MPI.Comm, nbytes: int, iters: int, warmup: int) -> list[float]:
    out = np.ones(nbytes, dtype=np.uint8)
    back = np.ones(nbytes, dtype=np.uint8)
    times = []
    for i in range(warmup + iters):
        t0 = time.perf_counter()
        comm.Send([out, MPI.BYTE], dest=SERVER, tag=RAW_TAG)
        comm.Recv([back, MPI.BYTE], source=SERVER, tag=RAW_TAG)
        t1 = time.perf_counter()
        if i >= warmup:
            times.append(t1 - t0)
    return times


def raw_server(comm: MPI.Comm, nbytes: int, rounds: int) -> None:
    buf = np.ones(nbytes, dtype=np.uint8)
    for _ in range(rounds):
        comm.Recv([buf, MPI.BYTE], source=WORKER, tag=RAW_TAG)
        comm.Send([buf, MPI.BYTE], dest=WORKER, tag=RAW_TAG)


# ---------------------------------------------------------------------- phase B: IMerge
class EngineCase:
    """One engine with one float32 parameter of ``nbytes`` (one key), kept across sweeps."""

    def __init__(self, nbytes: int, config) -> None:
        self.param = torch.nn.Parameter(torch.zeros(nbytes // 4, dtype=torch.float32))
        self.engine = GradientEngine([(f"t{nbytes}", self.param)], config)
        group = self.engine.groups[0]
        expected = nbytes + 8  # + the tensor's presence flag (engine.had_gradient) and the training flag, float32
        if len(self.engine.groups) != 1 or len(group.keys) != 1 or group.keys[0].nbytes != expected:
            raise RuntimeError(f"expected one key of {expected} bytes, got {[k.nbytes for k in group.keys]}")
        # .grad is the engine's own buffer view, so the hook does not copy (as after the first step).
        self.param.grad = self.engine.views[0]
        self.param.grad.fill_(1.0)

    def round(self) -> None:
        self.engine.gradient_ready(0)  # what the grad hook does once .grad is in the engine's buffer
        self.engine.synchronize()

    def run(self, iters: int, warmup: int) -> list[float]:
        times = []
        for i in range(warmup + iters):
            t0 = time.perf_counter()
            self.round()
            t1 = time.perf_counter()
            if i >= warmup:
                times.append(t1 - t0)
        if not bool((self.param.grad == 1.0).all()):
            raise RuntimeError(f"IMerge round trip of {self.param.numel() * 4} bytes returned wrong values")
        return times


# ---------------------------------------------------------------------- driver
def summarize(times: list[float]) -> dict:
    return {"median_s": statistics.median(times), "min_s": min(times), "mean_s": statistics.fmean(times),
            "max_s": max(times), "n": len(times)}


def loadavg() -> list[float] | None:
    try:
        return list(os.getloadavg())
    except OSError:  # not available on this platform
        return None


def machine_info(extra: Callable[[], dict] | None = None) -> dict:
    """The host, its cores and the versions; from inside the job, the MPI library it runs. ``extra()``
    adds a caller's own record (the benchmark lab's)."""
    lib = MPI.Get_library_version()
    import mpi4py

    return {**(extra() if extra else {}), "host": platform.node(), "platform": platform.platform(),
            "cpus": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__,
            "torch_threads": torch.get_num_threads(), "numpy": np.__version__,
            "mpi4py": mpi4py.__version__, "mpi_library": lib.strip().splitlines()[0] if lib.strip() else "",
            "mpi_version": "{}.{}".format(*MPI.Get_version()), "mpi_thread_level": MPI.Query_thread(),
            "imerge": __version__}


def build_rows(results: dict, sizes: list[int]) -> list[dict]:
    rows = []
    for m in sizes:
        raw = min(s["median_s"] for s in results[m]["raw"])
        imm = min(s["median_s"] for s in results[m]["imerge"])
        raw_bw, im_bw = 2 * m / raw / 1e9, 2 * m / imm / 1e9
        rows.append({"bytes": m, "size": fmt_size(m), "raw_us": raw * 1e6, "raw_GBps": raw_bw,
                     "imerge_us": imm * 1e6, "imerge_GBps": im_bw, "ratio": im_bw / raw_bw,
                     "raw_sweep_medians_us": [s["median_s"] * 1e6 for s in results[m]["raw"]],
                     "imerge_sweep_medians_us": [s["median_s"] * 1e6 for s in results[m]["imerge"]],
                     "raw_sweeps": results[m]["raw"], "imerge_sweeps": results[m]["imerge"]})
    return rows


def print_table(rows: list[dict]) -> None:
    head = f"{'size':>8} {'raw us':>11} {'raw GB/s':>9} {'imerge us':>11} {'imerge GB/s':>11} {'ratio':>6}"
    print(head)
    print("-" * len(head))
    for r in rows:
        flag = " <" if r["bytes"] >= TARGET_FROM and r["ratio"] < TARGET_RATIO else ""
        print(f"{r['size']:>8} {r['raw_us']:>11.1f} {r['raw_GBps']:>9.3f} {r['imerge_us']:>11.1f} "
              f"{r['imerge_GBps']:>11.3f} {r['ratio']:>6.2f}{flag}")
    big = [r for r in rows if r["bytes"] >= TARGET_FROM]
    if big:
        worst = min(r["ratio"] for r in big)
        verdict = "met" if worst >= TARGET_RATIO else "NOT met"
        print(f"target ratio >= {TARGET_RATIO} from {fmt_size(TARGET_FROM)} up: {verdict} (worst {worst:.2f})")
    print("(time per push+pull round trip, best median over sweeps; GB/s = 2*size/time/1e9)")


def worker_main(args: argparse.Namespace, raw: MPI.Comm, extra_info: Callable[[], dict] | None = None) -> int:
    steps = plan(args)
    sizes = sizes_between(args.min, args.max)
    results = {m: {"raw": [], "imerge": []} for m in sizes}
    cases: dict[int, EngineCase] = {}
    info = machine_info(extra_info)
    started = time.time()
    for sweep, m, iters, warmup in steps:
        raw.send(("raw", m, iters, warmup), dest=SERVER, tag=RAW_TAG)
        results[m]["raw"].append(summarize(raw_worker(raw, m, iters, warmup)))
        # the server now serves IMerge until this stage ends
        if m not in cases:
            cases[m] = EngineCase(m, session.config())
        results[m]["imerge"].append(summarize(cases[m].run(iters, warmup)))
        stages.end_stage()
        raw_us, im_us = results[m]["raw"][-1]["median_s"] * 1e6, results[m]["imerge"][-1]["median_s"] * 1e6
        print(f"sweep {sweep + 1}/{args.sweeps} {fmt_size(m):>8}: raw {raw_us:10.1f} us  imerge {im_us:10.1f} us",
              file=sys.stderr, flush=True)
    raw.send(("done",), dest=SERVER, tag=RAW_TAG)
    rows = build_rows(results, sizes)
    print_table(rows)
    load_end = loadavg()
    if load_end and load_end[0] > (os.cpu_count() or 1):
        print(f"warning: 1-min load average {load_end[0]:.1f} on {os.cpu_count()} cores at the end: other processes "
              "competed for the CPUs (blocking MPI polls spin), the numbers are unreliable")
    out = {
        "benchmark": "transport", "description": __doc__.splitlines()[0],
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "duration_s": time.time() - started, "loadavg_at_end": load_end,
        "args": {"min": args.min, "max": args.max, "iters": args.iters, "warmup": args.warmup,
                 "sweeps": args.sweeps},
        "config": {"schedule": session.config().schedule, "num_servers": 1, "workers": 1},
        "target": {"ratio": TARGET_RATIO, "from_bytes": TARGET_FROM,
                   "met": all(r["ratio"] >= TARGET_RATIO for r in rows if r["bytes"] >= TARGET_FROM)},
        "machine": info, "rows": rows,
    }
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as fh:
            json.dump(out, fh, indent=1)
        print(f"saved {args.json}")
    for case in cases.values():
        case.engine.remove()
    startup.shutdown()
    return 0


def server_main(raw: MPI.Comm) -> int:
    while True:
        cmd = raw.recv(source=WORKER, tag=RAW_TAG)
        if cmd[0] == "done":
            break
        _, m, iters, warmup = cmd
        raw_server(raw, m, iters + warmup)
        if stages.serve_stage() == "shutdown":  # the worker died or ended early
            return 0
    stages.serve_stage()  # returns when the worker shuts down
    return 0


def main(argv: list[str] | None = None, extra_info: Callable[[], dict] | None = None) -> int:
    """``imerge-transport-check``; ``extra_info()`` adds to the machine record of the JSON."""
    args = parse_args(argv)
    ensure_initialized()  # MPI starts lazily (in init()); the rank count is checked first
    world = MPI.COMM_WORLD
    if world.Get_size() != 2:
        if world.Get_rank() == 0:
            print("imerge-transport-check needs exactly 2 ranks: mpiexec -n 2 imerge-transport-check", file=sys.stderr)
        return 2
    startup.init(num_servers=1, serve="stage", schedule="wfbp")
    raw = world.Dup()
    raw.Set_name("bench-raw")
    try:
        code = server_main(raw) if session.topology().is_server else worker_main(args, raw, extra_info)
    except BaseException:
        # the other rank may be blocked in the raw phase: take the whole job down, do not hang
        traceback.print_exc()
        sys.stderr.flush()
        world.Abort(1)
        raise
    raw.Free()
    return code


if __name__ == "__main__":
    sys.exit(main())
