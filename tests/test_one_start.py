"""One start-up path whichever way in starts IMerge: a front end that starts it (no ``init()`` call) leaves
the same process as ``imerge_hooks.init()``: cross ranks known locally, and a server's process ended once
its workers are done, even under a test runner."""

from pathlib import Path

from mpirun import run_mpi

SCRIPTS = Path(__file__).parent / "scripts"


def test_a_suite_that_starts_imerge_through_the_optimizer_runs_on_workers_only():
    run = run_mpi(SCRIPTS / "pytest_job.py", 3, str(SCRIPTS / "autostart_suite.py"), servers=1, timeout=90,
                  env={"IMERGE_TIMEOUT_S": "20"})
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    for worker in (0, 1):
        assert run.lines(worker, "RAN") == ["optimizer", "cross"] and run.lines(worker, "EXIT") == ["0"], run.stdout
    assert run.lines(2, "RAN") == ["optimizer"], run.stdout  # the server served inside the first test
    assert run.lines(2, "EXIT") == [], run.stdout  # ... and its process ended there


def test_cross_ranks_follow_the_hosts():
    """Hosts a, a, b, b, c (workers) and one server: local ranks 0/1 on a and b, 0 on c."""
    from imerge_hooks.topology import Topology

    hosts = ("a", "a", "b", "b", "c", "s")
    cross = {}
    for rank in range(5):
        mates = [r for r in range(5) if hosts[r] == hosts[rank]]
        topo = Topology(rank, 6, 1, None, None, mates.index(rank), len(mates), hosts=hosts)
        cross[rank] = topo.cross
    assert cross == {0: (0, 3, False), 1: (0, 2, False), 2: (1, 3, False), 3: (1, 2, False), 4: (2, 3, False)}
