"""A server's life after ``init()``: serve until every worker shut down, or stage by stage (the
Lightning entry points), and send its timeline to worker 0."""

from __future__ import annotations

from ..cluster import collectives, messages, session
from ..core._mpi import MPI
from ..core.wire import TAG_TIMELINE


def _server():
    """This rank's server loop (made once: a stage-by-stage server keeps its state between stages)."""
    from .loop import Server  # only server ranks load the server

    if session.state.server is None:
        session.state.server = Server(session.topology(), session.config(), session.state.timeline)
    return session.state.server


def serve_until_shutdown() -> None:
    """Run the server loop until every worker shut down (server ranks only)."""
    _server().serve("shutdown")
    session.state.shut_down = True
    send_server_timeline()


def send_server_timeline() -> None:
    if session.state.timeline is not None:
        from ..core.timeline import export

        payload = MPI.pickle.dumps(export(session.state.timeline))
        comm = session.topology().data_comm
        collectives.wait_for(comm, [], {0: comm.Issend([payload, MPI.BYTE], dest=0, tag=TAG_TIMELINE)}, TAG_TIMELINE,
                             "sending this server's timeline to worker 0", None, "world rank")


def serve_stage() -> str:
    """Serve until every worker ends the current stage or shuts down; returns which."""
    why = _server().serve("stage")
    if why == "shutdown":
        session.state.shut_down = True
        send_server_timeline()
    return why


def end_stage(result: bytes | None = None) -> None:
    """Tell every server this worker finished a stage (Lightning entry points); ``result`` (pickled
    by the caller, e.g. worker 0's return value of the entry point) goes with it: ``stage_result()``."""
    session.flush_all("the end of a stage")
    messages.to_all_servers({"op": "stage_end"} if result is None else {"op": "stage_end", "result": result})


def stage_result() -> bytes | None:
    """On a server, after ``serve_stage()`` returned "stage": the ``result`` worker 0 ended it with."""
    server = session.state.server
    return None if server is None else server.stage_results.pop(server.stages_served - 1, None)
