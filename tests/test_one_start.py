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
    from imerge_hooks.cluster.topology import Topology

    hosts = ("a", "a", "b", "b", "c", "s")
    cross = {}
    for rank in range(5):
        mates = [r for r in range(5) if hosts[r] == hosts[rank]]
        topo = Topology(rank, 6, 1, None, None, mates.index(rank), len(mates), hosts=hosts)
        cross[rank] = topo.cross
    assert cross == {0: (0, 3, False), 1: (0, 2, False), 2: (1, 3, False), 3: (1, 2, False), 4: (2, 3, False)}


def test_without_the_torch_store_nothing_listens_and_training_runs():
    """``IMERGE_TORCH_STORE=0``: no unauthenticated store (worker 0 listens on no more ports than worker 1,
    which only MPI's own sockets open; a socket of its own shows up), no torchrun variables, gradients
    still averaged."""
    run = run_mpi(SCRIPTS / "no_store.py", 3, servers=1, timeout=60, env={"IMERGE_TORCH_STORE": "0"}).check()
    ports = {worker: set(run.lines(worker, "LISTENING")[0].split()) for worker in (0, 1)}
    assert len(ports[0]) == len(ports[1]), run.stdout
    for worker in (0, 1):
        probe, *seen = run.lines(worker, "PROBE")[0].split()
        assert set(seen) == ports[worker] | {probe}, run.stdout
        assert run.lines(worker, "ENV") == ["none"], run.stdout
        assert run.lines(worker, "GRAD") == ["3.0"], run.stdout  # (2 + 4) / 2: the two workers' average
        group = run.lines(worker, "GROUP")[0]
        assert group.startswith("IMergeConfigError") and "torch_store=False" in group, group
