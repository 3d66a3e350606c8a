"""Runs each Trainer entry point (fit/validate/test/predict): the function on workers, the server loop on servers.

mpiexec already started every rank, so nothing is spawned. Every rank reaches ``launch`` at
the same entry point, so the first one starts IMerge there (collective over COMM_WORLD). A
server serves the stage until every worker has finished it (workers call ``end_stage()`` when
the function returns or raises).

On servers the entry point returns what it returned on worker 0 (``validate``/``test``: the
list of metric dicts; ``predict``: worker 0's predictions; ``fit``: None), and
``trainer.callback_metrics`` holds worker 0's, so the script's next line runs on a server as on
a worker. Worker 0 sends both with its end of the stage (tensors moved to the CPU); a result
that cannot be pickled reaches the servers as None, with a warning.

After a stage that ended normally the workers also wait for each other (an MPI barrier over
the workers), so no worker's next control message (the next stage's end, or its shutdown at
exit) reaches a server before every worker's end of this stage.
"""

from __future__ import annotations

import logging
import pickle
from collections.abc import Callable
from typing import Any

import torch
from lightning_utilities.core.apply_func import apply_to_collection

from imerge_hooks.cluster import collectives, session
from imerge_hooks.server import stages

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
        if session.topology().is_server:
            return _serve(trainer)
        self.in_stage = True
        try:
            result = function(*args, **kwargs)
        except BaseException:
            self.in_stage = False
            _end_stage_after_error()
            raise
        self.in_stage = False
        stages.end_stage(pack_result(result, trainer) if session.topology().worker_rank == 0 else None)
        _wait_for_all_workers()
        return result

    def kill(self, signum: Any) -> None:
        pass  # mpiexec owns the processes


def pack_result(result: Any, trainer: Any) -> bytes:
    """Worker 0's return value and ``callback_metrics`` for the servers, pickled, tensors on the CPU."""
    metrics = dict(trainer.callback_metrics) if trainer is not None else {}
    payload = apply_to_collection({"result": result, "callback_metrics": metrics}, torch.Tensor,
                                  lambda t: t.detach().cpu())
    try:
        return pickle.dumps(payload, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as exc:  # noqa: BLE001 - the servers get None instead
        log.warning("IMerge worker 0: the result of this Trainer entry point cannot be pickled for the servers "
                    "(%s: %s); on the servers it returns None", type(exc).__name__, exc)
        return pickle.dumps({"result": None, "callback_metrics": {}})


def unpack_result(data: bytes | None) -> dict[str, Any]:
    """What ``pack_result`` sent; ``{"result": None, ...}`` when nothing came (the stage failed on worker 0)."""
    if data is None:
        return {"result": None, "callback_metrics": {}}
    try:
        return pickle.loads(data)
    except Exception as exc:  # noqa: BLE001 - the server returns None instead
        log.warning("IMerge server: worker 0's result of this Trainer entry point cannot be unpickled here "
                    "(%s: %s); it returns None", type(exc).__name__, exc)
        return {"result": None, "callback_metrics": {}}


def _serve(trainer: Any) -> Any:
    got = unpack_result(serve_stage())
    if trainer is not None:
        trainer.state.status = TrainerStatus.FINISHED
        trainer.state.stage = None
        connector = getattr(trainer, "_logger_connector", None)
        if connector is not None and hasattr(connector, "_callback_metrics"):
            connector._callback_metrics = dict(got["callback_metrics"])  # what trainer.callback_metrics reads here
    return got["result"]


def _end_stage_after_error() -> None:
    try:
        stages.end_stage()
    except Exception:  # the stage failed already (comm thread down, server gone): keep the first error
        log.exception("IMerge worker: could not tell the servers that the failed stage ended")


def _wait_for_all_workers() -> None:
    """Barrier over the workers, polled (MPICH spins otherwise) and bounded by ``timeout_s``."""
    collectives.collective(session.topology().worker_comm, "barrier", None, "the end of this Trainer stage")
