"""The communication thread: orders partitions, bounds bytes in flight, completes groups.

Groups arrive from the engine as they become ready. Each is expanded into one task per key;
tasks go out FIFO, or front layers first when ``priority`` is on (a partly sent group yields
to a higher-priority one at partition granularity). With ``stagger`` worker r starts each
group's partition sequence at server r % S. At most ``credit_bytes`` of pushes are in flight
(at least one push always is; credit returns when a push is delivered; ``tail_credit_bytes``
for other keys while the plan's urgent last group is due; ``schedule``). A key whose data is not
ready yet (CUDA: its gradients' events have not completed, ``Group.slot_ready``) waits outside the
queues while the thread goes on with every other key, result and poll; the thread never waits on
the device. Errors are kept and re-raised in the thread that waits. Host aggregation (the workers of
a host sum each key before its owner pushes it) lives in ``host_exchange``; this thread drives it.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from ..cluster.devices import adopt_bound_device
from ..core._mpi import MPI
from ..core.errors import IMergeError, IMergeTimeoutError
from ..core.polling import Backoff
from ..core.requests import PendingRequests
from ..core.wire import TAG_ERROR, key_tag
from .group import Group
from .host_exchange import HostExchange
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


class CommThread:
    """Owns every data-plane MPI call of one worker process."""

    def __init__(self, comm: MPI.Comm, worker_rank: int, num_workers: int, num_servers: int,
                 server_world_rank: Callable[[int], int], timeout_s: float,
                 on_event: Callable[[str, Group, int, float, float], None] | None = None,
                 host_comm: MPI.Comm | None = None, host_workers: list[int] | None = None,
                 describe: Callable[[int], str] | None = None) -> None:
        self.comm = comm
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
        # Host aggregation, where this worker's host communicator (``host_workers``: world ranks, local
        # order) holds other workers. An owner gives up on a missing gradient before the server's stall
        # clock (which would blame the owner); a forward or contribution waits past a push's deadline.
        self._host: HostExchange | None = None
        if host_comm is not None and len(host_workers or [worker_rank]) > 1:
            self._host = HostExchange(
                host_comm, host_workers, worker_rank, describe or (lambda rank: f"worker {rank}"),
                gather_timeout_s=max(timeout_s - SERVER_FIRST_S, timeout_s / 2),
                result_timeout_s=timeout_s + 2 * SERVER_FIRST_S,
                when_ready=self._when_ready, push=_queue, finish=self._finish)
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
        host = self._host
        backoff = Backoff(sleep=self._nap)
        last_check = time.monotonic()
        try:
            while True:
                # 1. take new groups
                local = host is not None and host.pending
                idle = not flows.waiting and not inflight and not local and not self._unready
                if not self._take_groups(flows, block=idle):
                    self._stopped.set()
                    return
                # 2. keys whose data became ready; start tasks within their engine's credit; 3. complete
                progressed = self._poll_unready() if self._unready else False
                progressed = self._start_ready(flows, inflight, sends, recvs) or progressed
                progressed = self._retire_done(inflight, sends, recvs) or progressed
                if host is not None:
                    progressed = host.progress() or progressed
                # 4. errors from servers and timeouts
                now = time.monotonic()
                if now - last_check > 0.2:
                    last_check = now
                    self._check_server_errors()
                    self._check_timeouts(inflight, now)
                    if host is not None:
                        host.check(now)
                local = host is not None and host.pending
                if progressed:
                    backoff.reset()
                elif inflight or local:
                    oldest = next(iter(inflight.values())).started if inflight else host.oldest_started()
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
        slots = key_slots([k.server for k in group.keys], self.rank, self.num_servers, policy.stagger, policy.waves)
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
            if self._host is None:
                self._when_ready(task, _queue)
            elif self._host.owns(group.keys[slot].key):
                self._host.gather(task)  # receives only; its own gradient is read when the others are in
            else:
                self._when_ready(task, self._host.contribute)

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
        if self._host is not None:
            self._host.forward(op.task, op.started)
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
