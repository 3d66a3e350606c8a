"""The one helper every multi-process test uses: run ``mpiexec -n N`` with a timeout."""

from __future__ import annotations

import atexit
import ctypes
import functools
import itertools
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


@dataclass
class MPIRun:
    returncode: int
    stdout: str
    stderr: str
    ranks: dict[int, str]  # world rank -> its stdout lines tagged "@<rank> " (tag removed)

    def check(self) -> MPIRun:
        if self.returncode != 0:
            raise AssertionError(f"mpiexec exited {self.returncode}{self.broken_cases()}\n--- stdout ---\n"
                                 f"{self.stdout[-6000:]}\n--- stderr ---\n{self.stderr[-6000:]}")
        return self

    def broken(self) -> dict[int, str]:
        """World rank -> the case it started and did not finish (scripts mark cases with ``common.case``)."""
        out = {}
        for rank in self.ranks:
            started = self.lines(rank, "CASE ")
            if started and started[-1] not in self.lines(rank, "CASE-DONE"):
                out[rank] = started[-1]
        return out

    def broken_cases(self) -> str:
        """``broken()`` as the first line of a failure's message ('' when every started case finished)."""
        broken = self.broken()
        if not broken:
            return ""
        return ": " + "; ".join(f"case {name!r} broke on world rank {rank}" for rank, name in sorted(broken.items()))

    def lines(self, rank: int, prefix: str) -> list[str]:
        return [line[len(prefix):].strip() for line in self.ranks.get(rank, "").splitlines()
                if line.startswith(prefix)]


def process_alive(pid: int) -> bool:
    """Running (a zombie that no init reaps counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def left_over(pids, grace_s: float = 3.0) -> list[int]:
    """The processes among ``pids`` still alive after ``grace_s``."""
    deadline = time.monotonic() + grace_s
    while True:
        alive = [pid for pid in pids if process_alive(pid)]
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.1)


@functools.cache
def cost_model_cache() -> Path:
    """One PS cost-model cache directory for every test of this pytest process, so calibration
    runs once per (W, S); removed at exit. The ``cost_model_dir`` fixture (conftest.py) returns it."""
    path = Path(tempfile.mkdtemp(prefix="imerge-costmodel-"))
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path


def mpiexec_path() -> str:
    exe = Path(sys.executable).parent / "mpiexec"
    return str(exe) if exe.exists() else (shutil.which("mpiexec") or "mpiexec")


_PR_SET_PDEATHSIG = 1


def _own_group_dies_with_parent() -> None:
    """In the child before exec: a process group of its own (killed as one), and SIGKILL when the
    test process dies (pytest-timeout's thread method ends it with os._exit; then mpiexec goes,
    and its proxies end the ranks)."""
    os.setsid()
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: the group kill on any exception still applies
        pass


def kill_job(proc: subprocess.Popen) -> tuple[str, str]:
    """SIGKILL ``proc``'s process group (mpiexec, its proxies, the ranks) and return what it printed."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    try:
        out, err = proc.communicate(timeout=30)
    except BaseException:  # noqa: BLE001 - a second interrupt while reaping: the group is dead already
        proc.kill()
        return "", ""
    return out or "", err or ""


def run_mpi(script: str | os.PathLike, n: int, *args: str, servers: int | None = None, timeout: float = 120,
            env: dict[str, str] | None = None, hosts: list[str] | None = None) -> MPIRun:
    """Run ``python script args`` on ``n`` ranks; return code, output and each rank's stdout.

    Kills the whole job (process group) on timeout, or on any exception while it waits (pytest-timeout's
    included), and raises, so a hang fails fast and leaves nothing running.
    ``IMERGE_TEST_TIMEOUT_SCALE`` (default 2) stretches every timeout on loaded machines.
    ``hosts``: world rank r stands for host ``hosts[r]`` (an MPMD launch with ``-env IMERGE_HOST`` per
    block of ranks, as on one machine that emulates several hosts).
    """
    timeout *= float(os.environ.get("IMERGE_TEST_TIMEOUT_SCALE", "2"))
    full_env = dict(os.environ)
    full_env.setdefault("OMP_NUM_THREADS", "1")
    full_env["PYTHONPATH"] = os.pathsep.join([str(REPO), full_env.get("PYTHONPATH", "")])
    full_env["PYTHONUNBUFFERED"] = "1"
    if servers is not None:
        full_env["IMERGE_NUM_SERVERS"] = str(servers)
    if env:
        full_env.update(env)
    cmd = [mpiexec_path(), "-n", str(n), sys.executable, str(script), *args]
    if hosts is not None:
        if len(hosts) != n:
            raise ValueError(f"run_mpi: {len(hosts)} hosts for {n} ranks")
        cmd = [mpiexec_path()]
        for host, block in itertools.groupby(hosts):
            if len(cmd) > 1:
                cmd.append(":")
            cmd += ["-n", str(len(list(block))), "-env", "IMERGE_HOST", host, sys.executable, str(script), *args]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=full_env,
                            cwd=str(REPO), preexec_fn=_own_group_dies_with_parent)
    try:
        out, err = proc.communicate(timeout=timeout)
    except BaseException as exc:
        # Our timeout, pytest-timeout's (signal method: pytest.fail, a BaseException raised in this
        # wait), Ctrl-C, any error: the whole job goes, never left running behind the test.
        out, err = kill_job(proc)
        cases = _parse(-1, out, err).broken_cases()
        if isinstance(exc, subprocess.TimeoutExpired):
            raise AssertionError(f"mpiexec -n {n} {script} timed out after {timeout} s{cases}\n--- stdout ---\n"
                                 f"{out[-4000:]}\n--- stderr ---\n{err[-4000:]}") from None
        exc.add_note(f"mpiexec -n {n} {script} was killed (process group {proc.pid}){cases}\n--- stdout ---\n"
                     f"{out[-4000:]}\n--- stderr ---\n{err[-4000:]}")
        raise
    return _parse(proc.returncode, out, err)


def _parse(returncode: int, out: str, err: str) -> MPIRun:
    ranks: dict[int, list[str]] = {}
    for line in (out or "").splitlines():  # scripts tag their lines "@<world rank> ..." (tests/scripts/common.py)
        if line.startswith("@"):
            tag, _, rest = line.partition(" ")
            try:
                rank = int(tag[1:])
            except ValueError:
                continue
            ranks.setdefault(rank, []).append(rest)
    return MPIRun(returncode, out, err, {r: "\n".join(v) for r, v in ranks.items()})
