"""The communication thread: orders partitions, bounds bytes in flight, completes groups.

Groups arrive from the engine as they become ready. Each is expanded into one task per key;
tasks go out FIFO, or front layers first when ``priority`` is on (a partly sent group yields
to a higher-priority one at partition granularity). With ``stagger`` worker r starts each
group's partition sequence at server r % S. At most ``credit_bytes`` of pushes are in flight
(at least one push always is; credit returns when a push is delivered; ``tail_credit_bytes``
for other keys while the plan's urgent last group is due; ``schedule``). A key whose data is not
ready yet (CUDA: its gradients' events have not completed, ``Group.slot_ready``) waits outside the
queues while the thread goes on with every other key, result and poll; the thread never waits on
the device. Errors are kept and re-raised in the thread that waits.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from ..cluster.devices import adopt_bound_device
from ..core._mpi import MPI
from ..core.errors import IMergeError, IMergeTimeoutError
from ..core.layout import key_owner
from ..core.polling import Backoff
from ..core.requests import PendingRequests
from ..core.wire import ROUND_TAGS, TAG_ERROR, TAG_HOST_SHUTDOWN, key_tag, split_key_tag
from .group import Group
from .schedule import Flow, Flows, SchedulePolicy, key_slots

log = logging.getLogger("imerge")

# A worker gives up on a push this much later than ``timeout_s``: the server, which knows which
# worker it still waits for, then aborts the job first and names that worker.
SERVER_FIRST_S = 3.0


@dataclass
class _Task:
    group: Group
    slot: int  # index into group.keys
    flow: Flow  # its engine's ready queue and credit
    priority: int = 0  # the schedule's priority of its group (0 without priority)
    buffer: list | None = None  # what to push, when not the group's own bytes (the host's sum)

    @property
    def nbytes(self) -> int:
        return self.group.keys[self.slot].nbytes

    @property
    def server(self) -> int:
        return self.group.keys[self.slot].server


@dataclass
class _InFlight:
    task: _Task
    recv: MPI.Request
    send: MPI.Request
    started: float
    recv_done: bool = False
    send_done: bool = False


@dataclass
class _Local:
    """One key's traffic inside the host (host aggregation). ``gather``: the key's owner receives
    the other local workers' gradients; ``forward``: it hands them the result; ``contribute``:
    another worker sends the owner its gradient and receives the result from it."""

    task: _Task
    kind: str
    peers: list[int]  # local ranks, one per request
    started: float
    left: int
    done: set = field(default_factory=set)  # peers whose request completed


class CommThread:
    """Owns every data-plane MPI call of one worker process."""

    def __init__(self, comm: MPI.Comm, worker_rank: int, num_workers: int, num_servers: int,
                 server_world_rank: Callable[[int], int], timeout_s: float,
                 on_event: Callable[[str, Group, int, float, float], None] | None = None,
                 host_comm: MPI.Comm | None = None, host_workers: list[int] | None = None,
                 describe: Callable[[int], str] | None = None) -> None:
        self.comm = comm
        # Host aggregation: the workers of this host (world ranks, local order) and their communicator.
        self.host_comm = host_comm
        self.host_workers = list(host_workers or [worker_rank])
        self.host_size = len(self.host_workers) if host_comm is not None else 1
        self.local_rank = self.host_workers.index(worker_rank) if host_comm is not None else 0
        self.describe = describe or (lambda rank: f"worker {rank}")
        self._local = PendingRequests()  # requests of _Local operations, owned by (op, peer)
        self._local_ops: dict[int, _Local] = {}  # id(op) -> op
        self._gone: set[int] = set()  # local ranks that shut down (TAG_HOST_SHUTDOWN)
        self.rank = worker_rank
        self.num_workers = num_workers
        self.num_servers = num_servers
        self.server_world_rank = server_world_rank
        self.timeout_s = timeout_s
        self.on_event = on_event
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._error: BaseException | None = None
        self._remaining: dict[int, int] = {}  # id(group) -> keys not finished
        self._active: dict[int, Group] = {}  # id(group) -> group, while submitted and not done
        self._flows = Flows()  # each engine's ready keys and credit (comm thread only)
        self._unready: list[tuple[_Task, Callable[[_Task], None]]] = []  # keys whose data is not ready, and what then
        self._thread = threading.Thread(target=self._run, name="imerge-comm", daemon=True)
        self._stopped = threading.Event()
        self._wake = threading.Event()  # set by submit()/stop(): ends the comm thread's back-off sleep
        self._thread.start()

    # ------------------------------------------------------------------ API (any thread)
    def submit(self, group: Group, policy: SchedulePolicy, round_number: int | None = None) -> None:
        """Queue ``group`` for this round (``round_number``: the caller's step; None: the group's next)."""
        self.raise_if_failed()
        group.round = group.round + 1 if round_number is None else round_number
        group.done.clear()
        group.submitted = True
        group.result_pending = group.swap
        self._queue.put((group, policy))
        self._wake.set()

    def wait(self, group: Group, what: str = "") -> None:
        """Block until ``group`` is complete (or raise the comm thread's error / a timeout)."""
        start = time.monotonic()
        while not group.done.wait(0.05):
            self.raise_if_failed()
            waited = time.monotonic() - start
            if waited > self.timeout_s + SERVER_FIRST_S:
                raise IMergeTimeoutError(
                    f"IMerge worker {self.rank}: {group.describe()} not complete after {waited:.0f} s {what}(no "
                    f"result from server(s) {sorted({k.server for k in group.keys})}; a server or another worker "
                    "may be dead or stuck)")
        self.raise_if_failed()

    def raise_if_failed(self) -> None:
        if self._error is not None:
            raise self._error

    @property
    def failed(self) -> BaseException | None:
        return self._error

    def stop(self) -> None:
        """Stop the thread and join it, so no MPI call runs while MPI finalizes."""
        self._queue.put(None)
        self._wake.set()
        self._thread.join(10.0)
        if self._thread.is_alive():
            log.error("IMerge worker %d: communication thread did not stop within 10 s", self.rank)

    # ------------------------------------------------------------------ thread body
    def _run(self) -> None:
        """The thread's loop. Its steps are methods, so that no local variable of this frame keeps
        the last group, task or request alive after the engine that owns it is gone."""
        adopt_bound_device()  # the copy streams' device, for groups on CUDA
        flows = self._flows
        inflight: dict[int, _InFlight] = {}  # id(op) -> op
        # Pushes to one server complete in order; results come back roughly in push order.
        sends = PendingRequests(window=4 * self.num_servers)
        recvs = PendingRequests(window=8 * self.num_servers)
        backoff = Backoff(sleep=self._nap)
        last_check = time.monotonic()
        try:
            while True:
                # 1. take new groups
                idle = not flows.waiting and not inflight and not self._local_ops and not self._unready
                if not self._take_groups(flows, block=idle):
                    self._stopped.set()
                    return
                # 2. keys whose data became ready; start tasks within their engine's credit; 3. complete
                progressed = self._poll_unready() if self._unready else False
                progressed = self._start_ready(flows, inflight, sends, recvs) or progressed
                progressed = self._retire_done(inflight, sends, recvs) or progressed
                if self._local_ops:
                    progressed = self._retire_local() or progressed
                # 4. errors from servers and timeouts
                now = time.monotonic()
                if now - last_check > 0.2:
                    last_check = now
                    self._check_server_errors()
                    self._check_timeouts(inflight, now)
                    if self._local_ops:
                        self._check_local(now)
                if progressed:
                    backoff.reset()
                elif inflight or self._local_ops:
                    oldest = next(iter(inflight.values() or self._local_ops.values())).started
                    backoff.idle(now - oldest)
                elif self._unready:  # only the device to wait for: short naps
                    backoff.idle()
        except BaseException as exc:  # noqa: BLE001 - re-raised in the waiting thread
            self._fail(exc)

    def _fail(self, exc: BaseException) -> None:
        """Keep the thread's error for the waiting threads (an IMergeError, caused by ``exc``)."""
        error = exc
        if not isinstance(exc, IMergeError):
            error = IMergeError(f"IMerge worker {self.rank}: communication thread failed: {exc!r}")
            error.__cause__ = exc  # as `raise ... from exc`: the traceback shows where the thread failed
        self._error = error
        log.error("%s", error)
        for group in list(self._active.values()):
            _run_callbacks(group, error)
        self._stopped.set()

    def _take_groups(self, flows: Flows, block: bool) -> bool:
        """Expand the submitted groups into tasks (waiting for one if ``block``); False on stop()."""
        while block or not self._queue.empty():
            try:
                item = self._queue.get(timeout=0.5) if block else self._queue.get_nowait()
            except queue.Empty:
                continue
            block = False
            if item is None:
                return False
            group, policy = item
            flow = flows.of(policy)
            if group.tail_keys:
                flow.credit.begin_tail(group.tail_keys)
            self._expand(group, flow)
        return True

    def _start_ready(self, flows: Flows, inflight: dict[int, _InFlight], sends: PendingRequests,
                     recvs: PendingRequests) -> bool:
        """Start every task its engine's credit allows; True if any started."""
        started = False
        while (next_task := flows.take()) is not None:
            flow, task = next_task
            op = self._start(task)
            inflight[id(op)] = op
            sends.add(op.send, op)
            recvs.add(op.recv, op)
            flow.credit.started(task.nbytes, task.server)
            started = True
        return started

    def _retire_done(self, inflight: dict[int, _InFlight], sends: PendingRequests,
                     recvs: PendingRequests) -> bool:
        """Account for finished pushes and results (one progress call per kind); True if any."""
        progressed = False
        for op in sends.completed():
            # Credit comes back when the push is delivered, not when the result is: the
            # server always drains pushes, so credit never waits on another worker.
            op.send_done = True
            op.task.flow.delivered(op.task.nbytes, op.task.server, op.task.group.urgent)
            progressed = True
            if op.recv_done:
                del inflight[id(op)]
                self._pushed(op)
        for op in recvs.completed():
            op.recv_done = True
            progressed = True
            if op.send_done:
                del inflight[id(op)]
                self._pushed(op)
        return progressed

    # ------------------------------------------------------------------ host aggregation
    def _start_local(self, task: _Task, kind: str, started: float | None = None) -> None:
        """Start ``kind`` (see ``_Local``) for ``task``'s key on the host communicator."""
        group, comm = task.group, self.host_comm
        spec = group.keys[task.slot]
        start, end = group.key_ranges[task.slot]
        tag = key_tag(spec.key, group.round)
        owner = key_owner(spec.key, self.host_size)
        if kind == "contribute":
            peers = [owner, owner]
            requests = [comm.Irecv(group.recv_buffer(task.slot), source=owner, tag=tag),
                        comm.Isend(group.send_buffer(task.slot), dest=owner, tag=tag)]
        else:
            peers = [m for m in range(self.host_size) if m != self.local_rank]
            if kind == "gather":
                scratch, n = group.gather_buffer(task.slot, len(peers)), end - start
                requests = [comm.Irecv(group.mpi_buffer(scratch, i * n, (i + 1) * n), source=m, tag=tag)
                            for i, m in enumerate(peers)]
            else:
                result = group.mpi_buffer(group.result, start, end)
                requests = [comm.Isend(result, dest=m, tag=tag) for m in peers]
        op = _Local(task, kind, peers, time.monotonic() if started is None else started, len(requests))
        self._local_ops[id(op)] = op
        for peer, request in zip(peers, requests):
            self._local.add(request, (op, peer))

    def _retire_local(self) -> bool:
        """Advance the host's operations whose requests finished (one progress call); True if any."""
        finished = self._local.completed(full=True)
        for op, peer in finished:
            op.left -= 1
            op.done.add(peer)
            if op.left:
                continue
            del self._local_ops[id(op)]
            task = op.task
            if op.kind == "gather":  # the host's gradients are in; once its own is, the sum goes like any push
                self._when_ready(task, lambda t, parts=len(op.peers): self._push_sum(t, parts))
            else:
                self._finish(task, op.started)
        return bool(finished)

    def _push_sum(self, task: _Task, parts: int) -> None:
        """Host aggregation, the key's owner: add its host's gradients to its own; the sum waits for credit."""
        task.buffer = task.group.add_contributions(task.slot, parts)
        _queue(task)

    # ------------------------------------------------------------------ data readiness
    def _when_ready(self, task: _Task, then: Callable[[_Task], None]) -> None:
        """``then(task)`` now if the key's data is ready (``Group.slot_ready``), else once it is."""
        if task.group.slot_ready(task.slot):
            then(task)
        else:
            self._unready.append((task, then))

    def _poll_unready(self) -> bool:
        """Carry on with the keys whose data became ready, in the order they came; True if any."""
        waiting, self._unready = self._unready, []
        progressed = False
        for task, then in waiting:
            if task.group.slot_ready(task.slot):
                then(task)
                progressed = True
            else:
                self._unready.append((task, then))
        return progressed

    def _check_local(self, now: float) -> None:
        """Name the local worker a key waits for past its deadline: a gather gives up first (before
        the server's stall clock, so the worker that failed is named, not the owner that waits for it)."""
        for op in self._local_ops.values():
            spec = op.task.group.keys[op.task.slot]
            late = now - op.started
            missing = sorted({self.host_workers[p] for p in op.peers if p not in op.done})
            who = ", ".join(self.describe(r) for r in missing)
            if op.kind == "gather" and late > max(self.timeout_s - SERVER_FIRST_S, self.timeout_s / 2):
                raise IMergeTimeoutError(
                    f"IMerge {self.describe(self.host_workers[self.local_rank])}: no gradient of "
                    f"{spec.describe()} from {who} after {late:.0f} s (host aggregation: the workers of a host sum "
                    "each key before one of them pushes it); it is dead or stuck")
            if op.kind != "gather" and late > self.timeout_s + 2 * SERVER_FIRST_S:
                what = "did not take the result of" if op.kind == "forward" else "sent no result for"
                raise IMergeTimeoutError(
                    f"IMerge {self.describe(self.host_workers[self.local_rank])}: {who} {what} "
                    f"{spec.describe()} after {late:.0f} s; a worker or server may be dead or stuck")
        self._check_mates_rounds()
        self._check_mates_gone()

    def _check_mates_gone(self) -> None:
        """A local worker shut down while this one waits for it: it ran out of data without join()."""
        status = MPI.Status()
        while self.host_comm.Iprobe(MPI.ANY_SOURCE, TAG_HOST_SHUTDOWN, status):
            self.host_comm.recv(source=status.Get_source(), tag=TAG_HOST_SHUTDOWN)
            self._gone.add(status.Get_source())
        for op in self._local_ops.values():
            waited = [p for p in op.peers if p in self._gone and p not in op.done]
            if waited:
                raise IMergeError(
                    f"IMerge {self.describe(self.host_workers[self.local_rank])}: "
                    f"{self.describe(self.host_workers[waited[0]])} shut down while this worker still trains "
                    f"({op.task.group.keys[op.task.slot].describe()} waits for it); a worker that runs out of data "
                    "must call imerge_hooks.join()")

    def _check_mates_rounds(self) -> None:
        """A local worker's gradient for a key this worker gathers, but of another step: it is out of step."""
        gathering = {(op.task.group.keys[op.task.slot].key, p): op for op in self._local_ops.values()
                     if op.kind == "gather" for p in op.peers if p not in op.done}
        status = MPI.Status()
        for peer in sorted({p for _, p in gathering}):
            if not self.host_comm.Iprobe(peer, MPI.ANY_TAG, status):
                continue
            key, round_number = split_key_tag(status.Get_tag())
            op = gathering.get((key, peer))
            if op is not None and round_number != op.task.group.round % ROUND_TAGS:
                raise IMergeError(
                    f"IMerge {self.describe(self.host_workers[self.local_rank])}: "
                    f"{self.describe(self.host_workers[peer])} sent its gradient of "
                    f"{op.task.group.keys[op.task.slot].describe()} for another step than this worker's (round "
                    f"{round_number} against {op.task.group.round % ROUND_TAGS}, modulo {ROUND_TAGS}): workers "
                    "are out of step (one skipped a backward before step(), or called step() or backward() a "
                    "different number of times)")

    def _check_timeouts(self, inflight: dict[int, _InFlight], now: float) -> None:
        for op in inflight.values():
            if now - op.started > self.timeout_s + SERVER_FIRST_S:
                spec = op.task.group.keys[op.task.slot]
                raise IMergeTimeoutError(
                    f"IMerge worker {self.rank}: no result from server {spec.server} for "
                    f"{spec.describe()} after {now - op.started:.0f} s; a worker or server may be "
                    "dead or stuck (the server logs which workers it waits for)")

    def _nap(self, seconds: float) -> None:
        if self._wake.wait(seconds):
            self._wake.clear()

    def _expand(self, group: Group, flow: Flow) -> None:
        """One task per key, in ``flow`` (its engine's); with host aggregation, keys this worker owns wait
        for its host's gradients first, and the others go to their owner on this host instead of a server."""
        policy = flow.policy
        slots = key_slots([k.server for k in group.keys], self.rank, self.num_servers, policy.stagger)
        self._remaining[id(group)] = len(slots)
        self._active[id(group)] = group
        flow.keys += len(slots)
        if not slots:
            self._flows.finished(flow, 0)
            self._complete(group)
            return
        prio = group.priority if policy.priority else 0
        for slot in slots:
            task = _Task(group, slot, flow, prio)
            if self.host_size == 1:
                self._when_ready(task, _queue)
            elif key_owner(group.keys[slot].key, self.host_size) == self.local_rank:
                self._start_local(task, "gather")  # receives only; its own gradient is read when the others are in
            else:
                self._when_ready(task, self._contribute)

    def _contribute(self, task: _Task) -> None:
        self._start_local(task, "contribute")

    def _start(self, task: _Task) -> _InFlight:
        spec = task.group.keys[task.slot]
        dest = self.server_world_rank(spec.server)
        group = task.group
        tag = key_tag(spec.key, group.round)
        recv = self.comm.Irecv(group.recv_buffer(task.slot), source=dest, tag=tag)
        buffer, task.buffer = task.buffer, None
        send = self.comm.Isend(buffer if buffer is not None else group.send_buffer(task.slot), dest=dest, tag=tag)
        now = time.monotonic()
        if self.on_event is not None:
            self.on_event("push", task.group, task.slot, now, 0.0)
        return _InFlight(task, recv, send, now)

    def _pushed(self, op: _InFlight) -> None:
        """A push and its result are done: the key is finished, or its owner hands its host the result."""
        if self.host_size > 1:
            self._start_local(op.task, "forward", op.started)
        else:
            self._finish(op.task, op.started)

    def _finish(self, task: _Task, started: float) -> None:
        group = task.group
        group.unpack(task.slot)
        self._flows.finished(task.flow)
        if self.on_event is not None:
            self.on_event("done", group, task.slot, started, time.monotonic())
        left = self._remaining[id(group)] - 1
        self._remaining[id(group)] = left
        if left == 0:
            self._complete(group)

    def _complete(self, group: Group) -> None:
        del self._remaining[id(group)]
        del self._active[id(group)]
        group.results_queued()
        group.done.set()
        _run_callbacks(group, None)

    def _check_server_errors(self) -> None:
        status = MPI.Status()
        while self.comm.Iprobe(MPI.ANY_SOURCE, TAG_ERROR, status):
            report = self.comm.recv(source=status.Get_source(), tag=TAG_ERROR)
            raise IMergeError(report.get("message", str(report)))


def _queue(task: _Task) -> None:
    """The key waits for its engine's credit, in its schedule's order."""
    task.flow.ready.add(task, task.nbytes, task.priority, task.group.urgent, task.server)


def _run_callbacks(group: Group, error: BaseException | None) -> None:
    callbacks, group.callbacks = group.callbacks, []
    for fn in callbacks:
        try:
            fn(error)
        except Exception:  # noqa: BLE001 - a user callback must not kill the comm thread
            log.exception("IMerge: completion callback of %s failed", group.describe())
