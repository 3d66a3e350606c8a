"""Messages every worker waits for without spinning and without hanging: worker 0's decisions
down a tree of workers, the servers' answers, control messages to every server."""

from __future__ import annotations

from typing import Any

from ..core._mpi import MPI
from ..core.errors import IMergeTimeoutError
from ..core.polling import DeadlineWait
from ..core.wire import TAG_CONTROL, TAG_DECISION
from . import collectives, session
from .failure import record_fatal


def recv_with_timeout(comm: MPI.Comm, source: int, tag: int, what: str, fatal: bool = True) -> Any:
    """A pickled message of any size, polled with back-off (no spinning) until the timeout.

    A matched probe, not ``irecv``: mpi4py's ``irecv`` without a buffer truncates messages
    over 32 KiB (a server's timeline, a large plan). ``fatal``: the timeout means a server is
    gone or stuck, so ``shutdown()`` aborts the job rather than wait for it in MPI_Finalize."""
    wait = DeadlineWait(session.config().timeout_s)
    while True:
        message = comm.improbe(source=source, tag=tag)
        if message is not None:
            return message.recv()
        if wait.expired():
            error = IMergeTimeoutError(f"IMerge worker {session.topology().worker_rank}: waited {wait.limit_s:.0f} s "
                                       f"for {what}; some worker did not reach the same point, or a server is gone")
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
    topo = session.topology()
    if topo.num_workers == 1:
        return value
    comm = topo.worker_comm
    parent, children = collectives.tree_links(topo.worker_rank, topo.num_workers)
    if parent is not None:
        # Not fatal: nothing is left pending, and worker 0 may only be on another code path.
        value = recv_with_timeout(comm, parent, TAG_DECISION, f"{what} from worker 0 (through worker {parent})",
                                   fatal=False)
    requests = [comm.isend(value, dest=r, tag=TAG_DECISION) for r in children]
    wait = DeadlineWait(session.config().timeout_s)
    while requests:
        requests = [r for r in requests if not r.test()[0]]
        if requests and wait.expired():
            raise record_fatal(IMergeTimeoutError(f"IMerge worker {topo.worker_rank}: {len(requests)} worker(s) did "
                                                  f"not take {what} within {wait.limit_s:.0f} s"))
        wait.idle()
    return value


def to_all_servers(message: dict) -> None:
    topo = session.topology()
    for server in range(topo.num_servers):
        topo.data_comm.send(message, dest=topo.server_world_rank(server), tag=TAG_CONTROL)
