"""Starting IMerge for Lightning, and the server side: serve stage by stage, and until shutdown at exit.

No Lightning import here.
"""

from __future__ import annotations

import atexit
from typing import Any

import imerge_hooks
from imerge_hooks import runtime

_workers_gone = False
_serving_at_exit = False


def start(num_servers: int | None = None, config: dict[str, Any] | None = None) -> None:
    """Start IMerge once (collective over COMM_WORLD; MPI too if nothing started it).

    Servers return here too: they serve stage by stage (``serve_stage``), then at exit.
    """
    if not runtime.is_initialized():
        imerge_hooks.init(num_servers, serve="stage", **(config or {}))
    serve_at_exit()


def serve_stage() -> None:
    """Serve one Trainer entry point; returns when every worker ended it (or shut down)."""
    global _workers_gone
    if not _workers_gone:
        _workers_gone = runtime.serve_stage() == "shutdown"


def serve_at_exit() -> None:
    """On a server rank: at interpreter exit, serve until every worker has shut down.

    So a script that ends (or fails) early on a server never leaves a worker waiting, and the
    server exits with the script's own status once the workers are done.
    """
    global _serving_at_exit
    if not _serving_at_exit and runtime.topology().is_server:
        _serving_at_exit = True
        atexit.register(_serve_until_shutdown)


def _serve_until_shutdown() -> None:
    while not _workers_gone:
        serve_stage()
