"""Import mpi4py once, asking for MPI_THREAD_MULTIPLE (the comm thread calls MPI)."""

import mpi4py

mpi4py.rc.thread_level = "multiple"
mpi4py.rc.initialize = True
mpi4py.rc.finalize = True

from mpi4py import MPI  # noqa: E402

__all__ = ["MPI"]
