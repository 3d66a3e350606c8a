"""Runs each Trainer entry point (fit/validate/test/predict): the function on workers, the server loop on servers.

mpiexec already started every rank, so nothing is spawned. Every rank reaches ``launch`` at
the same entry point, so the first one starts IMerge there (collective over COMM_WORLD). A
server serves the stage until every worker has finished it (workers call ``end_stage()`` when
the function returns or raises), and the entry point returns ``None`` there.

After a stage that ended normally the workers also wait for each other (an MPI barrier over
the workers), so no worker's next control message (the next stage's end, or its shutdown at
exit) reaches a server before every worker's end of this stage.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from imerge_hooks import runtime

from ._lightning import TrainerStatus, _Launcher
from .serving import serve_stage

log = logging.getLogger("imerge")


class IMergeLauncher(_Launcher):
    """The launcher of ``IMergeStrategy``; ``start()`` starts IMerge (a no-op once it runs)."""

    def __init__(self, start: Callable[[], None]) -> None:
        self._start = start
        self.in_stage = False  # a worker is running an entry point that its servers still serve

    @property
    def is_interactive_compatible(self) -> bool:
        return True  # it creates no process

    def launch(self, function: Callable, *args: Any, trainer: Any = None, **kwargs: Any) -> Any:
        self._start()
        if runtime.topology().is_server:
            _serve(trainer)
            return None
        self.in_stage = True
        try:
            result = function(*args, **kwargs)
        except BaseException:
            self.in_stage = False
            _end_stage_after_error()
            raise
        self.in_stage = False
        runtime.end_stage()
        _wait_for_all_workers()
        return result

    def kill(self, signum: Any) -> None:
        pass  # mpiexec owns the processes


def _serve(trainer: Any) -> None:
    serve_stage()
    if trainer is not None:
        trainer.state.status = TrainerStatus.FINISHED
        trainer.state.stage = None


def _end_stage_after_error() -> None:
    try:
        runtime.end_stage()
    except Exception:  # the stage failed already (comm thread down, server gone): keep the first error
        log.exception("IMerge worker: could not tell the servers that the failed stage ended")


def _wait_for_all_workers() -> None:
    """Barrier over the workers, polled (MPICH spins otherwise) and bounded by ``timeout_s``."""
    runtime.collective(runtime.topology().worker_comm, "barrier", None, "the end of this Trainer stage")
