"""MPI world -> workers + servers, the hosts they run on, and the communicators each role uses."""

from __future__ import annotations

import functools
import os
import socket
from dataclasses import dataclass, field

from ..core._mpi import MPI
from ..core.errors import IMergeConfigError
from ..core.layout import Placement, key_owner
from .collectives import collective


@dataclass
class Topology:
    """Who is who. The last ``num_servers`` ranks of COMM_WORLD are servers.

    ``data_comm`` is a private duplicate of COMM_WORLD for pushes, results and control
    messages, so user MPI traffic on COMM_WORLD can never match IMerge's messages.
    ``worker_comm`` spans the workers only (MPI_COMM_NULL on servers). ``hosts`` names every
    world rank's host (``host_name``): ranks on one host share its network link. ``local_rank``
    and ``local_size`` count the *workers* on this rank's host (servers take no local rank).
    ``ranks_on_node`` counts the ranks sharing this machine's cores, which is not the same thing
    where several emulated hosts (network namespaces, containers) share one machine.
    """

    world_rank: int
    world_size: int
    num_servers: int
    data_comm: MPI.Comm
    worker_comm: MPI.Comm
    local_rank: int
    local_size: int
    ranks_on_node: int = 1  # workers and servers sharing this machine's cores (decides how to poll)
    hosts: tuple[str, ...] = field(default=())  # host of every world rank
    # Host aggregation (``aggregate_in_host``): the workers of this host, world ranks in local-rank order,
    # and their communicator (MPI_COMM_NULL on servers and where every host holds one worker).
    host_comm: MPI.Comm | None = None
    aggregate_in_host: bool = False
    gpus: tuple[int, ...] = field(default=())  # CUDA devices each world rank sees

    @property
    def host(self) -> str:
        """This rank's host."""
        return self.hosts[self.world_rank] if self.hosts else host_name()

    @property
    def worker_hosts(self) -> list[str]:
        """The workers' hosts, sorted, without repeats (a job's hosts, as the cost-model cache keys them)."""
        return sorted(set(self.hosts[:self.num_workers]))

    @property
    def node_rank(self) -> int:
        """Index of this rank's host among the workers' hosts (Lightning's node rank); 0 on a server's own host."""
        hosts = self.worker_hosts
        return hosts.index(self.host) if self.host in hosts else 0

    @functools.cached_property
    def _workers_by_host(self) -> dict[str, list[int]]:
        by_host: dict[str, list[int]] = {}
        for rank in range(self.num_workers):
            by_host.setdefault(self.hosts[rank], []).append(rank)
        return by_host

    def workers_on(self, host: str) -> list[int]:
        """World ranks of the workers on ``host``, in local-rank order (computed once per topology: the
        servers ask for every key's pushers)."""
        return list(self._workers_by_host.get(host, []))

    @property
    def host_workers(self) -> list[int]:
        """The workers of this rank's host (world ranks, local-rank order); empty on a server's own host."""
        return self.workers_on(self.host) if self.hosts else [self.world_rank]

    @property
    def server_hosts(self) -> list[str]:
        """The host of every server, by server index."""
        return [self.hosts[self.server_world_rank(s)] for s in range(self.num_servers)] if self.hosts else []

    @property
    def max_local_size(self) -> int:
        """The most workers any host holds."""
        return max((len(self.workers_on(h)) for h in self.worker_hosts), default=1)

    @property
    def key_spread(self) -> int:
        """A large group is cut into at least this many keys: one per server and, with host aggregation,
        one per worker of the fullest host (each local worker pushes its share of every group)."""
        return max(self.num_servers, self.max_local_size if self.aggregate_in_host else 1)

    def pushers(self, key: int) -> list[int]:
        """The world ranks that push ``key`` to its server: every worker or, with host aggregation, one
        worker per host, the key's owner there (``layout.key_owner``), which pushes its host's sum."""
        if not self.aggregate_in_host:
            return list(range(self.num_workers))
        return sorted(mates[key_owner(key, len(mates))] for mates in map(self.workers_on, self.worker_hosts))

    @property
    def host_indices(self) -> list[int]:
        """Every world rank's host as an index (order of first appearance): the simulator's ``ClusterSpec.hosts``."""
        index = {h: i for i, h in enumerate(dict.fromkeys(self.hosts))}
        return [index[h] for h in self.hosts] if self.hosts else list(range(self.world_size))

    def placement(self) -> Placement:
        """A key placement (``layout.Placement``) that knows which hosts the servers and pushers are on."""
        pushers = {h: 1 if self.aggregate_in_host else len(self.workers_on(h)) for h in self.worker_hosts}
        return Placement(self.num_servers, self.server_hosts, pushers)

    @functools.cached_property
    def cross(self) -> tuple[int, int, bool]:
        """Horovod's cross rank and cross size (the workers with this worker's local rank, one per host,
        in rank order) and whether every host holds as many workers: read off the hosts, no collective."""
        if not self.hosts:
            return 0, 1, True
        local = {rank: i for host in self.worker_hosts for i, rank in enumerate(self.workers_on(host))}
        peers = [rank for rank in range(self.num_workers) if local[rank] == self.local_rank]
        homogeneous = len({len(self.workers_on(host)) for host in self.worker_hosts}) == 1
        return (peers.index(self.world_rank) if self.world_rank in peers else 0), len(peers), homogeneous

    def describe_rank(self, rank: int) -> str:
        """``worker 3 (host a)``: a world rank as messages name it."""
        role = f"server {rank - self.num_workers}" if rank >= self.num_workers else f"worker {rank}"
        return f"{role} (host {self.hosts[rank]})" if self.hosts else role

    @property
    def num_workers(self) -> int:
        return self.world_size - self.num_servers

    @property
    def is_server(self) -> bool:
        return self.world_rank >= self.num_workers

    @property
    def worker_rank(self) -> int:
        if self.is_server:
            raise RuntimeError(f"IMerge: world rank {self.world_rank} is a server, it has no worker rank")
        return self.world_rank

    @property
    def server_index(self) -> int:
        return self.world_rank - self.num_workers

    def server_world_rank(self, server: int) -> int:
        return self.num_workers + server

    @property
    def worker_world_ranks(self) -> list[int]:
        return list(range(self.num_workers))


def build_topology(num_servers: int, timeout_s: float = 600.0, aggregate_in_host: bool = True) -> Topology:
    """Split COMM_WORLD into roles (collective over COMM_WORLD).

    ``aggregate_in_host``: where a host holds several workers they reduce each key inside the host
    first and one of them pushes the host's sum (``worker.host_exchange``); needs servers, off where every host
    holds one worker.

    First every rank's machine is gathered with a deadline (``timeout_s``): it also tells that
    every rank has arrived, before the blocking MPI calls that split the world.
    """
    world = MPI.COMM_WORLD
    size, rank = world.Get_size(), world.Get_rank()
    if num_servers < 0:
        raise IMergeConfigError(f"IMerge: num_servers must be >= 0, got {num_servers}")
    if num_servers >= size and size > 0 and not (size == 1 and num_servers == 0):
        raise IMergeConfigError(
            f"IMerge: num_servers={num_servers} but the MPI world has only {size} rank(s); at least one "
            f"rank must be a worker. Launch more ranks (mpiexec -n {num_servers + 1} or more) or lower "
            "IMERGE_NUM_SERVERS.")
    workers = size - num_servers
    if num_servers == 0 and workers > 1:
        raise IMergeConfigError(
            f"IMerge: {workers} workers were launched but no parameter server. Set IMERGE_NUM_SERVERS "
            f"(e.g. `mpiexec -n {workers + 1} -env IMERGE_NUM_SERVERS 1 python train.py` with MPICH, "
            f"`mpirun -np {workers + 1} -x IMERGE_NUM_SERVERS=1 ...` with Open MPI) or pass "
            "num_servers to imerge_hooks.init().")
    ranks = collective(world, "allgather", (machine_identity(), host_name(), visible_gpus()),
                       "the ranks' machines and hosts", timeout_s=timeout_s, ranks="world rank")
    machines = [machine for machine, _, _ in ranks]
    hosts = tuple(host for _, host, _ in ranks)
    gpus = tuple(count for _, _, count in ranks)
    data_comm = world.Dup()
    data_comm.Set_name("imerge-data")
    is_server = rank >= workers
    worker_comm = world.Split(MPI.UNDEFINED if is_server else 0, rank)
    if is_server:
        local_rank, local_size = 0, 1
    else:
        mates = [r for r in range(workers) if hosts[r] == hosts[rank]]
        local_rank, local_size = mates.index(rank), len(mates)
    worker_hosts = sorted(set(hosts[:workers]))
    aggregate = bool(aggregate_in_host and num_servers and
                     max(hosts[:workers].count(h) for h in worker_hosts) > 1)
    host_comm = None
    if aggregate and not is_server:  # collective over the workers
        host_comm = worker_comm.Split(worker_hosts.index(hosts[rank]), rank)
        host_comm.Set_name("imerge-host")
    everyone_here = world.Split_type(MPI.COMM_TYPE_SHARED, rank)
    # MPI's view of "this node" misses ranks that it was told to treat as remote (separate network
    # namespaces, MPIR_CVAR_NOLOCAL, containers); they still share this machine's cores.
    ranks_on_node = max(everyone_here.Get_size(), machines.count(machines[rank]))
    everyone_here.Free()
    return Topology(rank, size, num_servers, data_comm, worker_comm, local_rank, local_size, ranks_on_node, hosts,
                    host_comm, aggregate, gpus)


def host_name() -> str:
    """The name of this rank's host: ``IMERGE_HOST`` where set, else the machine's host name.

    The one place a rank's host comes from (local ranks, Lightning's node rank, the cost-model cache,
    the rendezvous address, messages). ``IMERGE_HOST`` is for ranks that share one kernel but stand
    for different hosts: network namespaces or containers on one machine (the emulated cluster, tests).
    """
    override = os.environ.get("IMERGE_HOST", "").strip()
    return override or socket.gethostname()


def visible_gpus() -> int:
    """CUDA devices this rank sees (0 without CUDA); counted without creating a CUDA context."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def machine_identity() -> str:
    """Names this machine (its kernel's boot id), the same in every namespace or container on it."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return socket.gethostname()
