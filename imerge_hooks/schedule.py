"""Which push a worker starts next: schedule order, the credit and the result window.

* **Credit** bounds the bytes pushed but not yet *delivered* to their server. It keeps
  preemption cheap: a push that has started is queued on its MPI connection, so priority can
  only reorder what still waits for credit.
* **Result window** bounds the bytes pushed whose *result* has not come back. A key's result
  leaves the server only when the slowest worker has pushed it, and TCP shares a server's
  ingress unevenly among the workers, for up to about a second at a time (the link monitor of
  ``benchmarks/run.py``, ``benchmarks/netlab/linkmon.py``, measures the spread). Without this
  window the favoured workers run ahead, the server's ingress fills with pushes of keys that
  cannot complete yet, and its egress idles until a burst of results at the end of the push
  phase. With it, a worker that is a window ahead waits and its share of the ingress goes to
  the workers it waits for. It is off by default
  (``Config.result_window_bytes``) because on the emulated cluster it did not pay;
  ``benchmarks/run.py --alternate result_window_bytes=none`` measures it with the plan held
  fixed (an A/B inside one launch).

Waiting for other workers' pushes could deadlock, because workers push keys in different
orders (stagger rotates each group's keys per worker; priority preemption depends on timing).
It cannot here. Every key has a place in an order all workers share: its group's (priority,
submission) order, then its slot in the group. When the window is full, a worker may still push
the earliest ready key in that shared order if it comes before some key it already waits on.
Take the earliest key, in the shared order, that some worker has not pushed. Every key that
worker waits on comes later (an earlier one has been pushed by everyone, so its result comes),
and that key is the earliest in its ready queue, so it may go. ``escape_s`` is a backstop all
the same: after that long without a result, one more push goes out, with a warning.

* **Tail credit** protects the gradients the next forward waits for first. They are the last
  of the backward (the front layers; the plan's last group, whose keys are *urgent*), and a
  push that has started cannot be overtaken on its connection: without the tail credit the
  last key of the backward can wait behind partitions pushed a few ms before it was ready, and
  the next forward with it (``benchmarks/run.py --timeline`` and ``benchmarks/timeline_report.py``
  show the forward's first wait; ``--alternate tail_credit_bytes=none`` is the A/B). So from
  the moment that group is due within about one credit's round trip (the *tail*:
  :func:`tail_start_group` picks the group whose submission starts it) until its keys are
  delivered, other keys may only have ``tail_credit`` bytes in flight; urgent keys keep the
  full credit. Links stay busy meanwhile: the servers' ingress is shared by all workers, so a
  small credit each still keeps it full.
"""

from __future__ import annotations

import heapq
import itertools
import logging
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .config import Config

log = logging.getLogger("imerge")

SharedOrder = tuple[int, int, int]  # (group priority or 0, group submission number, slot)


def key_slots(servers: Sequence[int], worker: int, num_servers: int, stagger: bool) -> list[int]:
    """The order worker ``worker`` pushes a group's keys (slot indices; ``servers[i]`` is slot i's
    server): slot order, rotated with ``stagger`` to start at server ``worker % num_servers``."""
    slots = list(range(len(servers)))
    if stagger and num_servers > 1 and len(slots) > 1:
        want = worker % num_servers
        first = next((i for i in slots if servers[i] == want), 0)
        slots = slots[first:] + slots[:first]
    return slots


def shared_order(priority: int, submission: int, slot: int) -> SharedOrder:
    """A key's place in the order every worker shares: (group priority or 0, the group's
    submission number on this worker, slot). Groups are submitted in the same order everywhere."""
    return (priority, submission, slot)


@dataclass
class SchedulePolicy:
    """How one engine's groups are pushed: the comm thread reads it, the simulator mirrors it."""

    priority: bool = False
    stagger: bool = False
    credit_bytes: int | None = None  # None: unlimited
    result_window_bytes: int | None = None  # None: unlimited
    tail_credit_bytes: int | None = None  # None: no tail credit

    @classmethod
    def from_config(cls, cfg: Config) -> SchedulePolicy:
        """The one rule from a schedule's traits to its push policy (every front end uses it)."""
        traits = cfg.traits
        return cls(priority=traits.priority, stagger=traits.stagger,
                   credit_bytes=cfg.credit_bytes if traits.partition else None,
                   result_window_bytes=cfg.result_window_bytes if traits.partition else None,
                   tail_credit_bytes=cfg.tail_credit_bytes if traits.tail_credit else None)


class SendWindows:
    """Credit and result window of one worker (``None``: no limit)."""

    def __init__(self, credit_bytes: int | None, result_window_bytes: int | None, escape_s: float = 1.0,
                 who: str = "", tail_credit_bytes: int | None = None) -> None:
        self.credit = credit_bytes
        self.window = result_window_bytes
        self.tail_credit = tail_credit_bytes
        self.urgent_left = 0  # > 0: in the tail, urgent keys not yet delivered (see the module doc)
        self.escape_s = escape_s
        self.who = who
        self.in_flight = 0  # pushed, not yet delivered
        self.awaiting = 0  # pushed, result not yet here
        self._awaited: Counter = Counter()  # shared order -> keys awaiting a result
        self._last_result = 0.0
        self.escapes = 0  # pushes let out by the backstop (should stay 0)

    def configure(self, credit_bytes: int | None, result_window_bytes: int | None,
                  tail_credit_bytes: int | None = None) -> None:
        self.credit, self.window, self.tail_credit = credit_bytes, result_window_bytes, tail_credit_bytes

    @property
    def in_tail(self) -> bool:
        return self.urgent_left > 0 and self.tail_credit is not None

    def begin_tail(self, urgent_keys: int) -> None:
        """The urgent group is due soon: hold other keys to the tail credit until its keys are delivered."""
        if self.tail_credit is not None and urgent_keys > 0:
            self.urgent_left = urgent_keys

    def urgent_delivered(self) -> None:
        if self.urgent_left > 0:
            self.urgent_left -= 1

    def credit_allows(self, nbytes: int, urgent: bool = True) -> bool:
        credit = self.credit
        if self.in_tail and not urgent:
            credit = self.tail_credit if credit is None else min(credit, self.tail_credit)
        return credit is None or not self.in_flight or self.in_flight + nbytes <= credit

    def window_allows(self, nbytes: int) -> bool:
        return self.window is None or not self.awaiting or self.awaiting + nbytes <= self.window

    def waits_on_later_key(self, order: SharedOrder) -> bool:
        """Some key this worker awaits comes after ``order`` in the shared order (module doc)."""
        return bool(self._awaited) and order < max(self._awaited)

    def backstop(self, now: float) -> bool:
        if now - self._last_result < self.escape_s:
            return False
        self.escapes += 1
        self._last_result = now
        log.warning("IMerge%s: no result for %.1f s while the result window (%d bytes awaiting) was full; one "
                    "more push goes out (backstop, %d so far)", self.who, self.escape_s, self.awaiting, self.escapes)
        return True

    def started(self, nbytes: int, order: SharedOrder, now: float) -> None:
        if not self.awaiting:
            self._last_result = now  # the backstop counts from the first push out
        self.in_flight += nbytes
        self.awaiting += nbytes
        self._awaited[order] += 1

    def delivered(self, nbytes: int) -> None:
        self.in_flight -= nbytes

    def resulted(self, nbytes: int, order: SharedOrder, now: float) -> None:
        self.awaiting -= nbytes
        self._last_result = now
        left = self._awaited[order] - 1
        if left:
            self._awaited[order] = left
        else:
            del self._awaited[order]


class ReadyQueue:
    """Keys waiting to be pushed, in schedule order (priority or FIFO) and in the shared order."""

    def __init__(self) -> None:
        self._schedule: list[list] = []  # [priority, seq, entry]
        self._shared: list[list] = []  # [shared order, seq, entry]
        self._seq = itertools.count()
        self._count = 0

    def __len__(self) -> int:
        return self._count

    def add(self, item: Any, nbytes: int, priority: int, order: SharedOrder, urgent: bool = False) -> None:
        entry = [item, nbytes, order, False, urgent]  # [3]: taken (lazy deletion from the other heap)
        seq = next(self._seq)
        heapq.heappush(self._schedule, [priority, seq, entry])
        heapq.heappush(self._shared, [order, seq, entry])
        self._count += 1

    def take(self, windows: SendWindows, now: float) -> Any:
        """The next key to push now, or None: the schedule's next, unless the result window holds it
        back, then the earliest key in the shared order if the worker waits on a later one."""
        head = _top(self._schedule)
        if head is None or not windows.credit_allows(head[1], head[4]):
            return None
        if windows.window_allows(head[1]):
            return self._pop(head)
        first = _top(self._shared)
        if windows.waits_on_later_key(first[2]) and windows.credit_allows(first[1], first[4]):
            return self._pop(first)
        if windows.backstop(now):
            return self._pop(head)
        return None

    def _pop(self, entry: list) -> Any:
        item, entry[0] = entry[0], None  # the taken entry may linger in the other heap: not its item
        entry[3] = True
        self._count -= 1
        for heap in (self._schedule, self._shared):  # drop taken entries now and then (lazy deletion)
            if len(heap) > 2 * self._count + 64:
                heap[:] = [e for e in heap if not e[2][3]]
                heapq.heapify(heap)
        return item


def _top(heap: list[list]) -> list | None:
    while heap and heap[0][2][3]:
        heapq.heappop(heap)
    return heap[0][2] if heap else None


def tail_start_group(group_ready_s: Sequence[float], window_s: float) -> int | None:
    """The group whose submission starts the tail: the first one (in send order) that becomes ready
    within ``window_s`` (about one credit's drain time) of the last group, the urgent one.

    ``group_ready_s``: each group's expected ready time in the backward (its last tensor's), in send
    order. None when there is no group.
    """
    if not group_ready_s:
        return None
    last = group_ready_s[-1]
    return next(g for g, ready in enumerate(group_ready_s) if last - ready <= window_s)


def tail_group(groups: Sequence[Sequence[int]], ready_s: Sequence[float], cost_model: Any,
               credit_bytes: int) -> int | None:
    """The group of a plan whose submission starts the tail: :func:`tail_start_group` over each
    group's ready time (its last tensor's) with one credit's round trip under ``cost_model``."""
    return tail_start_group([max(ready_s[i] for i in g) for g in groups], float(cost_model.time(credit_bytes)))

