"""Credit and tail credit (imerge_hooks.worker.schedule): what a worker pushes next."""

from __future__ import annotations

from imerge_hooks.core.config import Config
from imerge_hooks.worker.schedule import Credit, Flow, Flows, ReadyQueue, SchedulePolicy, tail_start_group, windows


def test_credit_counts_bytes_until_delivery():
    c = Credit(credit_bytes=10)
    assert c.allows(100)  # nothing in flight: one push always may go
    c.started(100)
    assert not c.allows(1)
    c.delivered(100)
    assert c.allows(10)


def queue_of(*keys):
    """A ReadyQueue of (name, nbytes, priority) in arrival order."""
    q = ReadyQueue()
    for name, nbytes, prio in keys:
        q.add(name, nbytes, prio)
    return q


def test_priority_then_arrival_order():
    c = Credit(None)
    q = queue_of(("late", 4, 9), ("front", 4, 1), ("front too", 4, 1))
    assert [q.take(c), q.take(c), q.take(c), q.take(c)] == ["front", "front too", "late", None]


def test_credit_is_head_of_line():
    c = Credit(credit_bytes=8)
    c.started(6)
    q = queue_of(("big", 4, 0), ("small", 1, 0))
    assert q.take(c) is None  # "small" would fit but does not overtake
    c.delivered(6)
    assert q.take(c) == "big"


def test_tail_credit_holds_other_keys_until_the_urgent_ones_are_delivered():
    w = Credit(credit_bytes=8, tail_credit_bytes=2)
    q = ReadyQueue()

    def take_and_start():
        item = q.take(w)
        if item is not None:
            w.started(sizes[item])
        return item

    sizes = {"first": 2, "late": 2, "later": 2, "again": 2, "front0": 4, "front1": 4}
    q.add("first", 2, 9)
    q.add("late", 2, 9)
    assert [take_and_start(), take_and_start()] == ["first", "late"]  # no tail yet: the full credit
    w.begin_tail(urgent_keys=2)
    q.add("later", 2, 9)
    assert take_and_start() is None  # 4 bytes in flight: over the tail credit
    w.delivered(2)
    w.delivered(2)
    assert take_and_start() == "later"  # nothing in flight: one push always may go
    q.add("again", 2, 9)
    q.add("front0", 4, 0, urgent=True)
    q.add("front1", 4, 0, urgent=True)
    assert take_and_start() == "front0"  # urgent keys use the full credit: 2 + 4 <= 8
    assert take_and_start() is None  # 6 + 4 > 8
    w.delivered(4)
    w.urgent_delivered()
    assert take_and_start() == "front1"
    assert take_and_start() is None and w.in_tail  # one urgent key not yet delivered
    w.delivered(4)
    w.urgent_delivered()
    assert not w.in_tail and take_and_start() == "again"  # tail over: 2 + 2 <= 8


def test_no_tail_credit_means_no_tail():
    w = Credit(credit_bytes=8, tail_credit_bytes=None)
    w.begin_tail(urgent_keys=3)
    w.started(6)
    assert not w.in_tail and w.allows(2, urgent=False)


def test_tail_starts_one_window_before_the_last_group():
    ready = [0.0, 0.1, 0.5, 0.8, 0.9, 1.0]
    assert tail_start_group(ready, 0.25) == 3
    assert tail_start_group(ready, 0.0) == 5  # the last group starts its own tail
    assert tail_start_group(ready, 5.0) == 0
    assert tail_start_group([], 1.0) is None


def test_each_engine_keeps_its_own_credit():
    """Two engines on one comm thread: a later group of the unlimited one does not lift the windowed
    one's credit for keys already queued, and neither blocks the other."""
    windowed, unlimited = SchedulePolicy(priority=True, credit_bytes=8), SchedulePolicy()
    flows = Flows()
    a = flows.of(windowed)
    for name in ("a1", "a2", "a3"):
        a.ready.add(name, 4, 0)
    a.keys += 3
    b = flows.of(unlimited)  # the hook's group, submitted after the optimizer's
    b.ready.add("b1", 100, 0)
    b.keys += 1
    started = []
    while (taken := flows.take()) is not None:
        flow, key = taken
        flow.credit.started(100 if key == "b1" else 4)
        started.append(key)
    assert started == ["a1", "a2", "b1"]  # a3 waits for a's credit (8 bytes), b1 goes
    assert flows.of(windowed) is a and a.credit.in_flight == 8
    a.credit.delivered(4)
    assert flows.take() == (a, "a3")


def test_a_drained_flow_is_forgotten():
    policy = SchedulePolicy(credit_bytes=8)
    flows = Flows()
    flow = flows.of(policy)
    flow.ready.add("k", 4, 0)
    flow.keys += 1
    assert flows.take() == (flow, "k")
    flows.finished(flow)
    assert list(flows) == [] and flows.of(policy) is not flow


def test_a_window_per_server_lets_the_next_server_go_first():
    """A full server's window parks its keys; the most urgent key of another server goes instead, in
    priority order, and the parked key goes once a push to its server is delivered."""
    flow = Flow(SchedulePolicy(priority=True, credit_bytes=100, server_credit_bytes=4))
    q, c = flow.ready, flow.credit
    for name, prio, server in (("a0", 0, 0), ("a1", 1, 0), ("b2", 2, 1), ("c3", 3, 2), ("b1", 1, 1)):
        q.add(name, 4, prio, server=server)
    taken = []
    while (item := q.take(c)) is not None:
        taken.append(item)
        c.started(4, {"a": 0, "b": 1, "c": 2}[item[0]])
    assert taken == ["a0", "b1", "c3"]  # one key per server, each server's first; a1 and b2 wait
    assert len(q) == 2
    flow.delivered(4, 1, urgent=False)
    assert q.take(c) == "b2"  # server 1's window opened; server 0's is still full
    c.started(4, 1)
    assert q.take(c) is None
    flow.delivered(4, 0, urgent=False)
    assert q.take(c) == "a1"
    c.started(4, 0)
    assert not q and c.in_flight == 3 * 4 and c.to_server == {0: 4, 1: 4, 2: 4}


def test_the_workers_window_still_holds_every_server():
    c = Credit(credit_bytes=8, server_credit_bytes=4)
    q = ReadyQueue()
    for name, server in (("x", 0), ("y", 1), ("z", 2)):
        q.add(name, 4, 0, server=server)
    assert q.take(c) == "x"
    c.started(4, 0)
    assert q.take(c) == "y"
    c.started(4, 1)
    assert q.take(c) is None  # 8 bytes in flight: the worker's window is full, whichever server
    c.delivered(4, 1)
    assert q.take(c) == "z"


def test_a_later_key_of_higher_priority_becomes_its_servers_first():
    c = Credit(None, server_credit_bytes=4)
    q = ReadyQueue()
    q.add("back", 4, 5, server=0)
    q.add("other", 4, 3, server=1)
    q.add("front", 4, 1, server=0)  # arrives later, goes first
    assert [q.take(c), q.take(c)] == ["front", "other"]


def test_windows_are_sized_to_the_servers():
    assert windows(8 << 20, 4 << 20, 1) == (8 << 20, None)  # one server: the worker's window alone
    assert windows(8 << 20, 4 << 20, 8) == (32 << 20, 4 << 20)  # one partition to each of 8 servers
    assert windows(64 << 20, 1 << 20, 4) == (64 << 20, 1 << 20)  # a larger window stays
    cfg = Config(schedule="priority", partition_bytes=1 << 20, credit_bytes=2 << 20)
    policy = SchedulePolicy.from_config(cfg, servers=4)
    assert (policy.credit_bytes, policy.server_credit_bytes) == (4 << 20, 1 << 20)
    assert SchedulePolicy.from_config(Config(schedule="wfbp"), servers=4).server_credit_bytes is None
