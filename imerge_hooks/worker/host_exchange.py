"""Host aggregation: the workers of one host sum each key before one of them, the key's owner, pushes it.

``HostExchange`` runs a worker's traffic on its host's communicator for the comm thread (the only
thread that calls it): the owner of a key gathers its host's gradients and, once the server's result
is back, forwards it to them; every other local worker contributes its gradient to the owner and
receives the result from it. It also watches its local workers: deadlines, steps, shutdowns.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from ..core._mpi import MPI
from ..core.errors import IMergeError, IMergeTimeoutError
from ..core.layout import key_owner
from ..core.requests import PendingRequests
from ..core.wire import ROUND_TAGS, TAG_HOST_SHUTDOWN, key_tag, split_key_tag
from .group import Group


class KeyTask(Protocol):
    """One key of a submitted group, as the comm thread holds it."""

    group: Group
    slot: int  # index into group.keys
    buffer: list | None  # what to push, when not the group's own bytes (the host's sum)


@dataclass
class _Local:
    """One key's traffic inside the host. ``gather``: the key's owner receives the other local workers'
    gradients; ``forward``: it hands them the result; ``contribute``: another worker sends the owner its
    gradient and receives the result from it."""

    task: KeyTask
    kind: str
    peers: list[int]  # local ranks, one per request
    started: float
    left: int
    done: set = field(default_factory=set)  # peers whose request completed


class HostExchange:
    """A worker's host aggregation, on ``comm`` (its host's workers, ``workers``: world ranks in local order).

    The comm thread passes what comes after the host: ``when_ready(task, then)`` runs ``then(task)`` once
    the key's data is ready (``Group.slot_ready``), ``push(task)`` queues the host's sum for credit, and
    ``finish(task, started)`` ends the key on this worker. An owner gives up on a missing gradient after
    ``gather_timeout_s``; a forward or a contribution waits ``result_timeout_s`` for its peer."""

    def __init__(self, comm: MPI.Comm, workers: list[int], rank: int, describe: Callable[[int], str], *,
                 gather_timeout_s: float, result_timeout_s: float,
                 when_ready: Callable[[KeyTask, Callable[[KeyTask], None]], None],
                 push: Callable[[KeyTask], None], finish: Callable[[KeyTask, float], None]) -> None:
        self.comm = comm
        self.workers = list(workers)
        self.size = len(self.workers)
        self.local_rank = self.workers.index(rank)
        self.describe = describe
        self.gather_timeout_s = gather_timeout_s
        self.result_timeout_s = result_timeout_s
        self._when_ready = when_ready
        self._push = push
        self._finish = finish
        self._requests = PendingRequests()  # requests of _Local operations, owned by (op, peer)
        self._ops: dict[int, _Local] = {}  # id(op) -> op
        self._gone: set[int] = set()  # local ranks that shut down (TAG_HOST_SHUTDOWN)

    # ------------------------------------------------------------------ interface (comm thread)
    def owns(self, key: int) -> bool:
        """Whether this worker pushes ``key`` for its host (``layout.key_owner``)."""
        return key_owner(key, self.size) == self.local_rank

    def gather(self, task: KeyTask) -> None:
        """Owner: receive the other local workers' gradients of the key (at once: receives only; its own
        gradient is read when the others are in), then push the sum."""
        self._start(task, "gather")

    def contribute(self, task: KeyTask) -> None:
        """Not the owner: send the owner this worker's gradient (its data ready) and receive the result."""
        self._start(task, "contribute")

    def forward(self, task: KeyTask, started: float) -> None:
        """Owner: the result is back from the server; hand it to the other local workers."""
        self._start(task, "forward", started)

    @property
    def pending(self) -> bool:
        """Whether a local operation is in flight."""
        return bool(self._ops)

    def oldest_started(self) -> float:
        """When the oldest local operation in flight started (``pending`` must be true)."""
        return next(iter(self._ops.values())).started

    def progress(self) -> bool:
        """Advance the operations whose requests finished (one progress call); True if any."""
        if not self._ops:
            return False
        finished = self._requests.completed(full=True)
        for op, peer in finished:
            op.left -= 1
            op.done.add(peer)
            if op.left:
                continue
            del self._ops[id(op)]
            task = op.task
            if op.kind == "gather":  # the host's gradients are in; once its own is, the sum goes like any push
                self._when_ready(task, lambda t, parts=len(op.peers): self._push_sum(t, parts))
            else:
                self._finish(task, op.started)
        return bool(finished)

    def check(self, now: float) -> None:
        """Name the local worker a key waits for past its deadline: a gather gives up first (before
        the server's stall clock, so the worker that failed is named, not the owner that waits for it);
        then a local worker out of step, or one that shut down."""
        if not self._ops:
            return
        for op in self._ops.values():
            spec = op.task.group.keys[op.task.slot]
            late = now - op.started
            missing = sorted({self.workers[p] for p in op.peers if p not in op.done})
            who = ", ".join(self.describe(r) for r in missing)
            if op.kind == "gather" and late > self.gather_timeout_s:
                raise IMergeTimeoutError(
                    f"IMerge {self.describe(self.workers[self.local_rank])}: no gradient of "
                    f"{spec.describe()} from {who} after {late:.0f} s (host aggregation: the workers of a host sum "
                    "each key before one of them pushes it); it is dead or stuck")
            if op.kind != "gather" and late > self.result_timeout_s:
                what = "did not take the result of" if op.kind == "forward" else "sent no result for"
                raise IMergeTimeoutError(
                    f"IMerge {self.describe(self.workers[self.local_rank])}: {who} {what} "
                    f"{spec.describe()} after {late:.0f} s; a worker or server may be dead or stuck")
        self._check_mates_rounds()
        self._check_mates_gone()

    # ------------------------------------------------------------------ internals
    def _start(self, task: KeyTask, kind: str, started: float | None = None) -> None:
        """Start ``kind`` (see ``_Local``) for ``task``'s key on the host communicator."""
        group, comm = task.group, self.comm
        spec = group.keys[task.slot]
        start, end = group.key_ranges[task.slot]
        tag = key_tag(spec.key, group.round)
        owner = key_owner(spec.key, self.size)
        if kind == "contribute":
            peers = [owner, owner]
            requests = [comm.Irecv(group.recv_buffer(task.slot), source=owner, tag=tag),
                        comm.Isend(group.send_buffer(task.slot), dest=owner, tag=tag)]
        else:
            peers = [m for m in range(self.size) if m != self.local_rank]
            if kind == "gather":
                scratch, n = group.gather_buffer(task.slot, len(peers)), end - start
                requests = [comm.Irecv(group.mpi_buffer(scratch, i * n, (i + 1) * n), source=m, tag=tag)
                            for i, m in enumerate(peers)]
            else:
                result = group.mpi_buffer(group.result, start, end)
                requests = [comm.Isend(result, dest=m, tag=tag) for m in peers]
        op = _Local(task, kind, peers, time.monotonic() if started is None else started, len(requests))
        self._ops[id(op)] = op
        for peer, request in zip(peers, requests):
            self._requests.add(request, (op, peer))

    def _push_sum(self, task: KeyTask, parts: int) -> None:
        """The key's owner: add its host's gradients to its own; the sum waits for credit."""
        task.buffer = task.group.add_contributions(task.slot, parts)
        self._push(task)

    def _check_mates_gone(self) -> None:
        """A local worker shut down while this one waits for it: it ran out of data without join()."""
        status = MPI.Status()
        while self.comm.Iprobe(MPI.ANY_SOURCE, TAG_HOST_SHUTDOWN, status):
            self.comm.recv(source=status.Get_source(), tag=TAG_HOST_SHUTDOWN)
            self._gone.add(status.Get_source())
        for op in self._ops.values():
            waited = [p for p in op.peers if p in self._gone and p not in op.done]
            if waited:
                raise IMergeError(
                    f"IMerge {self.describe(self.workers[self.local_rank])}: "
                    f"{self.describe(self.workers[waited[0]])} shut down while this worker still trains "
                    f"({op.task.group.keys[op.task.slot].describe()} waits for it); a worker that runs out of data "
                    "must call imerge_hooks.join()")

    def _check_mates_rounds(self) -> None:
        """A local worker's gradient for a key this worker gathers, but of another step: it is out of step."""
        gathering = {(op.task.group.keys[op.task.slot].key, p): op for op in self._ops.values()
                     if op.kind == "gather" for p in op.peers if p not in op.done}
        status = MPI.Status()
        for peer in sorted({p for _, p in gathering}):
            if not self.comm.Iprobe(peer, MPI.ANY_TAG, status):
                continue
            key, round_number = split_key_tag(status.Get_tag())
            op = gathering.get((key, peer))
            if op is not None and round_number != op.task.group.round % ROUND_TAGS:
                raise IMergeError(
                    f"IMerge {self.describe(self.workers[self.local_rank])}: "
                    f"{self.describe(self.workers[peer])} sent its gradient of "
                    f"{op.task.group.keys[op.task.slot].describe()} for another step than this worker's (round "
                    f"{round_number} against {op.task.group.round % ROUND_TAGS}, modulo {ROUND_TAGS}): workers "
                    "are out of step (one skipped a backward before step(), or called step() or backward() a "
                    "different number of times)")
