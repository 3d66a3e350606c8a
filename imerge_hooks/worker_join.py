"""``join()``: a worker out of data waits, shadowing the rounds of those still training, until every
worker has joined; another worker's collective meanwhile is an error, not a hang."""

from __future__ import annotations

import time

from . import handoff, session
from ._mpi import MPI
from .errors import IMergeTimeoutError, IMergeUsageError
from .failure import record_fatal, whoami
from .polling import DeadlineWait
from .topology import Topology
from .wire import TAG_COLLECTIVE, TAG_DECISION, TAG_REPLY


def join() -> int:
    """This worker ran out of data; returns when every worker has called ``join()``.

    Every worker calls it when its data ends, as with Horovod's ``hvd.join()`` or DDP's
    ``Join``. Until every worker has joined, a joined worker's missing pushes count as zeros
    and the servers divide by the number of workers (``join_divisor="active"``: by those that
    pushed). When it returns, every worker holds the parameters of the worker that joined
    last (and its step count); it returns that worker's rank. A plan change while a worker
    waits here (the end of ``profile_steps``) raises at once on that worker.
    """
    topo = session.topology()
    session.flush_all("join()")
    for fn in list(session.state.join_callbacks):
        fn()
    if topo.num_servers == 0:
        return topo.worker_rank
    handoff.to_all_servers({"op": "join"})
    if topo.aggregate_in_host:
        _shadow_until_all_joined(topo)
    last = _wait_until_all_joined(topo)
    for fn in list(session.state.after_join_callbacks):
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
        limit = DeadlineWait(session.config().timeout_s)
        while not group.done.wait(0.02):
            session.state.comm_thread.raise_if_failed()
            watch.check()
            if limit.expired():
                raise record_fatal(IMergeTimeoutError(
                    f"{whoami()}: waited {limit.limit_s:.0f} s in join() for the next step of the workers that "
                    "still train: every worker must call imerge_hooks.join() when its data ends"))
        session.state.comm_thread.raise_if_failed()

    while True:
        counts = [shadow(wait) for shadow in list(session.state.shadow_callbacks)]
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
    wait = DeadlineWait(session.config().timeout_s)
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
