"""Process-wide IMerge state: roles, the comm thread, the key table shared by all engines."""

from __future__ import annotations

import atexit
import datetime
import hashlib
import itertools
import logging
import os
import sys
import time
from typing import Any

from . import collectives, devices, polling, rendezvous
from ._mpi import MPI, ensure_initialized
from .collectives import collective
from .comm import CommThread
from .config import PROCESS_OPTIONS, Config
from .errors import IMergeConfigError, IMergeError, IMergeMismatchError, IMergeTimeoutError, IMergeUsageError
from .failure import abort, fatal_error, install_excepthooks, record_fatal, set_identity, whoami
from .placement import check_layout, describe_layout
from .polling import DeadlineWait
from .topology import Topology, build_topology
from .wire import (
    KEY_TAG_BASE,
    ROUND_TAGS,
    TAG_COLLECTIVE,
    TAG_CONTROL,
    TAG_DECISION,
    TAG_HOST_SHUTDOWN,
    TAG_REPLY,
    TAG_TIMELINE,
    KeySpec,
    table_to_wire,
)

log = logging.getLogger("imerge")


class _State:
    def __init__(self) -> None:
        self.topology: Topology | None = None
        self.config: Config | None = None
        self.comm_thread: CommThread | None = None
        self.server_program = False
        self.tables: dict[int, list[KeySpec]] = {}  # client id -> its keys
        self.explicit: dict[str, Any] = {}  # the options given to init() (explicit beats env)
        self.tensor_tables: dict[int, list[tuple]] = {}  # client id -> (name, shape, dtype) per tensor
        self.next_key = 0
        self.epoch = 0
        self.clients = itertools.count()
        self.process_group: Any = None
        self.own_process_group = False
        self.store = None  # worker 0: the workers' torch.distributed store it serves (rendezvous)
        self.store_socket = None
        self.master: tuple[str, int] | None = None  # the workers' torch.distributed rendezvous (worker 0)
        self.shut_down = False
        self.flush_callbacks: list = []
        self.join_callbacks: list = []  # engines finish their iteration before a join
        self.after_join_callbacks: list = []  # fn(last joiner): engines take its parameters
        self.shadow_callbacks: list = []  # fn(wait) -> workers that trained: engines shadow a round in join()
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
    On workers it returns, in a job of several ranks with torchrun's variables set for the
    workers-only world (``export_torch_env``). A second call on a worker is a no-op. In a job of several ranks an
    uncaught exception in any thread then aborts the whole MPI job (``_install_excepthooks``).
    """
    if _state.topology is not None:
        return
    cfg = Config.from_env(num_servers=num_servers, **config)
    _state.explicit = {k: v for k, v in config.items() if v is not None}
    ensure_initialized()
    world = MPI.COMM_WORLD
    if world.Get_size() > 1:
        install_excepthooks()
    flags = collective(world, "allgather", _state.server_program, "the roles the ranks were launched as",
                       timeout_s=cfg.timeout_s, ranks="world rank")
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
    _state.explicit["num_servers"] = cfg.num_servers
    collectives.configure(cfg.timeout_s)
    topo = build_topology(int(cfg.num_servers), timeout_s=cfg.timeout_s, aggregate_in_host=cfg.host_aggregation)
    _state.topology, _state.config = topo, cfg
    set_identity(topo)
    _setup_logging()
    check_layout(topo, cfg.servers_per_host, cfg.share_gpus)
    if not topo.is_server:
        devices.configure(topo, cfg.cuda_aware_mpi)
    if topo.world_rank == 0 and topo.world_size > 1 and log.isEnabledFor(logging.WARNING):
        print(describe_layout(topo), file=sys.stderr, flush=True)
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
    _state.master = _agree_master_address_port(topo)
    if topo.world_size > 1:  # launched as a job; `python train.py` alone stays a plain single process
        export_torch_env()
    if topo.num_servers > 0:
        on_event = _timeline_comm_event if _state.timeline is not None else None
        _state.comm_thread = CommThread(topo.data_comm, topo.worker_rank, topo.num_workers, topo.num_servers,
                                        topo.server_world_rank, cfg.timeout_s, on_event=on_event,
                                        host_comm=topo.host_comm, host_workers=topo.host_workers,
                                        describe=topo.describe_rank)
    atexit.register(shutdown)


def run_server_program() -> None:
    """``python -m imerge_hooks.server`` / ``imerge-server`` (MPMD launch): serve, then exit 0."""
    declare_server_program()
    init()
    raise SystemExit(0)  # init() does not return on a server; this is a safety net


def serve_until_shutdown() -> None:
    """Run the server loop until every worker shut down (server ranks only)."""
    from .server import Server

    server = getattr(_state, "server", None) or Server(topology(), config(), _state.timeline)
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

        payload = MPI.pickle.dumps(export(_state.timeline))
        comm = topology().data_comm
        collectives.wait_for(comm, [], {0: comm.Issend([payload, MPI.BYTE], dest=0, tag=TAG_TIMELINE)}, TAG_TIMELINE,
               "sending this server's timeline to worker 0", None, "world rank")


def serve_stage() -> str:
    """Serve until every worker ends the current stage or shuts down; returns which."""
    from .server import Server

    server = getattr(_state, "server", None)
    if server is None:
        server = _state.server = Server(topology(), config(), _state.timeline)
    why = server.serve("stage")
    if why == "shutdown":
        _state.shut_down = True
        _send_server_timeline()
    return why


def end_stage(result: bytes | None = None) -> None:
    """Tell every server this worker finished a stage (Lightning entry points); ``result`` (pickled
    by the caller, e.g. worker 0's return value of the entry point) goes with it: ``stage_result()``."""
    flush_all("the end of a stage")
    _control_all({"op": "stage_end"} if result is None else {"op": "stage_end", "result": result})


def stage_result() -> bytes | None:
    """On a server, after ``serve_stage()`` returned "stage": the ``result`` worker 0 ended it with."""
    server = getattr(_state, "server", None)
    return None if server is None else server.stage_results.pop(server.stages_served - 1, None)


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


def engine_config(where: str, **options: Any) -> Config:
    """The settings of one engine (``where`` names its front end in errors).

    One precedence rule for every option: an explicit argument (the engine's, then ``init()``'s)
    > its ``IMERGE_*`` env var > the default. Process options (``PROCESS_OPTIONS``) belong to
    ``init()``: passing one to an engine is an error that says so, not silently ignored.
    """
    config()
    given = {k: v for k, v in options.items() if v is not None}
    misplaced = sorted(given.keys() & PROCESS_OPTIONS)
    if misplaced:
        raise IMergeConfigError(f"IMerge: {', '.join(misplaced)}: process option(s) that {where} cannot change; "
                                f"pass them to imerge_hooks.init() or set IMERGE_{misplaced[0].upper()}")
    return Config.from_env(None, **{**_state.explicit, **given})


def init_option(name: str) -> Any:
    """The value ``init()`` was given for engine option ``name`` (None: not given)."""
    return _state.explicit.get(name)


def comm_thread() -> CommThread | None:
    return _state.comm_thread


def is_initialized() -> bool:
    return _state.topology is not None


def new_client_id() -> int:
    return next(_state.clients)


def allocate_keys(count: int) -> list[int]:
    """Key ids not used by any registered table (identical on all workers as long as they
    allocate in the same order).

    Ids count up; a key's tags must stay within the MPI's ``MPI_TAG_UB`` (the standard promises
    only 32767), so past ``key_capacity()`` the count wraps and skips the ids that registered
    tables still use: every plan epoch allocates anew, and a long job would otherwise run out.
    """
    capacity = key_capacity()
    in_use = {k.key for table in _state.tables.values() for k in table}
    if count > capacity - len(in_use):
        raise IMergeConfigError(f"IMerge: {count} more keys do not fit in this MPI's tag space ({capacity} keys, "
                                f"{len(in_use)} in use; MPI_TAG_UB); raise partition_bytes or fuse more")
    ids, key = [], _state.next_key
    while len(ids) < count:
        key = 0 if key >= capacity else key
        if key not in in_use:
            ids.append(key)
        key += 1
    _state.next_key = key
    return ids


def key_capacity() -> int:
    """How many key ids this MPI's tag space holds (each key uses ``ROUND_TAGS`` tags)."""
    tag_ub = MPI.COMM_WORLD.Get_attr(MPI.TAG_UB) if MPI.Is_initialized() else 32767
    return (int(tag_ub) - KEY_TAG_BASE + 1) // ROUND_TAGS


def add_flush_callback(fn) -> None:
    _state.flush_callbacks.append(fn)


def remove_callbacks(*fns) -> None:
    """Unregister flush/join callbacks of a retired engine (missing ones are ignored)."""
    for lst in (_state.flush_callbacks, _state.join_callbacks, _state.after_join_callbacks, _state.shadow_callbacks):
        lst[:] = [f for f in lst if f not in fns]


def flush_all(reason: str = "imerge_hooks.flush_all()") -> None:
    """Apply every pending (deferred) update; anything that reads parameters calls this.

    ``reason`` names the caller: updates applied outside the forward are counted by it and the
    first one is logged (``GradientEngine.flush_deferred``)."""
    for fn in list(_state.flush_callbacks):
        fn(reason)


# ---------------------------------------------------------------------- key table
def register_keys(client: int, keys: list[KeySpec], tensors: list[tuple[str, tuple, str]] | None = None) -> int:
    """Install ``client``'s keys as part of a new numbered plan epoch on every server.

    Collective over workers: every worker registers the same change at the same point.
    ``tensors`` is the client's (name, shape, dtype) per tensor, in its order: the servers
    compare it across workers too (shapes and order that the keys' byte counts cannot show).
    Returns the new epoch. Raises IMergeMismatchError naming the tensor, worker and server
    if workers disagree.
    """
    topo = topology()
    _state.tables[client] = keys
    _state.tensor_tables[client] = list(tensors or [])
    _state.epoch += 1
    if topo.num_servers == 0:
        return _state.epoch
    table = [k for c in sorted(_state.tables) for k in _state.tables[c]]
    described = [t for c in sorted(_state.tensor_tables) for t in _state.tensor_tables[c]]
    wire = table_to_wire(table)
    request = {"op": "register", "epoch": _state.epoch, "keys": wire, "worker": topo.worker_rank,
               "tensors": described, "digest": hashlib.sha1(repr((wire, described)).encode()).hexdigest()}
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
        _state.tables.pop(client, None)  # refused: later registrations must not carry it
        _state.tensor_tables.pop(client, None)
        raise IMergeMismatchError(f"IMerge worker {topo.worker_rank}: " + "; ".join(dict.fromkeys(errors)))
    return _state.epoch


def unregister_keys(client: int) -> None:
    """``client`` is retired: the servers free its keys (collective over workers, a plan epoch)."""
    register_keys(client, [])
    _state.tables.pop(client, None)
    _state.tensor_tables.pop(client, None)


def _recv_with_timeout(comm: MPI.Comm, source: int, tag: int, what: str, fatal: bool = True) -> Any:
    """A pickled message of any size, polled with back-off (no spinning) until the timeout.

    A matched probe, not ``irecv``: mpi4py's ``irecv`` without a buffer truncates messages
    over 32 KiB (a server's timeline, a large plan). ``fatal``: the timeout means a server is
    gone or stuck, so ``shutdown()`` aborts the job rather than wait for it in MPI_Finalize."""
    wait = DeadlineWait(config().timeout_s)
    while True:
        message = comm.improbe(source=source, tag=tag)
        if message is not None:
            return message.recv()
        if wait.expired():
            error = IMergeTimeoutError(f"IMerge worker {topology().worker_rank}: waited {config().timeout_s:.0f} s for "
                                       f"{what}; some worker did not reach the same point, or a server is gone")
            raise record_fatal(error) if fatal else error
        wait.idle()


def from_worker0(value: Any, what: str) -> Any:
    """Worker 0's ``value`` on every worker (collective over workers; others pass anything).

    Used where worker 0 computes something the others wait for, such as the fusion plan
    (seconds of simulation). MPICH's blocking ``bcast`` polls a core at full speed; on a host
    with more ranks than cores the waiting workers would starve worker 0's computation
    (``tests/test_handoff.py`` bounds the waiting workers' CPU). Here they wait with
    back-off, and time out naming ``what`` instead of hanging if worker 0 never sends. The value goes
    down a binomial tree (``collectives.tree_links``): each worker passes it on to its children, so
    worker 0 sends O(log W) messages, not W - 1.
    """
    topo = topology()
    if topo.num_workers == 1:
        return value
    comm = topo.worker_comm
    parent, children = collectives.tree_links(topo.worker_rank, topo.num_workers)
    if parent is not None:
        # Not fatal: nothing is left pending, and worker 0 may only be on another code path.
        value = _recv_with_timeout(comm, parent, TAG_DECISION, f"{what} from worker 0 (through worker {parent})",
                                   fatal=False)
    requests = [comm.isend(value, dest=r, tag=TAG_DECISION) for r in children]
    wait = DeadlineWait(config().timeout_s)
    while requests:
        requests = [r for r in requests if not r.test()[0]]
        if requests and wait.expired():
            raise record_fatal(IMergeTimeoutError(f"IMerge worker {topo.worker_rank}: {len(requests)} worker(s) did "
                                                  f"not take {what} within {wait.limit_s:.0f} s"))
        wait.idle()
    return value


def _control_all(message: dict) -> None:
    topo = topology()
    for server in range(topo.num_servers):
        topo.data_comm.send(message, dest=topo.server_world_rank(server), tag=TAG_CONTROL)


def join() -> int:
    """This worker ran out of data; returns when every worker has called ``join()``.

    Every worker calls it when its data ends, as with Horovod's ``hvd.join()`` or DDP's
    ``Join``. Until every worker has joined, a joined worker's missing pushes count as zeros
    and the servers divide by the number of workers (``join_divisor="active"``: by those that
    pushed). When it returns, every worker holds the parameters of the worker that joined
    last (and its step count); it returns that worker's rank. A plan change while a worker
    waits here (the end of ``profile_steps``) raises at once on that worker.
    """
    topo = topology()
    flush_all("join()")
    for fn in list(_state.join_callbacks):
        fn()
    if topo.num_servers == 0:
        return topo.worker_rank
    _control_all({"op": "join"})
    if topo.aggregate_in_host:
        _shadow_until_all_joined(topo)
    last = _wait_until_all_joined(topo)
    for fn in list(_state.after_join_callbacks):
        fn(last)
    return last


JOIN_GRACE_S = 2.0  # a collective seen while waiting in join() is another worker's only if no answer follows


def _shadow_until_all_joined(topo: Topology) -> None:
    """Host aggregation: take part in the others' rounds with zeros until one in which no worker trained.

    A joined worker's host still sums each key over all its workers, and the worker owns some of
    its host's keys, so it shadows every round, engine after engine in the order the others step
    them (``engine.shadow_round``). The last worker to join shadows one round too: every worker
    sees it end with nobody training, and all stop at the same round, with nothing left in flight.
    """
    # A worker that saw the last round end first may already broadcast the last joiner's parameters
    # while this one waits for that round's results: a longer grace than the servers' answers need.
    watch = _StrayCollective(topo, grace_s=5 * JOIN_GRACE_S)

    def wait(group) -> None:
        limit = DeadlineWait(config().timeout_s)
        while not group.done.wait(0.02):
            _state.comm_thread.raise_if_failed()
            watch.check()
            if limit.expired():
                raise record_fatal(IMergeTimeoutError(
                    f"{whoami()}: waited {limit.limit_s:.0f} s in join() for the next step of the workers that "
                    "still train: every worker must call imerge_hooks.join() when its data ends"))
        _state.comm_thread.raise_if_failed()

    while True:
        counts = [shadow(wait) for shadow in list(_state.shadow_callbacks)]
        if not counts or any(c == 0 for c in counts if c is not None) or all(c is None for c in counts):
            return


class _StrayCollective:
    """Raises when another worker starts a collective while this one waits in join() (module doc of
    ``_wait_until_all_joined``)."""

    def __init__(self, topo: Topology, grace_s: float = JOIN_GRACE_S) -> None:
        self.topo = topo
        self.grace_s = grace_s
        self.since: float | None = None

    def check(self, applies: bool = True) -> None:
        """``applies``: whether a collective message now means a stray one (see the callers)."""
        stray = _collective_sender(self.topo.worker_comm)
        now = time.monotonic()
        if stray is None or not applies:
            return
        self.since = self.since or now
        if now - self.since > self.grace_s:
            raise record_fatal(IMergeUsageError(
                f"{whoami()} waits in join() (out of data) while worker {stray} started a collective step "
                "that needs every worker (a plan change at the end of profile_steps, a broadcast, "
                "calibration): workers must not change plans or run collectives while another has joined; make "
                "profile_steps smaller than the shortest worker's number of steps"))


def _wait_until_all_joined(topo: Topology) -> int:
    """Every server's answer that all workers joined; raise if another worker starts a collective.

    A worker in join() takes part in no collective, so another worker that starts one (the plan
    hand-off or calibration at the end of ``profile_steps``) would wait for it until ``timeout_s``.
    Such a message is an error unless the servers' answers follow within ``JOIN_GRACE_S`` (a
    worker that was told first may already be in the collective that ends ``join()``).
    """
    wait = DeadlineWait(config().timeout_s)
    waiting, last = list(range(topo.num_servers)), -1
    watch = _StrayCollective(topo)
    while waiting:
        for server in list(waiting):
            message = topo.data_comm.improbe(source=topo.server_world_rank(server), tag=TAG_REPLY)
            if message is not None:
                reply = message.recv()
                if reply.get("op") == "error":
                    raise record_fatal(IMergeUsageError(f"{whoami()}: join(): {reply['message']}"))
                last = reply.get("last", last)
                waiting.remove(server)
                wait.reset()
        watch.check(applies=len(waiting) == topo.num_servers)
        now = time.monotonic()
        if wait.expired(now):
            raise record_fatal(IMergeTimeoutError(
                f"{whoami()}: waited {wait.limit_s:.0f} s in join() for server(s) {waiting} to report that "
                "every worker joined: every worker must call imerge_hooks.join() when its data ends"))
        wait.idle()
    return last


def _collective_sender(comm: MPI.Comm) -> int | None:
    """The rank of a pending collective or plan hand-off message to this worker, if any."""
    status = MPI.Status()
    for tag in (TAG_COLLECTIVE, TAG_DECISION):
        if comm.iprobe(source=MPI.ANY_SOURCE, tag=tag, status=status):
            return status.Get_source()
    return None


# ---------------------------------------------------------------------- torch.distributed
TORCH_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
             "TORCHELASTIC_USE_AGENT_STORE")


def torch_env() -> dict[str, str]:
    """torchrun's variables for this worker in the workers-only world (servers are not in it)."""
    topo = topology()
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
    topo = topology()
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
    backend = devices.worker_backend(topo)
    timeout_s = config().timeout_s
    store = _state.store if _state.store is not None else rendezvous.client_store(address, port, topo.num_workers,
                                                                                   timeout_s)
    # Its collectives (DDP's, Lightning's sync_dist, barriers) are bounded by timeout_s like IMerge's own.
    dist.init_process_group(backend, store=store, rank=topo.worker_rank, world_size=topo.num_workers,
                            timeout=datetime.timedelta(seconds=timeout_s))
    _state.process_group = dist.group.WORLD
    _state.own_process_group = True
    return _state.process_group


def master_address_port() -> tuple[str, int]:
    """Worker 0's address and the port of its store: the workers' torch.distributed rendezvous,
    agreed by all workers in ``init()`` (``rendezvous``)."""
    topology()
    if _state.master is None:
        raise IMergeUsageError("IMerge: servers have no torch.distributed rendezvous (workers only)")
    return _state.master


def _agree_master_address_port(topo: Topology) -> tuple[str, int]:
    """Worker 0's rendezvous address and store port, on every worker (collective over the workers).

    Worker 0 chooses the address (``rendezvous``), listens on it and serves the store; its error,
    if any, goes to every worker, so none waits for a rendezvous that will not come."""
    spans = len(topo.worker_hosts) > 1
    own = rendezvous.interfaces() if spans else []
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
        name = rendezvous.interface_towards(address, own)
        if name is not None:
            os.environ["GLOO_SOCKET_IFNAME"] = name
    return address, port


def _serve_rendezvous(topo: Topology, spans: bool, own: list, reports: list | None) -> tuple[str, int]:
    """Worker 0: the address (``MASTER_ADDR``, ``master_interface`` or chosen) and a store listening on it.
    ``reports``: every worker's interfaces where workers span hosts (one worker per other host is asked)."""
    if os.environ.get("MASTER_ADDR"):
        address = rendezvous.check_address(os.environ["MASTER_ADDR"], spans, "MASTER_ADDR")
    else:
        others = [reports[topo.workers_on(host)[0]] for host in topo.worker_hosts if host != topo.host] \
            if reports else []
        address = rendezvous.choose_address(own, others, config().master_interface, spans)
        address = rendezvous.check_address(address, spans, "the chosen address")
    port = 0
    if os.environ.get("MASTER_PORT"):
        text = os.environ["MASTER_PORT"]
        if not text.isdigit() or not 0 < int(text) < 65536:
            raise IMergeConfigError(f"IMerge worker 0: MASTER_PORT={text!r} is not a TCP port number")
        port = int(text)
    sock = rendezvous.listen(address, port)
    _state.store_socket = sock  # the store serves on its file descriptor: the socket must stay open
    _state.store = rendezvous.serve_store(sock, topo.num_workers, config().timeout_s)
    log.debug("IMerge worker 0: torch.distributed store on %s:%d", address, sock.getsockname()[1])
    return address, sock.getsockname()[1]


# ---------------------------------------------------------------------- shutdown
def shutdown() -> None:
    """Flush pending updates, stop the comm thread and release the servers (workers).

    After a fatal error (the comm thread failed, a server or a collective timed out), or when
    the flush fails, it aborts the MPI job instead: MPI_Finalize would wait forever for a stuck
    peer, and the other workers for this one's pushes.
    """
    if _state.topology is None or _state.shut_down or _state.topology.is_server:
        return
    _state.shut_down = True
    error = fatal_error() or (_state.comm_thread.failed if _state.comm_thread else None)
    if error is None:
        try:
            flush_all("shutdown()")
            _release_servers()
            return
        except BaseException as exc:  # noqa: BLE001 - ends the job
            error = exc
    abort(f"{whoami()}: shutdown after {type(error).__name__}: {error}; aborting the job instead of finalizing MPI")


def _release_servers() -> None:
    """Stop the comm thread, tell the servers this worker is done, write the timeline."""
    if _state.comm_thread is not None:
        _state.comm_thread.stop()
    topo = topology()
    if topo.host_comm is not None:  # host aggregation: a local worker waiting for this one stops at once
        for mate in range(topo.host_comm.Get_size()):
            if mate != topo.local_rank:
                topo.host_comm.send(None, dest=mate, tag=TAG_HOST_SHUTDOWN)
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
    parts = collective(topo.worker_comm, "gather", export(_state.timeline), "the timelines")
    if topo.worker_rank != 0:
        return
    for server in range(topo.num_servers):
        parts.append(_recv_with_timeout(topo.data_comm, topo.server_world_rank(server), TAG_TIMELINE,
                                        f"the timeline of server {server}"))
    write_trace(config().timeline, parts)
    log.warning("IMerge: timeline written to %s", config().timeline)
