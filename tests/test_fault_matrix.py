"""Fail fast, never hang: whatever happens to one rank, the whole job ends soon, with a non-zero
exit code and a message that names that rank.

Each case trains 2 workers + 1 server (``scripts/kill_rank.py``; a killed rank: 3 workers + 1
server, at step 20) and makes one rank fail. The victim prints the wall-clock time at which it
fails; the test measures from then until mpiexec returned, and checks that no rank of the job is left.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest
from mpirun import left_over, run_mpi

from imerge_hooks.core.wire import KeySpec
from imerge_hooks.server.aggregate import KeyAggregate
from imerge_hooks.server.loop import CLOCK_JUMP_S, Server, _KeyState, _Receive

SCRIPT = Path(__file__).parent / "scripts" / "kill_rank.py"

# (ranks, victim world rank, the step it fails at, how, env, seconds allowed from the failure until the
# job is gone, the message). A killed rank runs no code: mpiexec reports it, naming the PID of the first
# rank it reaped, which is the victim's or, when mpiexec killed the others first, another rank's of this job.
CASES = {
    "kill worker": (4, 1, 20, "kill", {}, 15, r"BAD TERMINATION.*\n.*PID {any_pid} .*\n.*EXIT CODE: 9"),
    "kill server": (4, 3, 20, "kill", {}, 15, r"BAD TERMINATION.*\n.*PID {any_pid} .*\n.*EXIT CODE: 9"),
    "stop server": (3, 2, 3, "stop", {"IMERGE_TIMEOUT_S": "10"}, 35,
                    r"worker \d \(world rank \d\): uncaught IMergeTimeoutError: .*server\(?s?\)? \[?0"),
    # All ranks on one host: host aggregation, so worker 0, which sums half of the keys, names worker 1.
    "stop worker": (3, 1, 3, "stop", {"IMERGE_TIMEOUT_S": "10"}, 30,
                    r"IMerge worker 0 \(host [^)]*\): no gradient of key \d+ .* from worker 1 \(host [^)]*\)"),
    "worker raises": (3, 1, 3, "raise", {"IMERGE_TIMEOUT_S": "600"}, 15,
                      r"worker 1 \(world rank 1\): uncaught RuntimeError: worker 1 fails at step 3; aborting"),
    "worker exits early": (3, 1, 3, "exit", {"IMERGE_TIMEOUT_S": "600"}, 15,
                           r"worker 1 (\(host [^)]*\) )?shut down while (workers \[0\]|this worker) still trains? .*"
                           r"imerge_hooks\.join\(\)"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_failing_rank_ends_the_job_soon_and_is_named(case):
    ranks, victim, at_step, how, env, limit_s, message = CASES[case]
    run = run_mpi(SCRIPT, ranks, str(victim), str(at_step), how, servers=1, timeout=limit_s + 60, env=env)
    gone_at = time.time()
    output = run.stdout + run.stderr
    failed_at = run.lines(victim, "FAILS")
    assert failed_at, f"{case}: the victim never failed\n{output[-4000:]}"
    pids = {rank: int(run.lines(rank, "PID")[0]) for rank in range(ranks)}
    assert run.returncode != 0, f"{case} went unnoticed\n{output[-4000:]}"
    assert "finished without noticing" not in run.stdout
    any_pid = "(" + "|".join(map(str, pids.values())) + ")"
    assert re.search(message.format(any_pid=any_pid), output), f"{case}: no message naming the rank\n{output[-4000:]}"
    seconds = gone_at - float(failed_at[0].split()[-1])
    assert seconds < limit_s, f"{case}: the job took {seconds:.1f} s to end after the failure"
    assert not left_over(pids.values()), f"{case}: ranks still running: {left_over(pids.values())}"


def test_collectives_with_a_deadline_name_the_missing_worker_and_end_the_job():
    run = run_mpi(SCRIPT.parent / "collective_timeout.py", 3, servers=1, timeout=60)
    for me in (0, 1):
        assert run.lines(me, "ALLGATHER") == ["[0, 10]"], run.stdout
        assert run.lines(me, "BCAST") == ["from 1"], run.stdout
        assert run.lines(me, "GATHER") == (["[{'rank': 0}, {'rank': 1}]"] if me == 0 else ["None"]), run.stdout
        assert run.lines(me, "MAX") == ["5"] and run.lines(me, "BARRIER") == ["None"], run.stdout
    (timeout,) = run.lines(0, "TIMEOUT")
    assert "bcast of an object from worker 0 did not complete within 3 s: worker(s) [1] did not arrive" in timeout
    assert run.returncode != 0  # the pending send makes worker 0's exit abort the job instead of hanging
    assert "worker 0 (world rank 0): shutdown after IMergeTimeoutError" in run.stderr, run.stderr[-3000:]


def test_a_server_that_was_stopped_restarts_its_stall_clocks_instead_of_blaming_a_worker():
    """A gap in the server's own loop (SIGSTOP, then SIGCONT) is not time the workers were late."""
    server = Server.__new__(Server)  # only the state _tick() reads: no MPI needed
    server.index = 0
    state = _KeyState(KeyAggregate(KeySpec(7, 16, "float32", 0, ("w",)), workers=2), first_push_at=100.0,
                      held_since=101.0)
    state.agg.count = 1
    state.receiving = _Receive(None, 1, 16, False, 102.0)
    server.keys = {7: state}
    server._last_tick = time.monotonic() - (CLOCK_JUMP_S + 10)
    before = (state.first_push_at, state.held_since, state.receiving.started)
    server._tick()
    gap = [after - b for after, b in zip((state.first_push_at, state.held_since, state.receiving.started), before)]
    assert all(g > CLOCK_JUMP_S + 9 for g in gap), gap
    server._tick()  # no gap: nothing moves
    assert state.first_push_at - before[0] == pytest.approx(gap[0])
