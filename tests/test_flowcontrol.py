"""Credit and result window (imerge_hooks.schedule), alone and inside the simulator."""

from __future__ import annotations

import math

import pytest

from imerge_hooks.plan.costmodel import LinearModel
from imerge_hooks.schedule import ReadyQueue, SendWindows, tail_start_group
from imerge_hooks.simulate import ClusterSpec, LayerSpec, ModelSpec, simulate

MiB = 1 << 20


def test_credit_counts_bytes_until_delivery():
    w = SendWindows(credit_bytes=10, result_window_bytes=None)
    assert w.credit_allows(100)  # nothing in flight: one push always may go
    w.started(100, (0, 0, 0), 0.0)
    assert not w.credit_allows(1)
    w.delivered(100)
    assert w.credit_allows(10)
    assert w.awaiting == 100  # delivered, result not back yet


def queue_of(*keys):
    """A ReadyQueue of (name, nbytes, priority, shared order) in arrival order."""
    q = ReadyQueue()
    for name, nbytes, prio, order in keys:
        q.add(name, nbytes, prio, order)
    return q


def test_window_holds_back_the_schedules_next_key_but_not_an_earlier_shared_one():
    w = SendWindows(credit_bytes=None, result_window_bytes=8, escape_s=math.inf)
    # worker 1 of a staggered group: slots 1, 2 first (pushed), then 3, then 0
    w.started(4, (5, 0, 1), 0.0)
    w.started(4, (5, 0, 2), 0.0)
    q = queue_of(("slot3", 4, 5, (5, 0, 3)), ("slot0", 4, 5, (5, 0, 0)))
    assert q.take(w, 0.0) == "slot0"  # window full; slot 0 comes before keys it awaits
    w.started(4, (5, 0, 0), 0.0)
    assert q.take(w, 0.0) is None  # slot 3 comes after all of them: it waits
    w.resulted(4, (5, 0, 1), 0.1)
    w.resulted(4, (5, 0, 2), 0.1)
    assert q.take(w, 0.1) == "slot3" and len(q) == 0


def test_schedule_order_rules_while_the_window_has_room():
    w = SendWindows(credit_bytes=None, result_window_bytes=100)
    q = queue_of(("late", 4, 9, (9, 1, 0)), ("front", 4, 1, (1, 2, 0)))
    assert [q.take(w, 0.0), q.take(w, 0.0), q.take(w, 0.0)] == ["front", "late", None]


def test_taken_entries_do_not_pile_up():
    w = SendWindows(credit_bytes=None, result_window_bytes=None)
    q = ReadyQueue()
    for i in range(10_000):
        q.add(i, 1, 0, (0, i, 0))
        assert q.take(w, 0.0) == i
    assert len(q) == 0 and len(q._shared) < 100 and len(q._schedule) < 100


def test_credit_is_head_of_line():
    w = SendWindows(credit_bytes=8, result_window_bytes=None)
    w.started(6, (0, 0, 0), 0.0)
    q = queue_of(("big", 4, 0, (0, 1, 0)), ("small", 1, 0, (0, 1, 1)))
    assert q.take(w, 0.0) is None  # "small" would fit but does not overtake
    w.delivered(6)
    assert q.take(w, 0.0) == "big"


def test_backstop_lets_one_push_out_per_period_without_results(caplog):
    w = SendWindows(credit_bytes=None, result_window_bytes=4, escape_s=1.0, who=" worker 3")
    w.started(4, (0, 0, 0), 10.0)
    q = queue_of(("a", 4, 1, (1, 1, 0)), ("b", 4, 2, (2, 2, 0)))
    assert q.take(w, 10.5) is None
    with caplog.at_level("WARNING", logger="imerge"):
        assert q.take(w, 11.0) == "a"
    assert w.escapes == 1 and "worker 3" in caplog.text and "backstop" in caplog.text
    w.started(4, (1, 1, 0), 11.0)
    assert q.take(w, 11.5) is None  # the period restarts


def test_tail_credit_holds_other_keys_until_the_urgent_ones_are_delivered():
    w = SendWindows(credit_bytes=8, result_window_bytes=None, tail_credit_bytes=2)
    q = ReadyQueue()

    def take_and_start():
        item = q.take(w, 0.0)
        if item is not None:
            w.started(sizes[item], (0, 0, 0), 0.0)
        return item

    sizes = {"first": 2, "late": 2, "later": 2, "again": 2, "front0": 4, "front1": 4}
    q.add("first", 2, 9, (9, 0, 0))
    q.add("late", 2, 9, (9, 0, 1))
    assert [take_and_start(), take_and_start()] == ["first", "late"]  # no tail yet: the full credit
    w.begin_tail(urgent_keys=2)
    q.add("later", 2, 9, (9, 1, 0))
    assert take_and_start() is None  # 4 bytes in flight: over the tail credit
    w.delivered(2)
    w.delivered(2)
    assert take_and_start() == "later"  # nothing in flight: one push always may go
    q.add("again", 2, 9, (9, 1, 1))
    q.add("front0", 4, 0, (0, 2, 0), urgent=True)
    q.add("front1", 4, 0, (0, 2, 1), urgent=True)
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
    w = SendWindows(credit_bytes=8, result_window_bytes=None, tail_credit_bytes=None)
    w.begin_tail(urgent_keys=3)
    w.started(6, (9, 0, 0), 0.0)
    assert not w.in_tail and w.credit_allows(2, urgent=False)


def test_tail_starts_one_window_before_the_last_group():
    ready = [0.0, 0.1, 0.5, 0.8, 0.9, 1.0]
    assert tail_start_group(ready, 0.25) == 3
    assert tail_start_group(ready, 0.0) == 5  # the last group starts its own tail
    assert tail_start_group(ready, 5.0) == 0
    assert tail_start_group([], 1.0) is None


def model(layers: int = 6, nbytes: int = 4 * MiB) -> ModelSpec:
    return ModelSpec([LayerSpec(f"l{i}", [nbytes, nbytes // 4], 1e-3, 2e-3) for i in range(layers)], batch_size=8)


@pytest.mark.parametrize("window", [1, 64 * 1024, 4 * MiB, 16 * MiB])
@pytest.mark.parametrize("workers,servers", [(3, 2), (8, 2), (5, 3)])
def test_simulated_windows_never_deadlock(window, workers, servers):
    """Stagger and priority give every worker its own push order; the simulator has no backstop,
    so a deadlock would stop it (it raises when a worker cannot finish)."""
    cluster = ClusterSpec(workers, servers, 1e9, 1e-4, share_cv=0.5, share_period_s=0.003)
    for schedule in ("priority", "imerge"):
        res = simulate(model(), cluster, schedule, partition_bytes=MiB, credit_bytes=2 * MiB,
                       result_window_bytes=window, plan_search=False, timeline=False)
        assert math.isfinite(res.iteration_s) and res.iteration_s > 0


def test_no_window_is_the_old_model_and_the_window_pays_under_uneven_sharing():
    spec = model(layers=8)
    fair = ClusterSpec(8, 2, 1e9, 1e-5)
    uneven = ClusterSpec(8, 2, 1e9, 1e-5, share_cv=0.6, share_period_s=0.1)

    def t(cluster, window):
        return simulate(spec, cluster, "imerge", partition_bytes=MiB, result_window_bytes=window,
                        plan_search=False, timeline=False).iteration_s

    assert t(uneven, 4 * MiB) < t(uneven, None)
    assert t(fair, 4 * MiB) <= 1.05 * t(fair, None)


def test_simulated_tail_credit_keeps_the_front_layer_off_the_back_of_the_queue():
    """One worker, one server, 1 MB/s each way, no startup. The back layer (4 x 1 MB partitions,
    credit 2 MB) is ready at 0.12 s, the front layer (1 kB, the urgent last group) at 1.62 s.
    Without a tail, partition 3 starts at 1.12 s and fills the credit: the front push waits for
    credit until 2.12 s, leaves behind partition 3 (delivered 3.12 s), and its result queues behind
    three partitions' results: 4.121 s. With the tail from the back layer's submission, one
    partition at a time is in flight: the front push goes at 1.62 s behind partition 2 (2.12 s)
    and its result comes back behind two results: 3.121 s. The next forward starts then."""
    spec = ModelSpec([LayerSpec("front", [1000], 0.01, 1.5), LayerSpec("back", [4_000_000], 0.01, 0.1)],
                     batch_size=1)
    cluster = ClusterSpec(1, 1, 1e6, 0.0)

    def next_forward_start(tail):
        res = simulate(spec, cluster, "imerge", groups=[[1], [0]], partition_bytes=1_000_000,
                       credit_bytes=2_000_000, tail_credit_bytes=tail, cost_model=LinearModel(0.0, 1e-5),
                       iterations=2, plan_search=False)
        return min(e.start for e in res.timeline if e.name == "forward front" and e.start > 1.0)

    assert next_forward_start(None) == pytest.approx(4.121, abs=1e-6)
    assert next_forward_start(500_000) == pytest.approx(3.121, abs=1e-6)
