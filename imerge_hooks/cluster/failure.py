"""Failing fast: name this rank in every fatal message, and end the whole MPI job on a fatal error.

A rank that fails while the others wait for it (up to ``timeout_s``, or forever in
``MPI_Finalize``) must take the job down: ``abort`` does, as ``python -m mpi4py`` does, and the
excepthooks make every uncaught exception do it.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from typing import NoReturn, Protocol

from ..core._mpi import MPI


class Identity(Protocol):
    """What names this rank in messages (a ``Topology`` has it; failing fast needs no more of it)."""

    @property
    def is_server(self) -> bool: ...
    @property
    def server_index(self) -> int: ...
    @property
    def worker_rank(self) -> int: ...
    @property
    def world_rank(self) -> int: ...


log = logging.getLogger("imerge")

ABORT_FORWARD_S = 0.5  # time for the process manager to forward the last words before MPI_Abort

_topology: Identity | None = None
_fatal_error: BaseException | None = None


def record_fatal(error: BaseException) -> BaseException:
    """Remember ``error``: it leaves messages pending or a peer stuck, so ``shutdown()`` aborts."""
    global _fatal_error
    if _fatal_error is None:
        _fatal_error = error
    return error


def fatal_error() -> BaseException | None:
    """The first fatal error of this process, if any."""
    return _fatal_error


def set_identity(topology: Identity) -> None:
    """This rank's role, for every message that names it."""
    global _topology
    _topology = topology


def whoami() -> str:
    """This rank as messages name it: ``IMerge worker 1 (world rank 1)``, ``IMerge server 0 (world rank 3)``."""
    topo = _topology
    if topo is not None:
        role = f"server {topo.server_index}" if topo.is_server else f"worker {topo.worker_rank}"
        return f"IMerge {role} (world rank {topo.world_rank})"
    if MPI.Is_initialized() and not MPI.Is_finalized():
        return f"IMerge world rank {MPI.COMM_WORLD.Get_rank()}"
    return "IMerge"


def abort(message: str, code: int = 1) -> NoReturn:
    """Log ``message`` and end the whole MPI job, every rank, as ``python -m mpi4py`` does.

    For errors after which the other ranks would wait (up to ``timeout_s``, or forever in
    MPI_Finalize) for this one.
    """
    log.error("%s", message)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    # MPI_Abort makes the process manager kill every rank at once; what this rank wrote and its
    # proxy has not read from the pipe yet (the message naming the failure) would be lost.
    time.sleep(ABORT_FORWARD_S)
    if MPI.Is_initialized() and not MPI.Is_finalized():
        MPI.COMM_WORLD.Abort(code)
    os._exit(code)  # MPICH's Abort can return before the process manager ends this rank: run no atexit


def install_excepthooks() -> None:
    """Abort the job on an uncaught exception in any thread, after the previous hook printed it."""
    if getattr(sys.excepthook, "imerge", False):
        return
    previous, previous_thread = sys.excepthook, threading.excepthook

    def on_uncaught(exc_type, exc, tb) -> None:
        previous(exc_type, exc, tb)
        abort(f"{whoami()}: uncaught {exc_type.__name__}: {exc}; aborting the job")

    def on_uncaught_in_thread(args) -> None:
        previous_thread(args)
        if args.exc_type is not SystemExit:
            abort(f"{whoami()}: uncaught {args.exc_type.__name__} in thread "
                  f"{getattr(args.thread, 'name', '?')}: {args.exc_value}; aborting the job")

    on_uncaught.imerge = True
    sys.excepthook, threading.excepthook = on_uncaught, on_uncaught_in_thread
