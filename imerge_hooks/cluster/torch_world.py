"""The workers' torch.distributed world (servers are not in it): torchrun's variables, the
rendezvous worker 0 serves (``rendezvous`` chooses its address), and the process group over the workers."""

from __future__ import annotations

import datetime
import logging
import os

from ..core.errors import IMergeConfigError, IMergeUsageError
from . import rendezvous, session
from .backend import worker_backend
from .collectives import collective
from .topology import Topology

log = logging.getLogger("imerge")


TORCH_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
             "TORCHELASTIC_USE_AGENT_STORE")


def torch_env() -> dict[str, str]:
    """torchrun's variables for this worker in the workers-only world (servers are not in it)."""
    topo = session.topology()
    if topo.is_server:
        raise IMergeUsageError(f"IMerge: world rank {topo.world_rank} is a server; it has no torch.distributed rank")
    address, port = master_address_port()
    return {"RANK": str(topo.worker_rank), "WORLD_SIZE": str(topo.num_workers), "LOCAL_RANK": str(topo.local_rank),
            "LOCAL_WORLD_SIZE": str(topo.local_size), "MASTER_ADDR": address, "MASTER_PORT": str(port),
            **rendezvous.environment_store_handoff()}


def export_torch_env() -> None:
    """Set ``TORCH_ENV`` where unset, so scripts written for torchrun (which read ``RANK``,
    ``WORLD_SIZE``, ... to decide whether to run distributed, and ``init_process_group``'s env://
    default) see the workers as their world. A value already set must agree, else
    ``IMergeConfigError`` names the variable, its value and the expected one (on every worker:
    collective over the workers, so no worker goes on to wait for one that raised)."""
    topo = session.topology()
    expected = torch_env()
    wrong = [f"{name}={os.environ[name]!r} (expected {value!r})" for name, value in expected.items()
             if os.environ.get(name) not in (None, value)]
    problems = collective(topo.worker_comm, "allgather", wrong, "the workers' check of RANK, WORLD_SIZE, ...")
    if any(problems):
        said = "; ".join(f"worker {w}: {', '.join(p)}" for w, p in enumerate(problems) if p)
        raise IMergeConfigError(
            f"IMerge: the environment contradicts the workers-only world of {topo.num_workers} worker(s) and "
            f"{topo.num_servers} server(s): {said}. imerge_hooks.init() sets these for torch.distributed where they "
            "are unset; unset them (do not launch under torchrun as well as mpiexec)")
    for name, value in expected.items():
        os.environ.setdefault(name, value)


def worker_group():
    """A torch.distributed process group over the workers only (gloo on CPU, nccl on GPU).

    Collective over workers on first call. If torch.distributed is already initialised with
    world size == number of workers (by the script, e.g. ``init_process_group("gloo")`` with
    the env:// default that ``init()`` set up, or by Lightning), that default group is returned.
    Otherwise it initialises the default group at ``MASTER_ADDR:MASTER_PORT`` (the same
    rendezvous, so a script must not initialise it again afterwards).
    """
    import torch.distributed as dist

    topo = session.topology()
    if session.state.process_group is not None:
        return session.state.process_group
    if dist.is_available() and dist.is_initialized():
        if dist.get_world_size() != topo.num_workers:
            raise IMergeConfigError(
                f"IMerge: torch.distributed is initialised with world size {dist.get_world_size()} but there are "
                f"{topo.num_workers} IMerge workers; initialise it over workers only or let IMerge do it")
        session.state.process_group = dist.group.WORLD
        return session.state.process_group
    address, port = master_address_port()
    backend = worker_backend(topo)
    timeout_s = session.config().timeout_s
    store = session.state.store
    if store is None:  # not worker 0, which serves it
        store = rendezvous.client_store(address, port, topo.num_workers, timeout_s)
    # Its collectives (DDP's, Lightning's sync_dist, barriers) are bounded by timeout_s like IMerge's own.
    dist.init_process_group(backend, store=store, rank=topo.worker_rank, world_size=topo.num_workers,
                            timeout=datetime.timedelta(seconds=timeout_s))
    session.state.process_group = dist.group.WORLD
    session.state.own_process_group = True
    return session.state.process_group


def master_address_port() -> tuple[str, int]:
    """Worker 0's address and the port of its store: the workers' torch.distributed rendezvous,
    agreed by all workers in ``init()`` (``rendezvous``)."""
    topo = session.topology()
    if topo.is_server:
        raise IMergeUsageError("IMerge: servers have no torch.distributed rendezvous (workers only)")
    if session.state.master is None:
        raise IMergeConfigError(
            f"IMerge worker {topo.worker_rank}: the workers' torch.distributed store is off (torch_store=False, "
            "IMERGE_TORCH_STORE=0), so IMerge has no rendezvous to offer: initialise torch.distributed yourself "
            "(init_process_group with your own MASTER_ADDR and MASTER_PORT, over the workers only) before "
            "worker_group(), the DDP hook or Lightning, or leave torch_store on")
    return session.state.master


def agree_master_address_port(topo: Topology) -> tuple[str, int]:
    """Worker 0's rendezvous address and store port, on every worker (collective over the workers).

    Worker 0 chooses the address (``rendezvous``), listens on it and serves the store; its error,
    if any, goes to every worker, so none waits for a rendezvous that will not come."""
    spans = len(topo.worker_hosts) > 1
    own: rendezvous.Report = (rendezvous.network_stack(), rendezvous.interfaces()) if spans else (None, [])
    reports = collective(topo.worker_comm, "gather", own, "the workers' network interfaces") if spans else None
    value: tuple = (None, None, None)
    if topo.worker_rank == 0:
        try:
            value = (*_serve_rendezvous(topo, spans, own, reports), None)
        except IMergeConfigError as exc:
            value = (None, None, str(exc))
    address, port, error = collective(topo.worker_comm, "bcast", value, "worker 0's address and port")
    if error is not None:
        raise IMergeConfigError(error if topo.worker_rank == 0 else f"IMerge worker {topo.worker_rank}: worker 0 "
                                f"could not set up the rendezvous: {error}")
    if spans and "GLOO_SOCKET_IFNAME" not in os.environ:
        name = rendezvous.interface_towards(address, own[1])
        if name is not None:
            os.environ["GLOO_SOCKET_IFNAME"] = name
    return address, port


def _serve_rendezvous(topo: Topology, spans: bool, own: rendezvous.Report,
                      reports: list | None) -> tuple[str, int]:
    """Worker 0: the address (``MASTER_ADDR``, ``master_interface`` or chosen) and a store listening on it.
    ``reports``: every worker's network stack and interfaces where workers span hosts (one worker per
    other host is asked)."""
    others = rendezvous.other_hosts(own[0], {host: reports[topo.workers_on(host)[0]] for host in topo.worker_hosts
                                             if host != topo.host}) if reports else {}
    if os.environ.get("MASTER_ADDR"):
        text = os.environ["MASTER_ADDR"]
        address = rendezvous.check_address(text, spans, "MASTER_ADDR")
        rendezvous.refuse_held_elsewhere(address, list(others.values()), list(others), f"MASTER_ADDR={text!r}")
        log.info("IMerge worker 0: torch.distributed rendezvous on %s: MASTER_ADDR=%r", address, text)
    else:
        address = rendezvous.choose_address(own[1], list(others.values()), session.config().master_interface, spans,
                                            names=list(others))
        address = rendezvous.check_address(address, spans, "the chosen address")
    port = 0
    if os.environ.get("MASTER_PORT"):
        text = os.environ["MASTER_PORT"]
        if not text.isdigit() or not 0 < int(text) < 65536:
            raise IMergeConfigError(f"IMerge worker 0: MASTER_PORT={text!r} is not a TCP port number")
        port = int(text)
    sock = rendezvous.listen(address, port)
    session.state.store_socket = sock  # the store serves on its file descriptor: the socket must stay open
    session.state.store = rendezvous.serve_store(sock, topo.num_workers, session.config().timeout_s)
    log.debug("IMerge worker 0: torch.distributed store on %s:%d", address, sock.getsockname()[1])
    return address, sock.getsockname()[1]
