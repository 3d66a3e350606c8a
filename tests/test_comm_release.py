"""The comm thread keeps no reference to a group it finished (a retired engine's buffers are freed)."""

from pathlib import Path

from mpirun import run_mpi

SCRIPTS = Path(__file__).parent / "scripts"


def test_a_finished_group_is_freed_when_its_owner_drops_it():
    run = run_mpi(SCRIPTS / "comm_release.py", 3, servers=1, timeout=90).check()
    for rank in (0, 1):
        assert run.lines(rank, "RESULT") == ["True ALIVE False"], run.stdout
