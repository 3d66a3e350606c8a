"""A rank that dies mid-training ends the job with a non-zero exit, never a silent hang."""

import time
from pathlib import Path

import pytest
from mpirun import run_mpi

SCRIPT = Path(__file__).parent / "scripts" / "kill_rank.py"


@pytest.mark.parametrize("victim,what", [(1, "worker"), (3, "server")])
def test_killed_rank_ends_the_job(victim, what):
    start = time.monotonic()
    run = run_mpi(SCRIPT, 4, str(victim), "20", servers=1, timeout=90,
                  env={"IMERGE_TIMEOUT_S": "10", "IMERGE_STALL_WARNING_S": "2"})
    assert run.returncode != 0, f"killing a {what} went unnoticed"
    assert time.monotonic() - start < 90
    assert "finished without noticing" not in run.stdout
