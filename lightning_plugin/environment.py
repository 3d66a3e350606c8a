"""Lightning cluster environment over IMerge's workers only.

Lightning's own ``MPIEnvironment`` counts every rank of ``MPI.COMM_WORLD``, servers included,
so its world size and ranks are wrong for IMerge. Here the world is the workers: world size =
number of workers, global rank = worker rank. On a server rank (which never runs the training
function) ``global_rank()`` is the server's world rank, so it is never mistaken for rank zero.
"""

from __future__ import annotations

import socket

from lightning_fabric.plugins.environments import ClusterEnvironment

import imerge_hooks
from imerge_hooks import runtime


class IMergeEnvironment(ClusterEnvironment):
    """World = IMerge workers. Create it after ``imerge_hooks.init()`` (collective over workers)."""

    def __init__(self) -> None:
        topo = runtime.topology()
        self._server = topo.is_server
        self._world_rank = topo.world_rank
        self._main: tuple[str, int] | None = None
        if self._server:
            self._node_rank = 0
        else:
            hosts = runtime.collective(topo.worker_comm, "allgather", socket.gethostname(), "the workers' host names")
            self._node_rank = sorted(set(hosts)).index(hosts[topo.worker_rank])

    @property
    def creates_processes_externally(self) -> bool:
        return True  # mpiexec starts every rank

    @property
    def main_address(self) -> str:
        return self._main_address_port()[0]

    @property
    def main_port(self) -> int:
        return self._main_address_port()[1]

    def _main_address_port(self) -> tuple[str, int]:
        # Collective over the workers on first use; Lightning reads both at the same point on every rank.
        if self._main is None:
            self._main = runtime.master_address_port()
        return self._main

    @staticmethod
    def detect() -> bool:
        return runtime.is_initialized()

    def world_size(self) -> int:
        return runtime.topology().num_workers

    def set_world_size(self, size: int) -> None:
        pass  # fixed by the MPI launch

    def global_rank(self) -> int:
        return self._world_rank if self._server else imerge_hooks.rank()

    def set_global_rank(self, rank: int) -> None:
        pass  # fixed by the MPI launch

    def local_rank(self) -> int:
        return 0 if self._server else imerge_hooks.local_rank()

    def node_rank(self) -> int:
        return self._node_rank
