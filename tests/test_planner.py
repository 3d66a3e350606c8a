"""Planner: optimal is exact (brute force), never worse than the others; plans are valid."""

from __future__ import annotations

import itertools
import math
import random

import pytest

from imerge_hooks.plan.costmodel import LinearModel, PSModel
from imerge_hooks.plan.planner import METHODS, Plan, plan, simulate_fifo

KiB, MiB = 1 << 10, 1 << 20
LINEAR = LinearModel(alpha=2e-4, beta=1e-9)  # ~1 GB/s, 200 us startup
# PS table with a large startup jump at 256 KiB (incast) and a flat stretch.
PS = PSModel.fit(16, 2, [float(KiB * 4**k) for k in range(9)],
                 [5e-5, 6e-5, 8e-5, 3e-3, 3.1e-3, 3.2e-3, 1.2e-2, 4.5e-2, 1.8e-1])


class SqrtModel:
    """Concave, monotone, no ``time_array``: exercises the planner's scalar path."""

    def time(self, nbytes: float) -> float:
        return 1e-4 + 2e-6 * math.sqrt(nbytes)


MODELS = {"linear": LINEAR, "ps": PS, "sqrt": SqrtModel()}


def random_instance(rng: random.Random, max_len: int = 12):
    n = rng.randint(1, max_len)
    sizes = [float(rng.randint(KiB, 8 * MiB)) for _ in range(n)]
    gap = rng.choice([1e-5, 1e-4, 1e-3, 1e-2])  # from comm-bound to compute-bound
    ready, t = [], 0.0
    for _ in range(n):
        t += rng.uniform(0.0, 2 * gap)
        ready.append(t)
    return sizes, ready


def partitions(n: int):
    """Every split of 0..n-1 into contiguous groups (2^(n-1) of them)."""
    for cuts in itertools.product((False, True), repeat=n - 1):
        groups, cur = [], [0]
        for i, cut in enumerate(cuts, start=1):
            if cut:
                groups.append(cur)
                cur = []
            cur.append(i)
        groups.append(cur)
        yield groups


def brute_force_end(sizes, ready, model, dtypes=None):
    best = math.inf
    for groups in partitions(len(sizes)):
        if dtypes is not None and any(len({dtypes[i] for i in g}) > 1 for g in groups):
            continue
        best = min(best, simulate_fifo(groups, sizes, ready, model)[1][-1])
    return best


def check_valid(p: Plan, n: int, dtypes=None):
    flat = [i for g in p.groups for i in g]
    assert flat == list(range(n)), p.groups  # contiguous, in order, each index exactly once
    assert all(g for g in p.groups)
    assert all(g == list(range(g[0], g[-1] + 1)) for g in p.groups)
    if dtypes is not None:
        assert all(len({dtypes[i] for i in g}) == 1 for g in p.groups)
    assert len(p.group_start) == len(p.group_end) == len(p.groups)
    if p.groups:
        assert p.predicted_end == p.group_end[-1]


@pytest.mark.parametrize("name", sorted(MODELS))
def test_optimal_matches_brute_force(name):
    model = MODELS[name]
    rng = random.Random(1234 + len(name))
    for _ in range(25):
        sizes, ready = random_instance(rng)
        p = plan(sizes, ready, model, "optimal")
        check_valid(p, len(sizes))
        assert p.predicted_end == pytest.approx(brute_force_end(sizes, ready, model), rel=1e-12)


def test_optimal_matches_brute_force_with_dtypes():
    rng = random.Random(7)
    for _ in range(20):
        sizes, ready = random_instance(rng, max_len=10)
        dtypes = [rng.choice(["float32", "float16"]) for _ in sizes]
        for model in (LINEAR, PS):
            p = plan(sizes, ready, model, "optimal", dtypes=dtypes)
            check_valid(p, len(sizes), dtypes)
            want = brute_force_end(sizes, ready, model, dtypes)
            assert p.predicted_end == pytest.approx(want, rel=1e-12)


def test_optimal_never_worse_and_all_plans_valid():
    rng = random.Random(99)
    for _ in range(60):
        sizes, ready = random_instance(rng, max_len=40)
        dtypes = rng.choice([None, [rng.choice(["float32", "bfloat16"]) for _ in sizes]])
        threshold = rng.choice([256 * KiB, 4 * MiB, 25 * MiB])
        for model in MODELS.values():
            plans = {m: plan(sizes, ready, model, m, dtypes=dtypes,
                             fusion_threshold_bytes=threshold) for m in METHODS}
            for m, p in plans.items():
                assert p.method == m
                check_valid(p, len(sizes), dtypes)
                starts, ends = simulate_fifo(p.groups, sizes, ready, model)
                assert (starts, ends) == (p.group_start, p.group_end)
            best = plans["optimal"].predicted_end
            for m in ("none", "threshold", "mgwfbp"):
                assert best <= plans[m].predicted_end * (1 + 1e-12), m


def test_threshold_groups_respect_threshold():
    rng = random.Random(5)
    for _ in range(50):
        sizes, ready = random_instance(rng, max_len=60)
        dtypes = rng.choice([None, [rng.choice(["a", "b"]) for _ in sizes]])
        threshold = rng.choice([1 * MiB, 8 * MiB, 25 * MiB])
        p = plan(sizes, ready, LINEAR, "threshold", fusion_threshold_bytes=threshold, dtypes=dtypes)
        check_valid(p, len(sizes), dtypes)
        for k, g in enumerate(p.groups):
            assert sum(sizes[i] for i in g[:-1]) < threshold  # closed as soon as it reached it
            last = k == len(p.groups) - 1
            dtype_cut = dtypes is not None and not last and dtypes[p.groups[k + 1][0]] != dtypes[g[-1]]
            if not last and not dtype_cut:
                assert sum(sizes[i] for i in g) >= threshold


def test_none_is_one_group_per_tensor():
    p = plan([1.0, 2.0, 3.0], [0.0, 1.0, 2.0], LINEAR, "none")
    assert p.groups == [[0], [1], [2]]


def test_mgwfbp_merges_when_wait_is_shorter_than_alpha():
    model = LinearModel(alpha=1.0, beta=0.0)
    # Tensor 1 is ready 0.5 s after tensor 0's message could start: wait 0.5 < alpha 1.
    assert plan([1.0, 1.0, 1.0], [0.0, 0.5, 10.0], model, "mgwfbp").groups == [[0, 1], [2]]
    # Waiting 0.5 s is not worth an alpha of 0.1 s; then tensor 2 is ready before the channel
    # is free (1.1 > 0.6), so merging it is free.
    model = LinearModel(alpha=0.1, beta=1.0)
    assert plan([1.0, 1.0, 1.0], [0.0, 0.5, 0.6], model, "mgwfbp").groups == [[0], [1, 2]]
    # Everything ready long after the previous message ends: no merge.
    assert plan([1.0, 1.0], [0.0, 5.0], model, "mgwfbp").groups == [[0], [1]]
    # A dtype change always cuts.
    p = plan([1.0, 1.0], [0.0, 0.0], model, "mgwfbp", dtypes=["float32", "float16"])
    assert p.groups == [[0], [1]]


def test_mgwfbp_on_ps_model_uses_its_line_but_ps_times():
    sizes, ready = [float(MiB)] * 5, [0.001 * i for i in range(5)]
    p = plan(sizes, ready, PS, "mgwfbp")
    check_valid(p, 5)
    assert (p.group_start, p.group_end) == simulate_fifo(p.groups, sizes, ready, PS)


def test_simulate_fifo_by_hand():
    model = LinearModel(alpha=1.0, beta=0.5)
    starts, ends = simulate_fifo([[0, 1], [2]], [2.0, 2.0, 4.0], [0.0, 1.0, 1.5], model)
    assert starts == [1.0, 4.0] and ends == [4.0, 7.0]


def test_unsorted_ready_times_use_latest_tensor():
    sizes, ready = [1.0, 1.0, 1.0, 1.0], [0.0, 3.0, 1.0, 4.0]
    model = LinearModel(alpha=1.0, beta=0.0)
    p = plan(sizes, ready, model, "optimal")
    assert p.predicted_end == pytest.approx(brute_force_end(sizes, ready, model))


def test_describe_and_empty_plan():
    sizes = [4.0 * MiB, 1.0 * MiB, 2.0 * MiB]
    p = plan(sizes, [0.0, 0.001, 0.002], PS, "optimal")
    text = p.describe(sizes)
    assert "optimal" in text and len(text.splitlines()) == 2 + len(p.groups)
    empty = plan([], [], PS, "optimal")
    assert empty.groups == [] and empty.predicted_end == 0.0


@pytest.mark.parametrize("args, kwargs, match", [
    (([1.0, 2.0], [0.0]), {}, "2 sizes but 1 ready"),
    (([1.0, -2.0], [0.0, 1.0]), {}, "sizes must be"),
    (([1.0], [math.nan]), {}, "ready times"),
    (([1.0], [0.0]), {"dtypes": ["a", "b"]}, "dtypes"),
    (([1.0], [0.0]), {"fusion_threshold_bytes": 0}, "fusion_threshold_bytes"),
])
def test_bad_input(args, kwargs, match):
    method = "threshold" if "fusion_threshold_bytes" in kwargs else "optimal"
    with pytest.raises(ValueError, match=match):
        plan(*args, LINEAR, method, **kwargs)


def test_unknown_method_lists_valid_ones():
    with pytest.raises(ValueError, match="none, threshold, mgwfbp, optimal"):
        plan([1.0], [0.0], LINEAR, "greedy")


@pytest.mark.parametrize("name", ["linear", "ps"])
def test_optimal_plans_500_tensors(name):
    """A valid plan at a real model's tensor count (its time: ``benchmarks/planner_dp.py``)."""
    rng = random.Random(3)
    sizes = [float(rng.randint(KiB, 8 * MiB)) for _ in range(500)]
    ready = [i * 2e-4 for i in range(500)]
    p = plan(sizes, ready, MODELS[name], "optimal")
    check_valid(p, 500)
    assert p.predicted_end <= plan(sizes, ready, MODELS[name], "none").predicted_end + 1e-12
