"""``join()``: a worker out of data waits, shadowing the rounds of those still training, until every
worker has joined. It answers the collectives the others start meanwhile, so each raises on every
worker that called it (an allreduce goes on, the joined worker adding zeros, as in Horovod); a plan
change meanwhile, which it cannot take part in, ends the job."""

from __future__ import annotations

import threading
import time

from ..cluster import collectives, messages, session
from ..cluster.failure import abort, record_fatal, whoami
from ..cluster.topology import Topology
from ..core._mpi import MPI
from ..core.errors import IMergeTimeoutError
from ..core.polling import Backoff, DeadlineWait
from ..core.wire import TAG_DECISION, TAG_REPLY


def join() -> int:
    """This worker ran out of data; returns when every worker has called ``join()``.

    Every worker calls it when its data ends, as with Horovod's ``hvd.join()`` or DDP's
    ``Join``. Until every worker has joined, a joined worker's missing pushes count as zeros
    and the servers divide by the number of workers (``join_divisor="active"``: by those that
    pushed). When it returns, every worker holds the parameters of the worker that joined
    last (and its step count); it returns that worker's rank.

    Meanwhile the others may run allreduces (Average or Sum), to which this worker adds zeros, as
    Horovod's joined ranks do; any other collective raises the same IMergeUsageError on every
    worker that called it, and this one goes on waiting. A plan change meanwhile (the end of
    ``profile_steps``) needs this worker, which cannot take part: it ends the job at once.
    """
    topo = session.topology()
    if topo.num_servers == 0:
        _finish_iteration()
        return topo.worker_rank
    with _Answering(topo):  # the last round of this worker's engines may need the others' next pushes
        _finish_iteration()
    messages.to_all_servers({"op": "join"})
    if topo.aggregate_in_host:
        _shadow_until_all_joined(topo)
    last = _wait_until_all_joined(topo)
    collectives.count_join()  # before the collectives that follow: the others tell them from stray ones
    last = collectives.last_joiner(topo.worker_comm, last)
    for fn in list(session.state.after_join_callbacks):
        fn(last)
    return last


def _finish_iteration() -> None:
    session.flush_all("join()")
    for fn in list(session.state.join_callbacks):
        fn()


JOIN_GRACE_S = 2.0  # a plan hand-off seen while waiting in join() is stray only if no answer follows


def _shadow_until_all_joined(topo: Topology) -> None:
    """Host aggregation: take part in the others' rounds with zeros until one in which no worker trained.

    A joined worker's host still sums each key over all its workers, and the worker owns some of
    its host's keys, so it shadows every round, engine after engine in the order the others step
    them (``engine.shadow_round``). The last worker to join shadows one round too: every worker
    sees it end with nobody training, and all stop at the same round, with nothing left in flight.
    """
    watch = _Watch(topo, grace_s=5 * JOIN_GRACE_S)  # the servers' answers follow the last round's results

    def wait(group) -> None:
        limit = DeadlineWait(session.config().timeout_s)
        while not group.done.wait(0.02):
            session.state.comm_thread.raise_if_failed()
            if watch.check():
                limit.reset()
            if limit.expired():
                raise record_fatal(IMergeTimeoutError(
                    f"{whoami()}: waited {limit.limit_s:.0f} s in join() for the next step of the workers that "
                    "still train: every worker must call imerge_hooks.join() when its data ends"))
        session.state.comm_thread.raise_if_failed()

    while True:
        counts = [shadow(wait) for shadow in list(session.state.shadow_callbacks)]
        if not counts or any(c == 0 for c in counts if c is not None) or all(c is None for c in counts):
            return


class _Watch:
    """What the other workers send a worker waiting in join(): it answers their collectives
    (``collectives.answer_pending``) and ends the job on a plan hand-off it cannot take part in."""

    def __init__(self, topo: Topology, grace_s: float = JOIN_GRACE_S) -> None:
        self.topo = topo
        self.grace_s = grace_s
        self.since: float | None = None

    def check(self, hand_off_applies: bool = True) -> bool:
        """Answer a collective a worker that has not joined started; whether this answered one.
        ``hand_off_applies``: whether a plan hand-off now means a stray one (see the callers)."""
        comm = self.topo.worker_comm
        if collectives.answer_pending(comm):
            return True
        status = MPI.Status()
        if not hand_off_applies or not comm.iprobe(source=MPI.ANY_SOURCE, tag=TAG_DECISION, status=status):
            return False
        now = time.monotonic()
        self.since = self.since or now
        if now - self.since > self.grace_s:
            abort(f"{whoami()} waits in join() (out of data) while worker {status.Get_source()} started a plan "
                  "change (the end of profile_steps, layers frozen or unfrozen), which needs every worker: make "
                  "profile_steps smaller than the shortest worker's number of steps; aborting the job")
        return False


class _Answering:
    """While this worker in join() finishes its iteration (its engines push what a backward left
    and wait for the round), a thread answers the others' collectives: that round completes when
    they push or join, and they may run a collective first."""

    def __init__(self, topo: Topology) -> None:
        self.watch = _Watch(topo)
        self.done = threading.Event()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="imerge-join-answers", daemon=True)

    def __enter__(self) -> _Answering:
        self.thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.done.set()
        self.thread.join()
        if self.error is not None and exc_info[0] is None:
            raise self.error

    def _run(self) -> None:
        idle = Backoff(spin_s=0.0, sleep=self.done.wait)  # the main thread's work comes first
        try:
            while not self.done.is_set():
                if self.watch.check(hand_off_applies=False):
                    idle.reset()
                else:
                    idle.idle()
        except BaseException as error:  # noqa: BLE001 - raised in the thread that waits in join()
            self.error = error


def _wait_until_all_joined(topo: Topology) -> int:
    """Every server's answer that all workers joined, answering the others' collectives meanwhile.

    A plan hand-off meanwhile (the end of ``profile_steps``) would wait for this worker until
    ``timeout_s``: it ends the job unless the servers' answers follow within ``JOIN_GRACE_S``. So
    does a server's refusal of a plan change (its join state and the workers' plans are left apart).
    """
    wait = DeadlineWait(session.config().timeout_s)
    waiting, last = list(range(topo.num_servers)), -1
    watch = _Watch(topo)
    while waiting:
        for server in list(waiting):
            message = topo.data_comm.improbe(source=topo.server_world_rank(server), tag=TAG_REPLY)
            if message is not None:
                reply = message.recv()
                if reply.get("op") == "error":
                    abort(f"{whoami()}: join(): {reply['message']}; aborting the job")
                last = reply.get("last", last)
                waiting.remove(server)
                wait.reset()
        if watch.check(hand_off_applies=len(waiting) == topo.num_servers):
            wait.reset()
        now = time.monotonic()
        if wait.expired(now):
            raise record_fatal(IMergeTimeoutError(
                f"{whoami()}: waited {wait.limit_s:.0f} s in join() for server(s) {waiting} to report that "
                "every worker joined: every worker must call imerge_hooks.join() when its data ends"))
        wait.idle()
    return last
