"""Process-wide IMerge state: roles, the comm thread, the key table shared by all engines."""

from __future__ import annotations

import atexit
import itertools
import logging
import os
import socket
import sys
import time
from typing import Any

from . import polling
from ._mpi import MPI, ensure_initialized
from .config import Config
from .errors import IMergeConfigError, IMergeError, IMergeMismatchError, IMergeTimeoutError
from .polling import Backoff
from .scheduler import CommThread
from .topology import Topology, build_topology
from .transport import TAG_CONTROL, TAG_DECISION, TAG_REPLY, TAG_TIMELINE, KeySpec, table_to_wire

log = logging.getLogger("imerge")


class _State:
    def __init__(self) -> None:
        self.topology: Topology | None = None
        self.config: Config | None = None
        self.comm_thread: CommThread | None = None
        self.server_program = False
        self.tables: dict[int, list[KeySpec]] = {}  # client id -> its keys
        self.next_key = 0
        self.epoch = 0
        self.clients = itertools.count()
        self.process_group: Any = None
        self.own_process_group = False
        self.shut_down = False
        self.flush_callbacks: list = []
        self.join_callbacks: list = []  # engines finish their iteration before a join
        self.timeline = None  # timeline.Timeline when IMERGE_TIMELINE is set


_state = _State()


def declare_server_program() -> None:
    """Mark this process as ``python -m imerge_hooks.server`` (MPMD launch)."""
    _state.server_program = True


def init(num_servers: int | None = None, *, serve: str = "forever", **config: Any) -> None:
    """Start IMerge on every rank of COMM_WORLD (collective).

    The last ``num_servers`` ranks (default: ``IMERGE_NUM_SERVERS``, or the ranks launched as
    ``python -m imerge_hooks.server`` in an MPMD job, or 0) become parameter servers: on them
    ``init`` serves until every worker has shut down and then exits the process with code 0.
    On workers it returns. A second call on a worker is a no-op.
    """
    if _state.topology is not None:
        return
    cfg = Config.from_env(num_servers=num_servers, **config)
    ensure_initialized()
    world = MPI.COMM_WORLD
    flags = world.allgather(_state.server_program)
    if any(flags):
        declared = sum(flags)
        if flags != [False] * (len(flags) - declared) + [True] * declared:
            raise IMergeConfigError("IMerge: in an MPMD launch the `python -m imerge_hooks.server` ranks must come "
                                    f"last (launched per rank as servers: {flags})")
        if cfg.num_servers not in (None, declared):
            raise IMergeConfigError(f"IMerge: num_servers={cfg.num_servers} but {declared} rank(s) were launched as "
                                    "`python -m imerge_hooks.server`")
        cfg = cfg.replace(num_servers=declared)
    elif cfg.num_servers is None:
        cfg = cfg.replace(num_servers=0)
    topo = build_topology(int(cfg.num_servers))
    _state.topology, _state.config = topo, cfg
    _setup_logging()
    chosen = polling.configure(cfg.polling, topo.ranks_on_node)
    log.debug("IMerge rank %d: polling mode %s (%d ranks on this host, %d usable cores)",
              topo.world_rank, chosen, topo.ranks_on_node, polling.usable_cores())
    if cfg.timeline:
        from .timeline import Timeline

        if topo.is_server:
            _state.timeline = Timeline(f"server {topo.server_index}", 1000 + topo.server_index)
        else:
            _state.timeline = Timeline(f"worker {topo.worker_rank}", topo.worker_rank)
    if topo.is_server:
        if serve == "forever":
            serve_until_shutdown()
            raise SystemExit(0)
        return
    if topo.num_servers > 0:
        on_event = _timeline_comm_event if _state.timeline is not None else None
        _state.comm_thread = CommThread(topo.data_comm, topo.worker_rank, topo.num_workers, topo.num_servers,
                                        topo.server_world_rank, cfg.timeout_s, on_event=on_event)
    atexit.register(shutdown)


def serve_until_shutdown() -> None:
    """Run the server loop until every worker shut down (server ranks only)."""
    from .server import Server

    server = getattr(_state, "server", None) or Server(topology(), config())
    server.serve("shutdown")
    _state.shut_down = True
    _send_server_timeline()


def timeline():
    """This rank's Timeline, or None when IMERGE_TIMELINE is not set."""
    return _state.timeline


def _timeline_comm_event(kind: str, group, slot: int, start: float, end: float) -> None:
    if kind == "done":
        spec = group.keys[slot]
        _state.timeline.span(f"push+pull key {spec.key} -> server {spec.server}", "comm", start, end, "comm")


def _send_server_timeline() -> None:
    if _state.timeline is not None:
        from .timeline import export

        topology().data_comm.send(export(_state.timeline), dest=0, tag=TAG_TIMELINE)


def serve_stage() -> str:
    """Serve until every worker ends the current stage or shuts down; returns which."""
    from .server import Server

    server = getattr(_state, "server", None)
    if server is None:
        server = _state.server = Server(topology(), config())
    why = server.serve("stage")
    if why == "shutdown":
        _state.shut_down = True
        _send_server_timeline()
    return why


def end_stage() -> None:
    """Tell every server this worker finished a stage (Lightning entry points)."""
    flush_all()
    _control_all({"op": "stage_end"})


def _setup_logging() -> None:
    level = os.environ.get("IMERGE_LOG_LEVEL")
    logger = logging.getLogger("imerge")
    if level:
        logger.setLevel(level.upper())
    if not logger.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler(sys.stderr)
        role = "server" if _state.topology.is_server else "worker"
        index = _state.topology.server_index if _state.topology.is_server else _state.topology.world_rank
        handler.setFormatter(logging.Formatter(f"[imerge {role} {index}] %(levelname)s %(message)s"))
        logger.addHandler(handler)
        if not level:
            logger.setLevel(logging.WARNING)


# ---------------------------------------------------------------------- accessors
def topology() -> Topology:
    if _state.topology is None:
        raise IMergeError("IMerge is not initialised: call imerge_hooks.init() first")
    return _state.topology


def config() -> Config:
    topology()
    return _state.config


def comm_thread() -> CommThread | None:
    return _state.comm_thread


def is_initialized() -> bool:
    return _state.topology is not None


def new_client_id() -> int:
    return next(_state.clients)


def allocate_keys(count: int) -> list[int]:
    """Fresh key ids (identical on all workers as long as they allocate in the same order)."""
    start = _state.next_key
    _state.next_key += count
    return list(range(start, start + count))


def add_flush_callback(fn) -> None:
    _state.flush_callbacks.append(fn)


def remove_callbacks(*fns) -> None:
    """Unregister flush/join callbacks of a retired engine (missing ones are ignored)."""
    for lst in (_state.flush_callbacks, _state.join_callbacks):
        lst[:] = [f for f in lst if f not in fns]


def flush_all() -> None:
    """Apply every pending (deferred) update; anything that reads parameters calls this."""
    for fn in list(_state.flush_callbacks):
        fn()


# ---------------------------------------------------------------------- key table
def register_keys(client: int, keys: list[KeySpec]) -> int:
    """Install ``client``'s keys as part of a new numbered plan epoch on every server.

    Collective over workers: every worker registers the same change at the same point.
    Returns the new epoch. Raises IMergeMismatchError naming the tensor, worker and server
    if workers disagree.
    """
    topo = topology()
    _state.tables[client] = keys
    _state.epoch += 1
    if topo.num_servers == 0:
        return _state.epoch
    table = [k for c in sorted(_state.tables) for k in _state.tables[c]]
    request = {"op": "register", "epoch": _state.epoch, "keys": table_to_wire(table), "worker": topo.worker_rank}
    comm = topo.data_comm
    for server in range(topo.num_servers):
        comm.send(request, dest=topo.server_world_rank(server), tag=TAG_CONTROL)
    errors = []
    for server in range(topo.num_servers):
        reply = _recv_with_timeout(comm, topo.server_world_rank(server), TAG_REPLY,
                                   f"the answer of server {server} to plan epoch {_state.epoch}")
        if reply.get("op") == "error":
            errors.append(reply["message"])
    if errors:
        raise IMergeMismatchError(f"IMerge worker {topo.worker_rank}: " + "; ".join(dict.fromkeys(errors)))
    return _state.epoch


def _recv_with_timeout(comm: MPI.Comm, source: int, tag: int, what: str) -> Any:
    """A pickled message of any size, polled with back-off (no spinning) until the timeout.

    A matched probe, not ``irecv``: mpi4py's ``irecv`` without a buffer truncates messages
    over 32 KiB (a server's timeline, a large plan)."""
    deadline = time.monotonic() + config().timeout_s
    backoff = Backoff()
    while True:
        message = comm.improbe(source=source, tag=tag)
        if message is not None:
            return message.recv()
        if time.monotonic() > deadline:
            raise IMergeTimeoutError(f"IMerge worker {topology().worker_rank}: waited {config().timeout_s:.0f} s for "
                                     f"{what}; some worker did not reach the same point, or a server is gone")
        backoff.idle()


def from_worker0(value: Any, what: str) -> Any:
    """Worker 0's ``value`` on every worker (collective over workers; others pass anything).

    Used where worker 0 computes something the others wait for, such as the fusion plan
    (seconds of simulation). MPICH's blocking ``bcast`` polls a core at full speed; on a host
    with more ranks than cores the waiting workers would starve worker 0's computation (W=16
    on 2 cores: the plan search took about 2 minutes instead of 7 s). Here they wait with
    back-off, and time out naming ``what`` instead of hanging if worker 0 never sends.
    """
    topo = topology()
    if topo.num_workers == 1:
        return value
    comm = topo.worker_comm
    if topo.worker_rank != 0:
        return _recv_with_timeout(comm, 0, TAG_DECISION, f"{what} from worker 0")
    requests = [comm.isend(value, dest=r, tag=TAG_DECISION) for r in range(1, topo.num_workers)]
    deadline = time.monotonic() + config().timeout_s
    backoff = Backoff()
    while requests:
        requests = [r for r in requests if not r.test()[0]]
        if requests and time.monotonic() > deadline:
            raise IMergeTimeoutError(f"IMerge worker 0: {len(requests)} worker(s) did not take {what} within "
                                     f"{config().timeout_s:.0f} s")
        backoff.idle()
    return value


def _control_all(message: dict) -> None:
    topo = topology()
    for server in range(topo.num_servers):
        topo.data_comm.send(message, dest=topo.server_world_rank(server), tag=TAG_CONTROL)


def join() -> int:
    """This worker ran out of data: let the others finish their iterations, then return.

    Until every worker has joined, this worker's missing pushes count as zero contributions
    and the servers average over the workers that contributed. Returns the rank of the
    worker that joined last. Plan changes must not happen while a worker has joined.
    """
    topo = topology()
    flush_all()
    for fn in list(_state.join_callbacks):
        fn()
    if topo.num_servers == 0:
        return topo.worker_rank
    _control_all({"op": "join"})
    last = -1
    for server in range(topo.num_servers):
        reply = _recv_with_timeout(topo.data_comm, topo.server_world_rank(server), TAG_REPLY,
                                   f"server {server} to report that every worker joined")
        last = reply.get("last", last)
    return last


# ---------------------------------------------------------------------- torch.distributed
def worker_group():
    """A torch.distributed process group over the workers only (gloo on CPU, nccl on GPU).

    Collective over workers on first call. If torch.distributed is already initialised with
    world size == number of workers (e.g. by Lightning), that default group is returned.
    """
    import torch
    import torch.distributed as dist

    topo = topology()
    if _state.process_group is not None:
        return _state.process_group
    if dist.is_available() and dist.is_initialized():
        if dist.get_world_size() != topo.num_workers:
            raise IMergeConfigError(
                f"IMerge: torch.distributed is initialised with world size {dist.get_world_size()} but there are "
                f"{topo.num_workers} IMerge workers; initialise it over workers only or let IMerge do it")
        _state.process_group = dist.group.WORLD
        return _state.process_group
    address, port = master_address_port()
    backend = "nccl" if torch.cuda.is_available() and os.environ.get("IMERGE_BACKEND", "") != "gloo" else "gloo"
    backend = os.environ.get("IMERGE_BACKEND", backend)
    dist.init_process_group(backend, init_method=f"tcp://{address}:{port}", rank=topo.worker_rank,
                            world_size=topo.num_workers)
    _state.process_group = dist.group.WORLD
    _state.own_process_group = True
    return _state.process_group


def master_address_port() -> tuple[str, int]:
    """Worker 0's address and a free port on it, agreed by all workers over MPI."""
    topo = topology()
    hosts = topo.worker_comm.allgather(socket.gethostname())
    if topo.worker_rank == 0:
        if os.environ.get("MASTER_ADDR"):
            address = os.environ["MASTER_ADDR"]
        elif len(set(hosts)) == 1:
            address = "127.0.0.1"
        else:
            address = socket.gethostbyname(socket.gethostname())
        if os.environ.get("MASTER_PORT"):
            port = int(os.environ["MASTER_PORT"])
        else:
            with socket.socket() as s:
                s.bind(("", 0))
                port = s.getsockname()[1]
        value = (address, port)
    else:
        value = None
    return topo.worker_comm.bcast(value, root=0)


# ---------------------------------------------------------------------- shutdown
def shutdown() -> None:
    """Flush pending updates, stop the comm thread and release the servers (workers)."""
    if _state.topology is None or _state.shut_down:
        return
    topo = _state.topology
    if topo.is_server:
        return
    _state.shut_down = True
    failed = _state.comm_thread.failed if _state.comm_thread else None
    try:
        if failed is None:
            flush_all()
    finally:
        if _state.comm_thread is not None:
            _state.comm_thread.stop()
        _control_all({"op": "shutdown"})
        if _state.timeline is not None:
            _write_timeline()
        if _state.own_process_group:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()


def _write_timeline() -> None:
    """Gather every rank's events on worker 0 and write one Chrome trace."""
    from .timeline import export, write_trace

    topo = topology()
    parts = topo.worker_comm.gather(export(_state.timeline), root=0)
    if topo.worker_rank != 0:
        return
    for server in range(topo.num_servers):
        parts.append(_recv_with_timeout(topo.data_comm, topo.server_world_rank(server), TAG_TIMELINE,
                                        f"the timeline of server {server}"))
    write_trace(config().timeline, parts)
    log.warning("IMerge: timeline written to %s", config().timeline)
