"""The process-level API: start (``init``) and stop (``shutdown``), who this process is (rank, size,
local and cross ranks, server or worker), ``join``, Horovod's process sets and the build flags Horovod
scripts ask about. The tensor collectives are ``horovod_api``'s."""

from __future__ import annotations

from typing import Any

import torch

from ..cluster import session
from ..cluster.startup import init, shutdown
from ..core.errors import IMergeConfigError
from . import worker_join

__all__ = ["init", "shutdown"]


def is_server() -> bool:
    """True on parameter-server ranks (user code after ``init()`` normally never sees this)."""
    return session.topology().is_server


def rank() -> int:
    """This worker's rank among the workers (0 .. size()-1)."""
    return session.topology().worker_rank


def size() -> int:
    """Number of workers (servers not counted)."""
    return session.topology().num_workers


def local_rank() -> int:
    """This worker's rank among the workers on its host."""
    return session.topology().local_rank


def local_size() -> int:
    """Number of workers on this host."""
    return session.topology().local_size


def num_servers() -> int:
    """Number of parameter-server ranks."""
    return session.topology().num_servers


class _GlobalProcessSet:
    """Horovod's ``global_process_set``: every worker (the only process set IMerge has)."""

    process_set_id = 0

    def rank(self) -> int:
        return session.topology().worker_rank

    def size(self) -> int:
        return session.topology().num_workers

    def included(self) -> bool:
        return not session.topology().is_server

    def __repr__(self) -> str:
        return "global_process_set"


global_process_set = _GlobalProcessSet()


def check_process_set(process_set: Any, where: str) -> None:
    """Only the global process set (or None) is accepted."""
    if process_set is not None and process_set is not global_process_set:
        raise IMergeConfigError(f"IMerge: {where}: process sets are not supported; every op runs over all workers "
                                "(pass process_set=None or imerge_hooks.global_process_set)")


def add_process_set(*_args: Any, **_kwargs: Any) -> None:
    """Refused: IMerge has one process set, all workers."""
    raise IMergeConfigError("IMerge: add_process_set: process sets are not supported; every op runs over all "
                            "workers")


def remove_process_set(*_args: Any, **_kwargs: Any) -> None:
    """Refused: IMerge has one process set, all workers."""
    raise IMergeConfigError("IMerge: remove_process_set: process sets are not supported; every op runs over all "
                            "workers")


def join(device: int = -1) -> int:
    """Horovod's ``join(device)``: ``imerge_hooks.frontends.worker_join.join()`` (``device`` is not needed)."""
    return worker_join.join()


# ---------------------------------------------------------------------- information
def is_initialized() -> bool:
    """Whether ``init()`` has run in this process."""
    return session.is_initialized()


def cross_rank() -> int:
    """This worker's host index among the hosts with a worker of its local rank (Horovod's cross rank)."""
    return session.topology().cross[0]


def cross_size() -> int:
    """How many hosts have a worker with this worker's local rank (the number of hosts, when homogeneous)."""
    return session.topology().cross[1]


def is_homogeneous() -> bool:
    """Whether every host runs the same number of workers."""
    return session.topology().cross[2]


def mpi_threads_supported() -> bool:
    """True: IMerge needs MPI_THREAD_MULTIPLE (its comm thread calls MPI)."""
    return True


def mpi_enabled() -> bool:
    """True: IMerge runs over MPI."""
    return True


def mpi_built() -> bool:
    """True: IMerge runs over MPI (mpi4py)."""
    return True


def gloo_enabled() -> bool:
    """False: IMerge has no Gloo controller."""
    return False


def gloo_built() -> bool:
    """False: IMerge has no Gloo controller."""
    return False


def nccl_built() -> int:
    """NCCL's version code where this torch has NCCL and a GPU (the tensor collectives then move CUDA
    tensors over the workers' NCCL group, ``device_collectives``), else 0; as Horovod's, truthy iff built with it."""
    import torch

    if not (torch.cuda.is_available() and torch.distributed.is_available() and torch.distributed.is_nccl_available()):
        return 0
    major, minor, patch = torch.cuda.nccl.version()
    return major * 1000 + minor * 100 + patch


def ddl_built() -> bool:
    """False: no IBM DDL."""
    return False


def ccl_built() -> bool:
    """False: no oneCCL."""
    return False


def cuda_built() -> bool:
    """Whether this torch was built with CUDA (CUDA tensors are accepted; they are staged through the host)."""
    return bool(torch.backends.cuda.is_built())


def rocm_built() -> bool:
    """False: ROCm builds are not supported."""
    return False


def start_timeline(file_path: str, mark_cycles: bool = False) -> None:
    """Refused: IMerge's timeline is chosen at start-up."""
    raise IMergeConfigError("IMerge: start_timeline is not supported; set IMERGE_TIMELINE=path (or "
                            "imerge_hooks.init(timeline=path)) to write a Chrome trace of the whole run")


def stop_timeline() -> None:
    """Refused: IMerge's timeline is chosen at start-up."""
    raise IMergeConfigError("IMerge: stop_timeline is not supported; the IMERGE_TIMELINE trace covers the whole run")
