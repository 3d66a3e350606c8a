"""Start and stop IMerge in this process: roles, the comm thread, the rendezvous; at the end, the
flush, the servers' release and the timeline (the session's state lives in ``session``)."""

from __future__ import annotations

import atexit
import ctypes
import logging
import os
import sys
from typing import Any, NoReturn

from ..core import polling
from ..core._mpi import MPI, ensure_initialized
from ..core.config import Config, given
from ..core.errors import IMergeConfigError
from ..core.wire import TAG_HOST_SHUTDOWN, TAG_TIMELINE
from ..server import stages
from ..worker.comm import CommThread
from . import collectives, devices, messages, session, torch_world
from .collectives import collective
from .failure import abort, fatal_error, install_excepthooks, set_identity, whoami
from .rank_layout import check_layout, describe_layout
from .topology import build_topology

log = logging.getLogger("imerge")


def declare_server_program() -> None:
    """Mark this process as ``python -m imerge_hooks.server`` (MPMD launch)."""
    session.state.server_program = True


def init(num_servers: int | None = None, *, serve: str = "forever", **config: Any) -> None:
    """Start IMerge on every rank of COMM_WORLD (collective): ``imerge_hooks.init``, and what
    ``DistributedOptimizer``, ``IMergeHookState`` and the Lightning strategy call when IMerge is not
    started yet, so every way in starts it the same way.

    The last ``num_servers`` ranks (default: ``IMERGE_NUM_SERVERS``, or the ranks launched as
    ``python -m imerge_hooks.server`` in an MPMD job, or 0) become parameter servers: on them
    ``init`` serves until every worker has shut down and then ends the process with code 0
    (``end_process``).
    On workers it returns, in a job of several ranks with torchrun's variables set for the
    workers-only world (``torch_world.export_torch_env``). A second call on a worker is a no-op. In a
    job of several ranks an uncaught exception in any thread then aborts the whole MPI job
    (``failure.install_excepthooks``).
    """
    if session.state.topology is not None:
        return
    cfg = Config.from_env(**({} if num_servers is None else {"num_servers": num_servers}), **config)
    session.state.explicit = given(config)
    ensure_initialized()
    world = MPI.COMM_WORLD
    if world.Get_size() > 1:
        install_excepthooks()
    flags = collective(world, "allgather", session.state.server_program, "the roles the ranks were launched as",
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
    session.state.explicit["num_servers"] = cfg.num_servers
    collectives.configure(cfg.timeout_s)
    topo = build_topology(int(cfg.num_servers), timeout_s=cfg.timeout_s, aggregate_in_host=cfg.host_aggregation)
    session.state.topology, session.state.config = topo, cfg
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
        from ..core.timeline import Timeline

        if topo.is_server:
            session.state.timeline = Timeline(f"server {topo.server_index}", 1000 + topo.server_index)
        else:
            session.state.timeline = Timeline(f"worker {topo.worker_rank}", topo.worker_rank)
    if topo.is_server:
        if serve == "forever":
            _serve_then_end_process()
        return
    if cfg.torch_store:
        session.state.master = torch_world.agree_master_address_port(topo)
        if topo.world_size > 1:  # launched as a job; `python train.py` alone stays a plain single process
            torch_world.export_torch_env()
    if topo.num_servers > 0:
        on_event = _timeline_comm_event if session.state.timeline is not None else None
        session.state.comm_thread = CommThread(topo.data_comm, topo.worker_rank, topo.num_workers,
                                               topo.num_servers, topo.server_world_rank, cfg.timeout_s,
                                               on_event=on_event, host_comm=topo.host_comm,
                                               host_workers=topo.host_workers, describe=topo.describe_rank)
    atexit.register(shutdown)


def _serve_then_end_process() -> NoReturn:
    """A server serves until its workers are done, then its process ends here, whichever front end
    started IMerge and even under a test runner: unittest and pytest catch the ``SystemExit`` that
    would end it, and would go on to run the rest of the suite on the server (``mpiexec -n W+S pytest``,
    as Horovod's suites run)."""
    try:
        stages.serve_until_shutdown()
        code = 0
    except SystemExit as done:
        code = done.code if isinstance(done.code, int) else 0
    end_process(code)


def end_process(code: int) -> NoReturn:
    """What the interpreter's exit does (atexit handlers, flushed streams, MPI_Finalize, C ``exit``).

    C ``exit``, not ``os._exit``: MPICH's process manager sometimes takes a process that ``_exit``s
    right after MPI_Finalize for a crashed one; it then kills the other ranks and the job's exit
    status is lost (measured: 9 or 0 where the workers exited 1, in about one launch in three).
    """
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    if MPI.Is_initialized() and not MPI.Is_finalized():
        MPI.Finalize()
    ctypes.CDLL(None).exit(code)
    os._exit(code)  # not reached


def run_server_program() -> None:
    """``python -m imerge_hooks.server`` / ``imerge-server`` (MPMD launch): serve, then exit 0."""
    declare_server_program()
    init()
    raise SystemExit(0)  # init() does not return on a server; this is a safety net


def _timeline_comm_event(kind: str, group, slot: int, start: float, end: float) -> None:
    if kind == "done":
        spec = group.keys[slot]
        session.state.timeline.span(f"push+pull key {spec.key} -> server {spec.server}", "comm", start, end, "comm")


def _setup_logging() -> None:
    level = os.environ.get("IMERGE_LOG_LEVEL")
    logger = logging.getLogger("imerge")
    if level:
        logger.setLevel(level.upper())
    if not logger.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler(sys.stderr)
        topo = session.state.topology
        role = "server" if topo.is_server else "worker"
        index = topo.server_index if topo.is_server else topo.world_rank
        handler.setFormatter(logging.Formatter(f"[imerge {role} {index}] %(levelname)s %(message)s"))
        logger.addHandler(handler)
        if not level:
            logger.setLevel(logging.WARNING)


# ---------------------------------------------------------------------- shutdown
def shutdown() -> None:
    """Flush pending updates, stop the comm thread and release the servers (workers).

    After a fatal error (the comm thread failed, a server or a collective timed out), or when
    the flush fails, it aborts the MPI job instead: MPI_Finalize would wait forever for a stuck
    peer, and the other workers for this one's pushes.
    """
    if session.state.topology is None or session.state.shut_down or session.state.topology.is_server:
        return
    session.state.shut_down = True
    error = fatal_error() or (session.state.comm_thread.failed if session.state.comm_thread else None)
    if error is None:
        try:
            session.flush_all("shutdown()")
            _release_servers()
            return
        except BaseException as exc:  # noqa: BLE001 - ends the job
            error = exc
    abort(f"{whoami()}: shutdown after {type(error).__name__}: {error}; aborting the job instead of finalizing MPI")


def _release_servers() -> None:
    """Stop the comm thread, tell the servers this worker is done, write the timeline."""
    if session.state.comm_thread is not None:
        session.state.comm_thread.stop()
    topo = session.topology()
    if topo.host_comm is not None:  # host aggregation: a local worker waiting for this one stops at once
        for mate in range(topo.host_comm.Get_size()):
            if mate != topo.local_rank:
                topo.host_comm.send(None, dest=mate, tag=TAG_HOST_SHUTDOWN)
    messages.to_all_servers({"op": "shutdown"})
    if session.state.timeline is not None:
        _write_timeline()
    if session.state.own_process_group:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def _write_timeline() -> None:
    """Gather every rank's events on worker 0 and write one Chrome trace."""
    from ..core.timeline import export, write_trace

    topo = session.topology()
    parts = collective(topo.worker_comm, "gather", export(session.state.timeline), "the timelines")
    if topo.worker_rank != 0:
        return
    for server in range(topo.num_servers):
        parts.append(messages.recv_with_timeout(topo.data_comm, topo.server_world_rank(server), TAG_TIMELINE,
                                        f"the timeline of server {server}"))
    write_trace(session.config().timeline, parts)
    log.warning("IMerge: timeline written to %s", session.config().timeline)
