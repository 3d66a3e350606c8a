"""One ``mpiexec`` job of a benchmark: its own process group (setsid), killed whole on timeout."""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import time
from pathlib import Path

from benchmarks.machine import loadavg

REPO = Path(__file__).resolve().parent.parent


def run_job(cmd: list[str], env: dict[str, str], timeout: float) -> dict:
    """Run ``cmd`` from the repository root; on timeout SIGKILL mpiexec and every rank. Returns the
    command, exit code, whether it timed out, wall time, the load before it, and its output."""
    start = time.perf_counter()
    load = loadavg()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            cwd=str(REPO), preexec_fn=os.setsid)
    timed_out = False
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        timed_out = True
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # setsid made mpiexec a process group leader
        except ProcessLookupError:
            pass
        stdout, stderr = proc.communicate()
    return {"cmd": shlex.join(cmd), "returncode": proc.returncode, "timed_out": timed_out,
            "wall_s": time.perf_counter() - start, "loadavg_before": load, "stdout": stdout, "stderr": stderr}
