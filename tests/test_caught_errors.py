"""A caught error leaves the workers in step: scripts/caught_errors_suite.py, a pytest module, runs on 2
workers and 1 server in one launch, as Horovod's own suites run (docs/compatibility.md)."""

import re
from pathlib import Path

from mpirun import run_mpi

SUITE = Path(__file__).parent / "scripts" / "caught_errors_suite.py"
TESTS = 11  # the suite's tests, parametrized cases counted


def test_caught_errors_leave_the_workers_in_step():
    """Each inner test raises on one worker (a collective while another waits in join(), a bad argument
    on one worker), catches it and checks the next collectives' values; a worker out of step would
    fail them, or wait for the 30 s deadline and fail them with IMergeTimeoutError."""
    run = run_mpi(SUITE, 3, servers=1, timeout=120, env={"IMERGE_TIMEOUT_S": "30"})
    # Both workers write to one stdout: a summary (one write) can land inside the other's line of dots.
    summaries = re.findall(r"(?:\d+ (?:passed|failed|errors?|skipped|warnings?)(?:, )?)+ in [\d.]+s", run.stdout)
    report = f"exit {run.returncode}\n{run.stdout[-6000:]}\n{run.stderr[-3000:]}"
    assert len(summaries) == 2, report  # one per worker; the server's process ended in init()
    assert all(re.fullmatch(rf"{TESTS} passed(, \d+ warnings?)? in [\d.]+s", s) for s in summaries), report
    assert run.returncode == 0, report


def test_a_failure_after_the_agreement_ends_the_job_at_once():
    """Worker 1 fails while the others wait for its data: the job ends now, naming it (the deadline, 600 s,
    outlasts the launch's, which would kill the job and fail the test)."""
    run = run_mpi(SUITE, 3, "--fail-after-agreement", servers=1, timeout=120, env={"IMERGE_TIMEOUT_S": "600"})
    report = f"exit {run.returncode}\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}"
    assert run.returncode != 0 and "went on" not in run.stdout, report
    assert "IMerge worker 1 (world rank 1): allreduce of tensor 'staged' failed on this worker after every worker " \
           "had agreed on it" in run.stderr and "MemoryError" in run.stderr, report
