"""mpi4py's ``MPI``, loaded on first use; ``ensure_initialized()`` starts MPI on ``init()``.

Importing ``imerge_hooks`` (e.g. for the planner or simulator) must not start MPI, nor even load
``mpi4py.MPI``: loaded with ``rc.initialize = False`` and never started, it would break code that
expects an imported ``mpi4py.MPI`` to be usable (Lightning's ``MPIEnvironment.detect()`` calls
``MPI.COMM_WORLD.Get_size()`` when a Trainer is built). The runtime asks for
MPI_THREAD_MULTIPLE because the comm thread calls MPI.
"""

import sys
from typing import Any

import mpi4py


class _LazyMPI:
    """Stands for the ``mpi4py.MPI`` module; each attribute is looked up once, then cached."""

    def __getattr__(self, name: str) -> Any:
        value = getattr(_module(), name)
        setattr(self, name, value)
        return value


def _module() -> Any:
    if "mpi4py.MPI" not in sys.modules:  # nobody loaded it yet: start MPI ourselves, in init()
        mpi4py.rc.initialize = False
        mpi4py.rc.finalize = True
        mpi4py.rc.thread_level = "multiple"
    from mpi4py import MPI as module

    return module


MPI: Any = _LazyMPI()


def ensure_initialized() -> None:
    """Start MPI with MPI_THREAD_MULTIPLE, or check that whoever started it asked for that level."""
    provided = MPI.Query_thread() if MPI.Is_initialized() else MPI.Init_thread(MPI.THREAD_MULTIPLE)
    if provided < MPI.THREAD_MULTIPLE:
        raise RuntimeError("IMerge needs MPI started with MPI_THREAD_MULTIPLE (the comm thread calls MPI); this "
                           f"one provides thread level {provided}")


__all__ = ["MPI", "ensure_initialized"]
