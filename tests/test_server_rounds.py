"""The server's per-key rounds: a new round that arrives early waits without stopping the server."""

from pathlib import Path

from mpirun import run_mpi

SCRIPTS = Path(__file__).parent / "scripts"


def test_a_new_round_waits_for_the_last_results_without_blocking_other_keys():
    # Both workers push every key themselves (the script speaks the server protocol directly).
    run = run_mpi(SCRIPTS / "server_hold.py", 3, servers=1, timeout=90, env={"IMERGE_HOST_AGGREGATION": "0"}).check()
    assert run.ranks.get(0) == "OK" and run.ranks.get(1) == "OK", run.stdout
