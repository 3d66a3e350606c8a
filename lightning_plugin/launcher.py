"""Runs each Trainer entry point (fit/validate/test/predict): the function on workers, the server loop on servers.

mpiexec already started every rank, so nothing is spawned. A server serves the stage until
every worker has finished it (workers call ``end_stage()`` when the function returns or
raises), and the entry point returns ``None`` there.

After a stage that ended normally the workers also wait for each other (an MPI barrier over
the workers), so no worker's next control message (the next stage's end, or its shutdown at
exit) reaches a server before every worker's end of this stage.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from pytorch_lightning.strategies.launchers.launcher import _Launcher
from pytorch_lightning.trainer.states import TrainerStatus

from imerge_hooks import runtime
from lightning_plugin.serving import serve_stage

log = logging.getLogger("imerge")


class IMergeLauncher(_Launcher):
    """The launcher of ``IMergeStrategy``."""

    @property
    def is_interactive_compatible(self) -> bool:
        return True  # it creates no process

    def launch(self, function: Callable, *args: Any, trainer: Any = None, **kwargs: Any) -> Any:
        if runtime.topology().is_server:
            serve_stage()
            if trainer is not None:
                trainer.state.status = TrainerStatus.FINISHED
                trainer.state.stage = None
            return None
        try:
            result = function(*args, **kwargs)
        except BaseException:
            _end_stage_after_error()
            raise
        runtime.end_stage()
        _wait_for_all_workers()
        return result

    def kill(self, signum: Any) -> None:
        pass  # mpiexec owns the processes


def _end_stage_after_error() -> None:
    try:
        runtime.end_stage()
    except Exception:  # the stage failed already (comm thread down, server gone): keep the first error
        log.exception("IMerge worker: could not tell the servers that the failed stage ended")


def _wait_for_all_workers() -> None:
    """Barrier over the workers, polled (MPICH spins otherwise) and bounded by ``timeout_s``."""
    runtime.collective(runtime.topology().worker_comm, "barrier", None, "the end of this Trainer stage")
