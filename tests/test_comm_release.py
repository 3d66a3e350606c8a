"""The comm thread: it keeps no reference to a group it finished (a retired engine's buffers are freed), and
it never waits on the device."""


def test_a_finished_group_is_freed_when_its_owner_drops_it(loop_job):
    """``scripts/comm_release.py`` runs last in the shared 2 worker + 1 server job (conftest ``loop_job``)."""
    run = loop_job["run"]
    for rank in (0, 1):
        assert run.lines(rank, "RESULT") == ["True ALIVE False"], run.stdout


def test_comm_thread_never_waits_on_the_device(loop_job):
    """``scripts/device_readiness.py`` (the same job): a group behind a pending device event waits while a
    later group's keys go out and its results come back; none of its bytes are read for sending before
    the event completes; then it completes with the right average."""
    run = loop_job["run"]
    for rank in (0, 1):
        line = run.lines(rank, "DEVICE")
        assert line and line[0].startswith("b_done_first=True a_waited=True a_ok=True early=[]"), run.stdout
