"""Credit and tail credit (imerge_hooks.schedule): what a worker pushes next."""

from __future__ import annotations

from imerge_hooks.schedule import Credit, Flows, ReadyQueue, SchedulePolicy, tail_start_group


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
