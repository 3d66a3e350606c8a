"""The comm thread keeps no reference to a group it finished (a retired engine's buffers are freed)."""


def test_a_finished_group_is_freed_when_its_owner_drops_it(loop_job):
    """``scripts/comm_release.py`` runs last in the shared 2 worker + 1 server job (conftest ``loop_job``)."""
    run = loop_job["run"]
    for rank in (0, 1):
        assert run.lines(rank, "RESULT") == ["True ALIVE False"], run.stdout
