"""Lightning cluster environment over IMerge's workers only.

Lightning's own ``MPIEnvironment`` counts every rank of ``MPI.COMM_WORLD``, servers included,
so its world size and ranks are wrong for IMerge. Here the world is the workers: world size =
number of workers, global rank = worker rank. Workers are the first ranks of COMM_WORLD, so
the global rank is the world rank; on a server rank (which never runs the training function)
it is the server's world rank, never zero.

Like ``MPIEnvironment`` it is lazy: building it calls no MPI. The global rank only asks MPI
(starting it if nothing has); the world size and local rank need IMerge's roles and start
IMerge on first use (collective over COMM_WORLD) unless the first Trainer entry point already
did; the node rank is a collective over the workers on first use (the strategy asks for it in
``setup_environment``, where every worker is).
"""

from __future__ import annotations

from collections.abc import Callable

from imerge_hooks.cluster import session, torch_world
from imerge_hooks.cluster.topology import Topology
from imerge_hooks.core._mpi import MPI, ensure_initialized

from ._lightning import ClusterEnvironment
from .serving import start as start_imerge


class IMergeEnvironment(ClusterEnvironment):
    """World = IMerge workers.

    Args:
        start: starts IMerge where the world size or a local rank is read before it runs
            (default: ``imerge_hooks.init`` configured by the ``IMERGE_*`` env vars).
    """

    def __init__(self, start: Callable[[], None] = start_imerge) -> None:
        self._start = start
        self._main: tuple[str, int] | None = None

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
            self.topology()
            self._main = torch_world.master_address_port()
        return self._main

    @staticmethod
    def detect() -> bool:
        return session.is_initialized()

    def world_size(self) -> int:
        return self.topology().num_workers

    def set_world_size(self, size: int) -> None:
        pass  # fixed by the MPI launch

    def global_rank(self) -> int:
        return world_rank()

    def set_global_rank(self, rank: int) -> None:
        pass  # fixed by the MPI launch

    def local_rank(self) -> int:
        topo = self.topology()
        return 0 if topo.is_server else topo.local_rank

    def node_rank(self) -> int:
        """Index of this worker's host among the workers' hosts (``topology.host_name``); 0 on servers."""
        topo = self.topology()
        return 0 if topo.is_server else topo.node_rank

    def topology(self) -> Topology:
        """IMerge's roles, starting IMerge first if it is not running yet (collective over COMM_WORLD)."""
        if not session.is_initialized():
            self._start()
        return session.topology()


def world_rank() -> int:
    """This process's rank in COMM_WORLD; starts MPI if nothing has (no collective)."""
    if session.is_initialized():
        return session.topology().world_rank
    ensure_initialized()
    return MPI.COMM_WORLD.Get_rank()
