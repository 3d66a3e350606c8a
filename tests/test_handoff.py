"""handoff.from_worker0: how workers take what worker 0 computed (the fusion plan)."""

import re
from pathlib import Path

from mpirun import run_mpi

SCRIPTS = Path(__file__).parent / "scripts"


def test_workers_wait_for_worker0_without_spinning_and_get_large_values_whole():
    run = run_mpi(SCRIPTS / "handoff.py", 4, servers=1, timeout=90).check()
    for rank in (0, 1, 2):
        got = run.lines(rank, "GOT")
        assert len(got) == 1, run.stdout
        count, last, cpu, wall = re.match(r"(\d+) (\[.*\]) cpu ([\d.]+) wall ([\d.]+)", got[0]).groups()
        assert (int(count), last) == (50_000, "[99998, 99999]"), got
        if rank != 0:  # waited for worker 0's 2 s of work: mostly asleep, not polling a core
            assert float(wall) > 1.5, got
            assert float(cpu) < 0.3 * float(wall), f"worker {rank} spun while waiting: {got[0]}"
    timeout = run.lines(1, "TIMEOUT")
    assert timeout and "a value nobody sends from worker 0" in timeout[0], run.stdout
