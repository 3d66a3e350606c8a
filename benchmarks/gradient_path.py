"""The library's per-step Python cost on the gradient path: one worker, one server, shared memory.

For a maintainer comparing the library before and after a refactor (run it on both, compare the
JSONs). It uses only the public API (``import imerge_hooks as imh``) and ``benchmarks.replay``, so
it keeps working when the library's internal modules move. Two measurements, in one launch:

1. **One gradient's path.** A model with exactly one parameter tensor (``nn.Linear(256, 256,
   bias=False)``) under ``DistributedOptimizer(SGD, schedule=--schedule)``; ``--warmup`` steps
   (default 20, past the default ``profile_steps`` of 10 and the plan installed after them), then
   ONE steady-state step (``zero_grad``, forward, ``.sum().backward()``, ``step``) traced with a
   profile function: every Python ``call`` event (generator resumptions included; C calls are not
   counted) whose code lives in the ``imerge_hooks`` package directory (any depth), per thread:
   the number of calls, the distinct files and the distinct functions (``file:qualname`` with
   call counts), in order of first call. The profile function is installed with
   ``threading.setprofile`` before ``imh.init()`` starts the comm thread ("imerge-comm"), a no-op
   until the traced step (it removes itself from its thread once tracing is over), and with
   ``sys.setprofile`` on the main thread for the traced step only. So that the count is one whole
   round and not timing-dependent leftovers: before the traced step the script sleeps ``--drain``
   seconds untraced (the previous round's result is in), and after ``step()`` returns the comm
   thread stays traced for ``--drain`` more seconds while the main thread sleeps (phase
   ``drain``: this step's push and pull finishing). The window thus holds the previous round's
   deferred update (applied in this forward under ``imerge``), this round's hook, submit, push,
   pull and completion. What varies between runs is how often the comm thread's loop polls while
   the server answers, so each thread's calls are also split into *rounds* (passes of its loop,
   found without any function name, see ``CallTracer``): the most common round (on the comm
   thread an idle poll: its size is the per-poll cost) and the calls outside those rounds (the
   round's own work, steady to within the loop's periodic 0.2 s checks).
2. **Per-step Python CPU on the ResNet-50 replay.** ``ReplayModel`` of
   ``benchmarks/profiles/<--model>-cpu.json`` (forward and backward *sleep* the profiled times
   times ``--time-scale``, default 0.05: no CPU), same schedule, ``--warmup`` steps, then
   ``--steps`` (default 30) timed steps; per step: the main thread's CPU seconds
   (``time.thread_time``), the comm thread's (its ``pthread_getcpuclockid`` clock) and the wall
   seconds (start of a step to the start of the next; the last one to its ``step()`` returning),
   each as median and mean. Thread CPU is not only Python: the main thread's includes autograd's
   gradient accumulation, ``zero_grad`` and the SGD update (O(bytes)), the comm thread's its
   copies and MPI calls; with one worker and one server on this machine the wall time includes
   the server's share of the cores. The profiler is gone from every thread by then.

    .venv/bin/python benchmarks/gradient_path.py [--out FILE] [--schedule imerge] [--steps 30]

runs itself under ``.venv/bin/mpiexec -n 2`` with ``IMERGE_NUM_SERVERS=1`` and
``OMP_NUM_THREADS=1`` (rank 1 is the server and never returns from ``imh.init()``), kills the
job's process group on ``--timeout`` or any error, prints a table and, with ``--out``, writes a
JSON (the command, versions, both measurements). ``--rank`` is the per-rank mode the driver
launches. Planned schedules cache their PS cost model and plans (``~/.cache/imerge``): the first
run on a machine also calibrates the 1-worker, 1-server model (a few seconds more).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shlex
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

RESULT_PREFIX = "GRADIENT_PATH_RESULT "
COMM_THREAD = "imerge-comm"


# ---------------------------------------------------------------------------------------------- tracing
class CallTracer:
    """A profile function counting Python calls into one package directory, per thread.

    Cheap while off (one attribute test per event); once ``finished`` is set it removes itself
    from each thread at that thread's next event.

    It also splits each thread's calls into *rounds* without knowing any function's name: a call
    is top-level when its caller is outside the package or is called from outside it (the comm
    thread's loop function, entered before tracing); a new round starts whenever the thread's
    first top-level function is called again. On the comm thread a round is one pass of its loop,
    so the most common round size is one idle poll while a server answers (how many there are
    depends on timing), and the calls outside those polls are the round's own work.
    """

    def __init__(self, package_dir: Path) -> None:
        self.prefix = str(package_dir.resolve()) + os.sep
        self.active = False
        self.finished = False
        self.phase = ""
        self.removed: list[str] = []  # threads the profile function left after tracing
        self._files: dict[str, str | None] = {}  # co_filename -> path relative to the package, None: outside
        self.threads: dict[int, dict] = {}  # thread ident -> {"name", "phases", "functions", "rounds", "first"}

    def _file(self, code) -> str | None:
        rel = self._files.get(code.co_filename, 0)
        if rel == 0:
            path = os.path.realpath(code.co_filename)
            rel = path[len(self.prefix):] if path.startswith(self.prefix) else None
            self._files[code.co_filename] = rel
        return rel

    def __call__(self, frame, event, arg) -> None:
        if not self.active:
            if self.finished:
                sys.setprofile(None)
                self.removed.append(threading.current_thread().name)
            return
        if event != "call":
            return
        code = frame.f_code
        rel = self._file(code)
        if rel is None:
            return
        ident = threading.get_ident()
        record = self.threads.get(ident)
        if record is None:
            record = self.threads[ident] = {"name": threading.current_thread().name, "phases": {}, "functions": {},
                                            "rounds": [0], "first": None}
        key = f"{rel}:{getattr(code, 'co_qualname', code.co_name)}"
        caller = frame.f_back
        if caller is None or self._file(caller.f_code) is None or caller.f_back is None \
                or self._file(caller.f_back.f_code) is None:  # top-level
            if record["first"] is None:
                record["first"] = key
            elif key == record["first"]:
                record["rounds"].append(0)
        record["rounds"][-1] += 1
        functions = record["functions"]
        functions[key] = functions.get(key, 0) + 1
        phases = record["phases"]
        phases[self.phase] = phases.get(self.phase, 0) + 1

    def report(self) -> list[dict]:
        """Per thread (main thread first, then in order of first call): calls, files, functions."""
        out = []
        for record in self.threads.values():
            functions = record["functions"]
            files: dict[str, int] = {}
            for key, n in functions.items():
                file = key.split(":", 1)[0]
                files[file] = files.get(file, 0) + n
            rounds = record["rounds"]
            size, count = max(collections.Counter(rounds).items(), key=lambda kv: (kv[1], -kv[0]))
            out.append({"thread": record["name"], "calls": sum(functions.values()),
                        "calls_by_phase": dict(record["phases"]), "rounds": len(rounds),
                        "most_common_round": {"calls": size, "rounds": count},
                        "calls_outside_most_common_rounds": sum(rounds) - size * count,
                        "round_sizes": rounds,
                        "files": [{"file": f, "calls": n} for f, n in files.items()],
                        "functions": [{"function": k, "calls": n} for k, n in functions.items()]})
        out.sort(key=lambda t: t["thread"] != "MainThread")
        return out


def train_step(opt, model, x) -> None:
    opt.zero_grad()
    model(x).sum().backward()
    opt.step()


def trace_one_gradient(imh, torch, tracer: CallTracer, args) -> dict:
    """Measurement 1: one parameter tensor, warm up, trace one step (+ drain on the comm thread)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(256, 256, bias=False)
    opt = imh.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                   named_parameters=model.named_parameters(), schedule=args.schedule)
    x = torch.randn(8, 256)
    for _ in range(args.warmup):
        train_step(opt, model, x)
    time.sleep(args.drain)  # the previous round's result is in before the traced step
    comm_seen = any(t.name == COMM_THREAD for t in threading.enumerate())
    tracer.phase = "step"
    tracer.active = True
    sys.setprofile(tracer)
    t0 = time.perf_counter()
    train_step(opt, model, x)
    step_s = time.perf_counter() - t0
    sys.setprofile(None)
    tracer.phase = "drain"  # the main thread is no longer traced; other threads still are
    time.sleep(args.drain)
    tracer.active = False
    tracer.finished = True
    threading.setprofile(None)
    opt.close()
    threads = tracer.report()
    return {"model": "nn.Linear(256, 256, bias=False)", "param_bytes": 256 * 256 * 4, "schedule": args.schedule,
            "warmup_steps": args.warmup, "drain_s": args.drain, "traced_step_wall_s": step_s,
            "comm_thread_running": comm_seen, "total_calls": sum(t["calls"] for t in threads),
            "threads": threads}


def _thread_cpu(thread: threading.Thread | None) -> float:
    if thread is None or thread.ident is None:
        return float("nan")
    try:
        return time.clock_gettime(time.pthread_getcpuclockid(thread.ident))
    except (OSError, ProcessLookupError):  # the thread ended
        return float("nan")


def _stats(values: list[float]) -> dict:
    return {"median": statistics.median(values), "mean": statistics.fmean(values), "min": min(values),
            "max": max(values), "per_step": values}


def time_replay(imh, torch, args) -> dict:
    """Measurement 2: CPU seconds per step of the main and comm threads on the replay model."""
    from benchmarks.replay import ReplayModel

    model = ReplayModel(args.model, time_scale=args.time_scale)
    params = list(model.parameters())
    opt = imh.DistributedOptimizer(torch.optim.SGD(params, lr=1e-6), named_parameters=model.named_parameters(),
                                   schedule=args.schedule)
    x = model.example_input()
    for _ in range(args.warmup):
        train_step(opt, model, x)
    comm = next((t for t in threading.enumerate() if t.name == COMM_THREAD), None)
    main_cpu, comm_cpu, wall = [], [], []
    t_prev, c_main, c_comm = time.perf_counter(), time.thread_time(), _thread_cpu(comm)
    for _ in range(args.steps):
        train_step(opt, model, x)
        t, m, c = time.perf_counter(), time.thread_time(), _thread_cpu(comm)
        wall.append(t - t_prev)
        main_cpu.append(m - c_main)
        comm_cpu.append(c - c_comm)
        t_prev, c_main, c_comm = t, m, c
    opt.close()
    return {"model": args.model, "profile": f"benchmarks/profiles/{args.model}-cpu.json",
            "time_scale": args.time_scale, "parameters": len(params),
            "param_bytes": sum(p.numel() * p.element_size() for p in params), "schedule": args.schedule,
            "warmup_steps": args.warmup, "steps": args.steps, "comm_thread_found": comm is not None,
            "main_cpu_s": _stats(main_cpu), "comm_cpu_s": _stats(comm_cpu), "wall_s": _stats(wall)}


def rank_main(args) -> None:
    """Every rank: the server serves inside ``imh.init()``; the worker measures and prints the result."""
    import torch

    import imerge_hooks as imh

    torch.set_num_threads(1)
    tracer = CallTracer(Path(imh.__file__).parent)
    # The last rank is the server (IMERGE_NUM_SERVERS=1): its threads are not traced. Any other
    # (or an unknown launcher): install before init() starts the comm thread.
    if os.environ.get("PMI_RANK", "0") == "0":
        threading.setprofile(tracer)
    imh.init()
    result = {"rank": imh.rank(), "workers": imh.size(), "torch": torch.__version__,
              "imerge_hooks": getattr(imh, "__version__", None), "python": sys.version.split()[0]}
    result["one_gradient"] = trace_one_gradient(imh, torch, tracer, args)
    result["replay"] = time_replay(imh, torch, args)
    result["profiler_removed_from"] = sorted(set(tracer.removed))
    if imh.rank() == 0:
        print(RESULT_PREFIX + json.dumps(result), flush=True)
    if hasattr(imh, "shutdown"):
        imh.shutdown()


# ---------------------------------------------------------------------------------------------- driver
def launch(argv: list[str], timeout: float) -> tuple[list[str], subprocess.CompletedProcess]:
    from benchmarks.machine import mpiexec_path

    cmd = [mpiexec_path(), "-n", "2", sys.executable, str(Path(__file__).resolve()), "--rank", *argv]
    env = dict(os.environ, OMP_NUM_THREADS="1", IMERGE_NUM_SERVERS="1", PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            cwd=str(REPO), start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except BaseException as exc:  # timeout, Ctrl-C, anything: the whole job goes (mpiexec leads its group)
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        out, err = proc.communicate()
        if isinstance(exc, subprocess.TimeoutExpired):
            sys.exit(f"gradient_path: timed out after {timeout:g} s; killed the job\n--- stdout ---\n{out[-4000:]}"
                     f"\n--- stderr ---\n{err[-4000:]}")
        raise
    return cmd, subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:8.3f}"


def summary(doc: dict, list_functions: bool) -> str:
    one, rep = doc["one_gradient"], doc["replay"]
    lines = [f"torch {doc['torch']}, imerge_hooks {doc['imerge_hooks']}, Python {doc['python']}, "
             f"{doc['workers']} worker + 1 server, schedule {one['schedule']}", "",
             f"1. One gradient's path: {one['model']} ({one['param_bytes'] // 1024} KiB), one step after "
             f"{one['warmup_steps']} warm-up steps, comm thread traced {one['drain_s']:g} s longer",
             f"   {'thread':<16}{'calls':>7}{'step':>7}{'drain':>7}{'files':>7}{'functions':>11}{'rounds':>8}"
             f"{'common round':>14}{'other calls':>13}"]
    for t in one["threads"]:
        phases, common = t["calls_by_phase"], t["most_common_round"]
        common_text = f"{common['rounds']} x {common['calls']}"
        lines.append(f"   {t['thread']:<16}{t['calls']:>7}{phases.get('step', 0):>7}{phases.get('drain', 0):>7}"
                     f"{len(t['files']):>7}{len(t['functions']):>11}{t['rounds']:>8}"
                     f"{common_text:>14}{t['calls_outside_most_common_rounds']:>13}")
    lines.append(f"   {'total':<16}{one['total_calls']:>7}")
    lines.append("   (rounds: passes of the thread's loop; common round: how many passes of the most common size x its "
                 "calls, on the comm thread the idle polls while the server answers; other calls: the rest, the "
                 "round's own work)")
    for t in one["threads"]:
        lines.append(f"   {t['thread']} files (calls): " + ", ".join(f"{f['file']} ({f['calls']})" for f in t["files"]))
        if list_functions:
            lines += [f"      {f['calls']:>4}  {f['function']}" for f in t["functions"]]
    lines += ["", f"2. Per step on the {rep['model']} replay ({rep['parameters']} tensors, "
              f"{rep['param_bytes'] / 2**20:.1f} MiB, time scale {rep['time_scale']:g}), {rep['steps']} steps after "
              f"{rep['warmup_steps']} warm-up steps",
              f"   {'ms per step':<22}{'median':>9}{'mean':>9}{'min':>9}{'max':>9}"]
    for label, key in (("main thread CPU", "main_cpu_s"), ("comm thread CPU", "comm_cpu_s"), ("wall", "wall_s")):
        s = rep[key]
        lines.append(f"   {label:<22}{_ms(s['median']):>9}{_ms(s['mean']):>9}{_ms(s['min']):>9}{_ms(s['max']):>9}")
    if not rep["comm_thread_found"]:
        lines.append(f"   (no thread named {COMM_THREAD!r} found: comm thread CPU is nan)")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="write the JSON here (default: none)")
    parser.add_argument("--schedule", default="imerge", help="the DistributedOptimizer schedule (default imerge)")
    parser.add_argument("--steps", type=int, default=30, help="timed steps of the replay (default 30)")
    parser.add_argument("--warmup", type=int, default=20, help="warm-up steps of each measurement (default 20)")
    parser.add_argument("--model", default="resnet50", help="replay profile of measurement 2 (default resnet50)")
    parser.add_argument("--time-scale", type=float, default=0.05, help="replay compute time scale (default 0.05)")
    parser.add_argument("--drain", type=float, default=0.2,
                        help="seconds the comm thread gets before and after the traced step (default 0.2)")
    parser.add_argument("--timeout", type=float, default=300, help="kill the launch after this many seconds")
    parser.add_argument("--list-functions", action="store_true", help="print every traced function")
    parser.add_argument("--rank", action="store_true", help=argparse.SUPPRESS)  # the per-rank mode
    args = parser.parse_args(argv)
    if args.steps < 1 or args.warmup < 0 or args.drain < 0:
        parser.error("--steps must be >= 1, --warmup and --drain >= 0")
    return args


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.rank:
        rank_main(args)
        return
    rank_argv = [a for a in argv if a != "--list-functions"]
    start = time.perf_counter()
    cmd, proc = launch(rank_argv, args.timeout)
    lines = [line for line in proc.stdout.splitlines() if line.startswith(RESULT_PREFIX)]
    if proc.returncode != 0 or not lines:
        sys.exit(f"gradient_path: mpiexec exited {proc.returncode}{'' if lines else ', no result'}\n"
                 f"--- stdout ---\n{proc.stdout[-4000:]}\n--- stderr ---\n{proc.stderr[-4000:]}")
    doc = {"command": shlex.join([sys.executable, *sys.argv]), "launch": shlex.join(cmd),
           "launch_wall_s": round(time.perf_counter() - start, 2)}
    doc.update(json.loads(lines[-1][len(RESULT_PREFIX):]))
    print(summary(doc, args.list_functions))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")
        print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
