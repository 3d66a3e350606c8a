"""Where ranks run: the one line ``init()`` says about the layout, and the checks that refuse a layout
that cannot work as asked (more workers than GPUs on a host, more servers on a host than allowed).

Servers are the last ``num_servers`` world ranks, so where they land is the launcher's rank
mapping; the README's "Choosing and placing servers" has launch lines that put them where wanted.
"""

from __future__ import annotations

from ..core.errors import IMergeConfigError
from .topology import Topology


def host_shapes(topo: Topology) -> dict[str, tuple[int, int, int]]:
    """host -> (workers, servers, GPUs) in the order hosts first appear among the world ranks."""
    shapes: dict[str, list[int]] = {}
    for rank, host in enumerate(topo.hosts):
        shape = shapes.setdefault(host, [0, 0, 0])
        shape[1 if rank >= topo.num_workers else 0] += 1
        shape[2] = max(shape[2], topo.gpus[rank] if topo.gpus else 0)
    return {host: tuple(shape) for host, shape in shapes.items()}


def describe_layout(topo: Topology) -> str:
    """One line: hosts grouped by shape, e.g. ``4 workers + 2 servers on 2 hosts: 2 x (2 workers, 1 server,
    0 GPUs): h0, h1; host aggregation on``."""
    shapes = host_shapes(topo)
    by_shape: dict[tuple[int, int, int], list[str]] = {}
    for host, shape in shapes.items():
        by_shape.setdefault(shape, []).append(host)
    parts = []
    for (workers, servers, gpus), hosts in by_shape.items():
        what = ", ".join(x for x in (_count(workers, "worker"), _count(servers, "server")) if x)
        names = ", ".join(hosts[:4]) + (f", ... ({len(hosts)} hosts)" if len(hosts) > 4 else "")
        parts.append(f"{len(hosts)} x ({what}, {_count(gpus, 'GPU') or '0 GPUs'}): {names}")
    aggregation = ("on: each host sums its workers' gradients, one push per host and key" if topo.aggregate_in_host
                   else "off" if topo.max_local_size > 1 else "not needed (one worker per host)")
    return (f"IMerge layout: {_count(topo.num_workers, 'worker')} + {_count(topo.num_servers, 'server')} on "
            f"{_count(len(shapes), 'host')}: {'; '.join(parts)}; host aggregation {aggregation}")


def _count(n: int, what: str) -> str:
    return f"{n} {what}{'s' if n != 1 else ''}" if n else ""


def check_layout(topo: Topology, servers_per_host: int | None = None, share_gpus: bool = False) -> None:
    """Refuse what cannot run as asked, naming the host and the fix (every rank raises the same error).

    * A host whose workers outnumber its GPUs (where it has any): two workers would share a GPU,
      silently slower and often out of memory. ``share_gpus=True`` allows it.
    * ``servers_per_host``: a host holding more servers than that, because of the launch's rank order
      (servers are the last ranks; a block mapping puts them all on the last host).
    """
    shapes = host_shapes(topo)
    for host, (workers, _, gpus) in shapes.items():
        if gpus and workers > gpus and not share_gpus:
            raise IMergeConfigError(
                f"IMerge: host {host!r} runs {workers} workers but has {gpus} GPU(s): workers would share GPUs. "
                f"Launch at most {gpus} worker(s) per host (MPICH: mpiexec -ppn {gpus}; Open MPI: --map-by "
                f"ppr:{gpus}:node; Slurm: --ntasks-per-node={gpus}), or pass share_gpus=True "
                "(IMERGE_SHARE_GPUS=1) if sharing is intended")
    if servers_per_host is not None:
        crowded = {host: servers for host, (_, servers, _) in shapes.items() if servers > servers_per_host}
        if crowded:
            host, servers = max(crowded.items(), key=lambda item: item[1])
            ranks = [r for r in range(topo.num_workers, topo.world_size) if topo.hosts[r] == host]
            raise IMergeConfigError(
                f"IMerge: host {host!r} holds {servers} servers (world ranks {ranks}) but servers_per_host="
                f"{servers_per_host}: their links share that host's NIC. Servers are the last {topo.num_servers} "
                "world ranks, so the launch's rank order decides their hosts; give each server a host of its own "
                "with an MPMD launch and a host list per block (MPICH: mpiexec -n W -hosts a,b python train.py : "
                "-n S -hosts c,d python -m imerge_hooks.server; Open MPI: a rankfile or --map-by ppr:1:node for "
                "the server block; Slurm: a heterogeneous job), see the README's \"Choosing and placing servers\"")
