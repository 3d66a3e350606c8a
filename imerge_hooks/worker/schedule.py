"""Which push a worker starts next: schedule order, the credit and the tail credit.

* **Credit** bounds the bytes pushed but not yet *delivered* to their server. It keeps
  preemption cheap: a push that has started is queued on its MPI connection, so priority can
  only reorder what still waits for credit.
* **Tail credit** protects the gradients the next forward waits for first. They are the last
  of the backward (the front layers; the plan's last group, whose keys are *urgent*), and a
  push that has started cannot be overtaken on its connection: without the tail credit the
  last key of the backward can wait behind partitions pushed a few ms before it was ready, and
  the next forward with it (``benchmarks/run.py --timeline`` and ``imerge-timeline-report``
  show the forward's first wait; ``--alternate tail_credit_bytes=none`` is the A/B). So from
  the moment that group is due within about one credit's round trip (the *tail*:
  :func:`tail_start_group` picks the group whose submission starts it) until its keys are
  delivered, other keys may only have ``tail_credit`` bytes in flight; urgent keys keep the
  full credit. Links stay busy meanwhile: the servers' ingress is shared by all workers, so a
  small credit each still keeps it full.
"""

from __future__ import annotations

import functools
import heapq
import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..core.config import Config


def key_slots(servers: Sequence[int], worker: int, num_servers: int, stagger: bool,
              waves: bool = False) -> list[int]:
    """The order worker ``worker`` pushes a group's keys (slot indices; ``servers[i]`` is slot i's
    server): slot order, rotated with ``stagger`` to start at server ``worker % num_servers``; with
    ``waves`` too, each wave of the group is rotated instead of the whole group.

    A group's i-th key on each server is in wave i. A key completes only with its last push: rotating
    the whole group puts the keys before a worker's first server last in its sequence, so the group's
    first S - 1 keys each complete only at the group's end (at W = S = 256 that is most of AlexNet's
    largest layer, which then comes back only after it was pushed whole). In waves, each wave completes
    on every worker at about the same time and its results travel while the next one is pushed. The
    plan search chooses it (``Plan.waves``)."""
    slots = list(range(len(servers)))
    if not (stagger and num_servers > 1 and len(slots) > 1):
        return slots
    if waves:
        return list(_in_waves(tuple(servers), worker % num_servers, num_servers))
    want = worker % num_servers
    first = next((i for i in slots if servers[i] == want), 0)
    return slots[first:] + slots[:first]


@functools.lru_cache(maxsize=4096)
def _in_waves(servers: tuple[int, ...], start: int, num_servers: int) -> tuple[int, ...]:
    seen: dict[int, int] = {}
    wave = []
    for server in servers:
        wave.append(seen.get(server, 0))
        seen[server] = wave[-1] + 1
    return tuple(sorted(range(len(servers)), key=lambda i: (wave[i], (servers[i] - start) % num_servers, i)))


@dataclass
class SchedulePolicy:
    """How one engine's groups are pushed: the comm thread reads it, the simulator mirrors it."""

    priority: bool = False
    stagger: bool = False
    credit_bytes: int | None = None  # None: unlimited
    tail_credit_bytes: int | None = None  # None: no tail credit
    server_credit_bytes: int | None = None  # None: no window per server
    waves: bool = False  # with stagger: rotate each wave of a group, not the whole group (key_slots)

    @classmethod
    def from_config(cls, cfg: Config, servers: int = 1, credit_bytes: int | None = None) -> SchedulePolicy:
        """The one rule from a schedule's traits to its push policy (every front end uses it).
        ``credit_bytes``: the window a plan chose (None: ``cfg.credit_bytes``); see :func:`windows`."""
        traits = cfg.traits
        if not traits.partition:
            return cls(priority=traits.priority, stagger=traits.stagger)
        credit, per_server = windows(cfg.credit_bytes if credit_bytes is None else credit_bytes,
                                     cfg.partition_bytes, servers)
        return cls(priority=traits.priority, stagger=traits.stagger, credit_bytes=credit,
                   tail_credit_bytes=cfg.tail_credit_bytes if traits.tail_credit else None,
                   server_credit_bytes=per_server)


def windows(credit_bytes: int, partition_bytes: int, servers: int,
            server_credit_bytes: int | None = None) -> tuple[int, int | None]:
    """The credit windows of a partitioned schedule on ``servers`` servers: (a worker's window, its window
    per server). ``server_credit_bytes``: the window per server a plan chose (None: one partition).

    One window per worker lets every worker push the same few keys when they push in the same order
    (priority: the front layers first), so those keys' servers take all the traffic while the others idle;
    a window per server of one partition instead lets a worker feed each server one key at a time, its most
    urgent one there, and a worker's window of at least one partition per server lets it reach them all.
    With one server the worker's window alone decides."""
    if servers <= 1:
        return credit_bytes, None
    per_server = partition_bytes if server_credit_bytes is None else server_credit_bytes
    return max(credit_bytes, servers * per_server), per_server


class Credit:
    """The credit, tail credit and window per server of one worker (``None``: no limit; see the module doc)."""

    def __init__(self, credit_bytes: int | None, tail_credit_bytes: int | None = None,
                 server_credit_bytes: int | None = None) -> None:
        self.credit = credit_bytes
        self.tail_credit = tail_credit_bytes
        self.server_credit = server_credit_bytes
        self.urgent_left = 0  # > 0: in the tail, urgent keys not yet delivered (see the module doc)
        self.in_flight = 0  # pushed, not yet delivered
        self.to_server: dict[int, int] = {}  # server -> its bytes in flight (with a window per server)

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

    def allows(self, nbytes: int, urgent: bool = True) -> bool:
        """Whether the worker's window (and the tail credit) lets a push of ``nbytes`` start."""
        credit = self.credit
        if self.in_tail and not urgent:
            credit = self.tail_credit if credit is None else min(credit, self.tail_credit)
        return credit is None or not self.in_flight or self.in_flight + nbytes <= credit

    def server_allows(self, server: int) -> bool:
        """Whether the window per server lets another push to ``server`` start (less than it in flight)."""
        return self.server_credit is None or self.to_server.get(server, 0) < self.server_credit

    def started(self, nbytes: int, server: int = 0) -> None:
        self.in_flight += nbytes
        if self.server_credit is not None:
            self.to_server[server] = self.to_server.get(server, 0) + nbytes

    def delivered(self, nbytes: int, server: int = 0) -> None:
        self.in_flight -= nbytes
        if self.server_credit is not None:
            left = self.to_server[server] - nbytes
            if left:
                self.to_server[server] = left
            else:
                del self.to_server[server]


class ReadyQueue:
    """Keys waiting to be pushed, in schedule order: priority (lower first), then arrival; with a window per
    server, the first key whose server's window is open (see :meth:`take`)."""

    def __init__(self) -> None:
        self._seq = itertools.count()
        self._by_server: dict[int, list[tuple[int, int, Any, int, bool]]] = {}  # (priority, seq, item, nbytes, urgent)
        self._heads: list[tuple[int, int, int]] = []  # (priority, seq, server): each open server's first key
        self._parked: dict[int, tuple[int, int, int]] = {}  # server whose window is full -> its head entry
        self._len = 0

    def __len__(self) -> int:
        return self._len

    def add(self, item: Any, nbytes: int, priority: int, urgent: bool = False, server: int = 0) -> None:
        seq = next(self._seq)
        entry = (priority, seq, item, nbytes, urgent)
        queue = self._by_server.get(server)
        if queue is None:
            queue = self._by_server[server] = []
        self._len += 1
        first = not queue or (priority, seq) < queue[0][:2]
        heapq.heappush(queue, entry)
        if not first:
            return
        head = (priority, seq, server)  # the server's new first key
        if server in self._parked:
            self._parked[server] = head
            return
        if len(queue) > 1:  # replace its old head entry
            self._heads = [h for h in self._heads if h[2] != server]
            heapq.heapify(self._heads)
        heapq.heappush(self._heads, head)

    def take(self, credit: Credit) -> Any:
        """The schedule's next key if the credit lets it go now, else None: the first key (priority, then
        arrival) among the servers whose window is open; the worker's window holds it back if it is full
        (no later key overtakes it then). A server whose window is full is parked until :meth:`unpark`."""
        heads = self._heads
        while heads:
            server = heads[0][2]
            queue = self._by_server[server]
            _, _, item, nbytes, urgent = queue[0]
            if not credit.server_allows(server):
                self._parked[server] = heapq.heappop(heads)
                continue
            if not credit.allows(nbytes, urgent):
                return None
            heapq.heappop(heads)
            heapq.heappop(queue)
            self._len -= 1
            if queue:
                heapq.heappush(heads, (queue[0][0], queue[0][1], server))
            else:
                del self._by_server[server]
            return item
        return None

    def unpark(self, server: int) -> None:
        """``server``'s window may have opened (a push to it was delivered)."""
        head = self._parked.pop(server, None)
        if head is not None:
            heapq.heappush(self._heads, head)


class Flow:
    """One engine's flow control: its keys waiting to be pushed, in its schedule's order, and its
    credit. Engines on different schedules (two optimizers, the DDP hook beside an optimizer) share
    a worker's comm thread, not their credit: each is held to its own schedule's window."""

    def __init__(self, policy: SchedulePolicy) -> None:
        self.policy = policy
        self.ready = ReadyQueue()
        self.credit = Credit(policy.credit_bytes, policy.tail_credit_bytes, policy.server_credit_bytes)
        self.keys = 0  # keys taken in and not finished

    def delivered(self, nbytes: int, server: int, urgent: bool) -> None:
        """A push of ``nbytes`` to ``server`` reached it: its credit comes back."""
        credit = self.credit
        credit.delivered(nbytes, server)
        if urgent:
            credit.urgent_delivered()
        self.ready.unpark(server)


class Flows:
    """A worker's flows, one per engine policy (an engine's ``SchedulePolicy`` object; a new policy,
    after ``set_policy``, is a new flow while the old one drains)."""

    def __init__(self) -> None:
        self._by_policy: dict[int, Flow] = {}  # id(policy) -> its flow, which holds the policy alive

    def of(self, policy: SchedulePolicy) -> Flow:
        flow = self._by_policy.get(id(policy))
        if flow is None:
            flow = self._by_policy[id(policy)] = Flow(policy)
        return flow

    def __iter__(self):
        return iter(list(self._by_policy.values()))

    @property
    def waiting(self) -> bool:
        """Whether any key waits for credit."""
        return any(flow.ready for flow in self._by_policy.values())

    def take(self) -> Any:
        """The next (flow, key) that a flow's credit lets go now, or None; the credit counts it started
        with ``flow.credit.started`` by the caller."""
        for flow in self._by_policy.values():
            item = flow.ready.take(flow.credit)
            if item is not None:
                return flow, item
        return None

    def finished(self, flow: Flow, keys: int = 1) -> None:
        """``keys`` of ``flow`` are done; a flow with nothing left is forgotten."""
        flow.keys -= keys
        if flow.keys <= 0 and not flow.ready and self._by_policy.get(id(flow.policy)) is flow:
            del self._by_policy[id(flow.policy)]


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

