"""What a benchmark's numbers depend on, recorded beside them: the machine, its load, the versions, and
the ``mpiexec`` the benchmarks launch with."""

from __future__ import annotations

import os
import platform
import shutil
import socket
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def mpiexec_path() -> str:
    """The ``mpiexec`` beside this Python (the mpich wheel's), else the one on PATH."""
    exe = Path(sys.executable).parent / "mpiexec"
    return str(exe) if exe.exists() else (shutil.which("mpiexec") or "mpiexec")


def loadavg() -> list[float] | None:
    """The 1, 5 and 15 minute load averages, None where /proc has none."""
    try:
        with open("/proc/loadavg") as fh:
            return [float(v) for v in fh.read().split()[:3]]
    except (OSError, ValueError):
        return None


def cpu_model() -> str | None:
    """The CPU's model name (/proc/cpuinfo), None where there is none."""
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def machine_info() -> dict:
    """Host, CPU, load, versions and git revision. Reads versions without initialising MPI in this process."""
    from importlib.metadata import PackageNotFoundError, version

    def pkg(name: str) -> str | None:
        try:
            return version(name)
        except PackageNotFoundError:
            return None

    mpich_version = None
    tool = Path(sys.executable).parent / "mpichversion"
    if tool.exists():
        try:
            out = subprocess.run([str(tool)], capture_output=True, text=True, timeout=30).stdout
            for line in out.splitlines():
                if line.startswith("MPICH Version:"):
                    mpich_version = line.split(":", 1)[1].strip()
        except (OSError, subprocess.SubprocessError):
            pass
    try:
        affinity = len(os.sched_getaffinity(0))
    except AttributeError:
        affinity = None
    try:
        git_rev = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10,
                                 cwd=str(REPO)).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        git_rev = None
    return {
        "hostname": socket.gethostname(), "platform": platform.platform(), "machine": platform.machine(),
        "cpu_model": cpu_model(), "nproc": os.cpu_count(), "nproc_affinity": affinity,
        "loadavg_at_start": loadavg(), "python": sys.version.split()[0], "torch": pkg("torch"),
        "torchvision": pkg("torchvision"), "mpi4py": pkg("mpi4py"), "mpich_version": mpich_version,
        "mpich_wheel": pkg("mpich"), "imerge": pkg("imerge-hooks"), "git_head": git_rev,
        "mpiexec": mpiexec_path(), "omp_num_threads": os.environ.get("OMP_NUM_THREADS", "1"),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }
