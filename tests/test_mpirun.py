"""run_mpi leaves no process behind when the test is interrupted while it waits: by an exception,
by pytest-timeout's signal method (pytest.fail inside the wait) or its thread method (os._exit)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from mpirun import left_over, run_mpi

SLEEPER = Path(__file__).parent / "scripts" / "sleep_rank.py"
RANKS = 2


def job_pids(folder: Path) -> list[int]:
    """The ranks' and their proxies' process ids that sleep_rank.py wrote."""
    pids = []
    for rank in range(RANKS):
        path = folder / f"pids.{rank}"
        assert path.exists(), f"rank {rank} never started (no {path})"
        pids += [int(p) for p in path.read_text().split()]
    return pids


def assert_all_gone(pids: list[int]) -> None:
    left = left_over(pids, grace_s=10)
    for pid in left:  # do not leave them to the next test either
        os.kill(pid, signal.SIGKILL)
    assert not left, f"processes {left} of the interrupted mpiexec job are still running"


class Interrupted(Exception):
    pass


def test_an_exception_while_waiting_kills_the_whole_job(tmp_path):
    def interrupt_once_started(signum, frame):
        if all((tmp_path / f"pids.{r}").exists() for r in range(RANKS)):
            raise Interrupted("interrupted by the test")

    previous = signal.signal(signal.SIGALRM, interrupt_once_started)
    signal.setitimer(signal.ITIMER_REAL, 0.2, 0.2)
    try:
        with pytest.raises(Interrupted) as info:
            run_mpi(SLEEPER, RANKS, str(tmp_path), "120", timeout=60)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert_all_gone(job_pids(tmp_path))
    assert "was killed (process group" in "\n".join(getattr(info.value, "__notes__", []))


def test_pytest_timeout_kills_the_whole_job(tmp_path):
    """Tests whose run_mpi limit (120 s x 2) is above their pytest-timeout (2 s), with either of
    pytest-timeout's methods (signal runs first: thread ends the pytest process)."""
    inner = tmp_path / "test_inner.py"
    inner.write_text(textwrap.dedent(f"""
        import pytest
        from mpirun import left_over, run_mpi

        @pytest.mark.parametrize("method", [pytest.param(m, marks=pytest.mark.timeout(2, method=m))
                                            for m in ("signal", "thread")])
        def test_hangs(method):
            run_mpi({str(SLEEPER)!r}, {RANKS}, {str(tmp_path)!r} + "/" + method, "120", timeout=120)
    """))
    for method in ("signal", "thread"):
        (tmp_path / method).mkdir()
    tests = Path(__file__).parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tests), os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir",
                             str(tmp_path), "-c", os.devnull, str(inner)], capture_output=True, text=True,
                            env=env, timeout=60, cwd=tmp_path)
    output = result.stdout + result.stderr
    assert result.returncode != 0 and "Timeout" in output, output
    assert_all_gone(job_pids(tmp_path / "signal") + job_pids(tmp_path / "thread"))


def test_a_failed_shared_launch_names_the_case_and_the_rank_that_broke(tmp_path):
    """Several cases share one launch (``common.case`` marks each): when the launch fails, its error says
    which case broke on which rank, not only that mpiexec exited."""
    script = tmp_path / "cases.py"
    script.write_text(textwrap.dedent(f"""
        import os, sys
        sys.path.insert(0, {str(Path(__file__).parent / "scripts")!r})
        from common import case
        rank = int(os.environ.get("PMI_RANK", "0"))
        with case(rank, "first"):
            pass
        with case(rank, "second"):
            if rank == 1:
                raise SystemExit(3)
    """))
    run = run_mpi(script, 2, timeout=60)
    assert run.broken() == {1: "second"}
    with pytest.raises(AssertionError, match=r"case 'second' broke on world rank 1"):
        run.check()
