"""Import mpi4py once without starting MPI; ``ensure_initialized()`` starts it on ``init()``.

Importing ``imerge_hooks`` (e.g. for the planner or simulator) must not start MPI; the
runtime asks for MPI_THREAD_MULTIPLE because the comm thread calls MPI.
"""

import mpi4py

mpi4py.rc.initialize = False
mpi4py.rc.finalize = True
mpi4py.rc.thread_level = "multiple"

from mpi4py import MPI  # noqa: E402


def ensure_initialized() -> None:
    if not MPI.Is_initialized():
        provided = MPI.Init_thread(MPI.THREAD_MULTIPLE)
        if provided < MPI.THREAD_MULTIPLE:
            raise RuntimeError("IMerge needs an MPI library with MPI_THREAD_MULTIPLE support; this one provides "
                               f"thread level {provided}")


__all__ = ["MPI", "ensure_initialized"]
