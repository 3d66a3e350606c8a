"""Credit and result window (imerge_hooks.flowcontrol), alone and inside the simulator."""

from __future__ import annotations

import math

import pytest

from imerge_hooks.flowcontrol import ReadyQueue, SendWindows
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
