"""Which GPU a worker uses and whether its MPI reads device memory (``backend``: the torch.distributed backend).

Workers take the GPUs of their host in local-rank order (``Topology.local_rank`` counts workers
only: servers take no GPU); ``rank_layout.check_layout`` has already refused a host with more
workers than GPUs unless ``share_gpus`` says sharing is intended.
"""

from __future__ import annotations

import ctypes
import logging
import os

import torch

from .topology import Topology

log = logging.getLogger("imerge")

_bound: int | None = None  # the CUDA device init() bound this worker to
_direct = False  # device buffers go to MPI directly (CUDA-aware MPI, see configure)


def gpu_index(topo: Topology) -> int:
    """This worker's GPU among the ones its process sees: its local rank, wrapped where workers share GPUs."""
    visible = topo.gpus[topo.world_rank] if topo.gpus else 0
    return topo.local_rank % visible if visible else topo.local_rank


def bind_worker_device(topo: Topology) -> int | None:
    """``torch.cuda.set_device`` to this worker's GPU (workers with CUDA only); returns its index."""
    global _bound
    if topo.is_server or not torch.cuda.is_available():
        return None
    _bound = gpu_index(topo)
    torch.cuda.set_device(_bound)
    return _bound


def configure(topo: Topology, cuda_aware: bool | None) -> None:
    """At ``init()`` on a worker: bind its GPU and decide whether its device buffers go to MPI directly."""
    global _direct
    bind_worker_device(topo)
    _direct = _bound is not None and cuda_aware_mpi(cuda_aware)
    if _bound is not None:
        log.info("IMerge worker %d: cuda:%d, %s", topo.worker_rank, _bound,
                 "device buffers to MPI directly (CUDA-aware MPI)" if _direct
                 else "staged through pinned host memory")


def mpi_reads_device() -> bool:
    """Whether this worker's MPI takes device buffers (``configure``)."""
    return _direct


def bound_device() -> int | None:
    """The GPU ``init()`` bound this worker to (None: no CUDA, or a server)."""
    return _bound


def adopt_bound_device() -> None:
    """Make the calling thread (the comm thread) use the bound GPU too: CUDA's current device is per thread."""
    if _bound is not None:
        torch.cuda.set_device(_bound)


def cuda_aware_mpi(setting: bool | None = None) -> bool:
    """Whether device buffers may go to MPI directly: ``setting`` where given (True is checked
    against the library), else what the MPI library says (``MPIX_Query_cuda_support``, which
    MPICH and Open MPI export). False without CUDA."""
    if not torch.cuda.is_available() or setting is False:
        return False
    supported = _query_cuda_support()
    if setting and not supported:
        log.warning("IMerge: cuda_aware_mpi=True but this MPI library does not report CUDA support "
                    "(MPIX_Query_cuda_support); passing device buffers to it as asked")
    return bool(setting) or supported


def _query_cuda_support() -> bool:
    """Ask the loaded MPI library at run time (a library built with CUDA may still run without it)."""
    for path in _loaded_mpi_libraries():
        try:
            query = getattr(ctypes.CDLL(path), "MPIX_Query_cuda_support", None)
        except OSError:
            continue
        if query is not None:
            query.restype = ctypes.c_int
            return bool(query())
    return False


def _loaded_mpi_libraries() -> list[str]:
    """Paths of the MPI libraries mapped into this process (the one mpi4py loaded)."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "/libmpi" in line}
    except OSError:
        return []
    return sorted(p for p in paths if ".so" in os.path.basename(p))
