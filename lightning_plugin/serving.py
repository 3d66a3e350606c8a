"""Starting IMerge for Lightning, and the server side: serve stage by stage, and until shutdown at exit.

No Lightning import here.

A server rank runs the user's script too, and its lines after an entry point may fail where a
worker's do not (a path only worker 0 wrote, a metric only workers have). Such an uncaught
exception is printed, naming the server, and the server then serves the workers' remaining
stages until they shut down and exits 0: the job's exit status is the workers'. A failure of
IMerge itself on a server (its loop, a timeout) still aborts the job, as does Ctrl-C.
"""

from __future__ import annotations

import atexit
import logging
import sys
from typing import Any

import imerge_hooks
from imerge_hooks.cluster import session
from imerge_hooks.cluster.failure import fatal_error, whoami
from imerge_hooks.server import stages

log = logging.getLogger("imerge")

_workers_gone = False
_serving_at_exit = False


def start(num_servers: int | None = None, config: dict[str, Any] | None = None) -> None:
    """Start IMerge once (collective over COMM_WORLD; MPI too if nothing started it).

    Servers return here too: they serve stage by stage (``serve_stage``), then at exit.
    """
    if not session.is_initialized():
        imerge_hooks.init(num_servers, serve="stage", **(config or {}))
    serve_at_exit()


def serve_stage() -> bytes | None:
    """Serve one Trainer entry point; returns when every worker ended it (or shut down), with the
    result worker 0 ended it with (pickled; None if none came)."""
    global _workers_gone
    if _workers_gone:
        return None
    _workers_gone = stages.serve_stage() == "shutdown"
    return None if _workers_gone else stages.stage_result()


def serve_at_exit() -> None:
    """On a server rank: at interpreter exit, serve until every worker has shut down.

    So a script that ends (or fails) early on a server never leaves a worker waiting, and the
    server exits with the script's own status once the workers are done.
    """
    global _serving_at_exit
    if not _serving_at_exit and session.topology().is_server:
        _serving_at_exit = True
        atexit.register(_serve_until_shutdown)
        _report_script_errors_and_serve_on()


def _serve_until_shutdown() -> None:
    while not _workers_gone:
        serve_stage()


def _report_script_errors_and_serve_on() -> None:
    """On a server: an uncaught exception in the script is printed, then the server serves until the
    workers shut down and exits 0 (the job's status is the workers'). IMerge's own fatal errors and
    KeyboardInterrupt go to the previous hook (IMerge's, which aborts the job)."""
    previous = sys.excepthook
    if getattr(previous, "imerge_lightning_server", False):
        return

    def on_uncaught(exc_type: type[BaseException], exc: BaseException, tb: Any) -> None:
        if issubclass(exc_type, KeyboardInterrupt) or fatal_error() is not None:
            previous(exc_type, exc, tb)
            return
        sys.__excepthook__(exc_type, exc, tb)
        log.error("%s: uncaught %s in the script: %s. This server serves the workers until they finish and exits "
                  "0; the job's exit status is the workers'", whoami(), exc_type.__name__, exc)
        raise SystemExit(0)  # from an excepthook: Python exits with it, atexit handlers (serving) first

    on_uncaught.imerge = True  # type: ignore[attr-defined]  # IMerge's install_excepthooks keeps it
    on_uncaught.imerge_lightning_server = True  # type: ignore[attr-defined]
    sys.excepthook = on_uncaught
