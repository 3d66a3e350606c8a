"""Plan search: candidates are scored by the simulator and the fastest one is installed."""

from __future__ import annotations

import dataclasses
import math

import pytest

from imerge_hooks.core.config import Config
from imerge_hooks.plan.choice import choose_plan, cluster_for, model_spec_from_profile, search_plan
from imerge_hooks.plan.costmodel import LinearModel, PSModel
from imerge_hooks.plan.planner import Plan, plan
from imerge_hooks.plan.search import (
    MANY_SERVERS_FACTORS,
    MIN_PARTITION_BYTES,
    PARTITION_TOLERANCE,
    StartupScaled,
    partition_sizes,
    search,
    searched_plan,
)
from imerge_hooks.simulate import ClusterSpec, LayerSpec, ModelSpec, simulate

KiB, MiB = 1 << 10, 1 << 20
GRID = [float(KiB * 4**k) for k in range(9)]


def ps_model(workers: int, servers: int, startup: float, bandwidth: float = 1e8) -> PSModel:
    """A PS table that follows a + W*m/(S*B) exactly."""
    return PSModel.fit(workers, servers, GRID, [startup + workers * m / (servers * bandwidth) for m in GRID])


def ready_order_model(n: int, size: int, gap: float):
    sizes = [size] * n
    ready = [k * gap for k in range(n)]
    names = [f"layer{n - 1 - k}.weight" for k in range(n)]  # ready order: last layer first
    return sizes, ready, names


def test_startup_scaled_keeps_bandwidth_term():
    lin = LinearModel(alpha=1e-3, beta=1e-8)
    half = StartupScaled(lin, 0.5)
    assert half.time(0) == pytest.approx(0.5e-3)
    assert half.time(1e6) == pytest.approx(0.5e-3 + 1e-2)
    none = StartupScaled(lin, 0.0)
    assert none.time(1e6) == pytest.approx(1e-2)


def test_model_spec_reproduces_profiled_ready_times():
    sizes = [100, 200, 300, 400]
    ready = [0.0, 0.010, 0.010, 0.030]  # ready order; two tensors at once
    names = ["fc.bias", "fc.weight", "conv.bias", "conv.weight"]
    spec = model_spec_from_profile(sizes, ready, names, {"fc": 0.002, "conv": 0.005})
    # Forward order is the reverse of ready order.
    assert [layer.name for layer in spec.layers] == names[::-1]
    assert [layer.param_bytes for layer in spec.layers] == [[400], [300], [200], [100]]
    # Suffix sums of backward times give back the ready times.
    bwd = [layer.backward_s for layer in spec.layers]
    suffix = [sum(bwd[i:]) for i in range(len(bwd))]
    assert suffix[::-1] == pytest.approx(ready)
    # Each module's forward time is counted once, on its front-most tensor.
    assert [layer.forward_s for layer in spec.layers] == pytest.approx([0.005, 0.0, 0.002, 0.0])


def test_cluster_for_matches_the_model():
    model = ps_model(4, 2, startup=4e-3, bandwidth=1e8)
    cluster = cluster_for(model, 4, 2)
    assert cluster.workers == 4 and cluster.servers == 2
    assert cluster.startup_s == pytest.approx(model.a / 4)
    assert cluster_for(object(), 4, 2) is None  # type: ignore[arg-type]


@pytest.mark.parametrize("schedule", ["imerge", "adaptive-ps"])
def test_search_keeps_the_fastest_candidate(schedule):
    """The installed plan is the simulator's fastest, never slower than the DP alone."""
    sizes, ready, names = ready_order_model(24, 512 * KiB, 5e-3)
    model = ps_model(4, 2, startup=8e-3)
    cfg = Config(schedule=schedule)
    chosen, scored = search_plan(sizes, ready, names, model, cfg, 4, 2)
    assert len(scored) >= 2
    assert sorted(i for g in chosen.groups for i in g) == list(range(len(sizes)))
    best = min(c.iteration_s for c in scored)
    chosen_score = next(c.iteration_s for c in scored if c.groups == chosen.groups)
    assert chosen_score <= best * 1.0051
    assert chosen_score <= scored[0].iteration_s  # the DP on the measured model is candidate 0
    assert "chosen by simulation" in chosen.note and chosen.method == "optimal"
    # The score is what simulate() says for those groups (spec tensor t = ready position n-1-t).
    spec = model_spec_from_profile(sizes, ready, names)
    n = len(sizes)
    again = simulate(spec, cluster_for(model, 4, 2), schedule, iterations=3, timeline=False,
                     groups=[[n - 1 - i for i in g] for g in chosen.groups])
    assert again.iteration_s == pytest.approx(chosen_score)


def test_search_prefers_less_fusion_when_startups_pipeline():
    """Many tensors, long backward, moderate startup: the FIFO DP fuses, the simulated
    pipeline (two servers, many keys in flight) is faster with (almost) no fusion."""
    sizes, ready, names = ready_order_model(40, 2 * MiB, 20e-3)
    model = ps_model(4, 2, startup=30e-3)
    dp = plan(sizes, ready, model, "optimal")
    chosen, scored = search_plan(sizes, ready, names, model, Config(schedule="imerge"), 4, 2)
    assert len(chosen.groups) > len(dp.groups)
    dp_score = scored[0].iteration_s
    chosen_score = next(c.iteration_s for c in scored if c.groups == chosen.groups)
    assert chosen_score < dp_score * 0.995


def test_search_fuses_when_startup_dominates():
    """Tiny tensors, all ready at once, huge startup: one message is best and is kept."""
    sizes, ready, names = ready_order_model(16, 4 * KiB, 0.0)
    model = ps_model(4, 1, startup=50e-3)
    chosen, _ = search_plan(sizes, ready, names, model, Config(schedule="imerge"), 4, 1)
    assert len(chosen.groups) == 1


def test_choose_plan_respects_plan_search_switch_and_method():
    sizes, ready, names = ready_order_model(12, 1 * MiB, 2e-3)
    model = ps_model(2, 1, startup=5e-3)
    off = choose_plan(sizes, ready, names, model, Config(schedule="imerge", plan_search=False), 2, 1)
    assert off.groups == plan(sizes, ready, model, "optimal").groups and off.note == ""
    mg = choose_plan(sizes, ready, names, LinearModel.fit(model.sizes, model.times), Config(schedule="mgwfbp"), 2, 1)
    assert mg.method == "mgwfbp"
    on = choose_plan(sizes, ready, names, model, Config(schedule="imerge"), 2, 1)
    assert on.note.startswith("chosen by simulation")
    assert math.isfinite(on.predicted_end)


def test_search_respects_dtypes():
    sizes, ready, names = ready_order_model(8, 64 * KiB, 1e-3)
    dtypes = ["float32"] * 4 + ["float16"] * 4
    chosen, scored = search_plan(sizes, ready, names, ps_model(2, 1, startup=20e-3), Config(schedule="imerge"),
                                 2, 1, dtypes=dtypes)
    for cand in scored:
        for g in cand.groups:
            assert len({dtypes[i] for i in g}) == 1, cand.label


def test_simulate_rejects_a_bad_explicit_plan():
    spec = model_spec_from_profile([10, 20, 30], [0.0, 1e-3, 2e-3], ["a.w", "b.w", "c.w"])
    cluster = cluster_for(ps_model(2, 1, startup=1e-3), 2, 1)
    with pytest.raises(ValueError, match="exactly once"):
        simulate(spec, cluster, "imerge", groups=[[0, 1], [1, 2]])
    with pytest.raises(ValueError, match="exactly once"):
        simulate(spec, cluster, "imerge", groups=[[0, 1]])


def test_partition_sizes_and_search_logic():
    assert partition_sizes(4 * MiB) == [4 * MiB, 2 * MiB, MiB, 8 * MiB]
    assert partition_sizes(4 * MiB, MANY_SERVERS_FACTORS) == [4 * MiB, 2 * MiB, MiB, 8 * MiB, 256 * KiB]
    assert partition_sizes(256 * KiB) == [256 * KiB, 512 * KiB]  # never below MIN_PARTITION_BYTES
    cands = [("fused", [[0, 1, 2]]), ("pairs", [[0, 1], [2]]), ("unfused", [[0], [1], [2]])]
    # Hand-made scores. At 4 MiB "pairs" wins and likes 1 MiB best; at 1 MiB "unfused" overtakes
    # it, and unfused likes 512 KiB best, where it stays the fastest plan: the search must end
    # there (a plan-then-size search would stop at pairs, 1 MiB, 0.76).
    table = {"pairs": {4 * MiB: 0.8, 2 * MiB: 0.78, MiB: 0.76, 8 * MiB: 0.9, 512 * KiB: 0.77, 256 * KiB: 0.8},
             "unfused": {4 * MiB: 0.85, MiB: 0.7, 512 * KiB: 0.65, 256 * KiB: 0.66, 2 * MiB: 0.72}}
    label_of = {len(g): label for label, g in cands}
    calls = []

    def score(groups, partition, bound=None):
        calls.append((label_of[len(groups)], partition))
        return table.get(label_of[len(groups)], {}).get(partition, 1.0)

    best, scored, partition, note = search(cands, score, 4 * MiB, partitioned=True)
    assert best.label == "unfused" and partition == 512 * KiB
    assert best.iteration_s == pytest.approx(0.65)
    assert [c.iteration_s for c in scored] == pytest.approx([1.0, 0.77, 0.65])  # every plan at 512 KiB
    assert "partitions of 512 KiB" in note
    assert len(calls) == len(set(calls))  # no (plan, size) simulated twice
    calls.clear()
    best, scored, partition, note = search(cands, score, 4 * MiB, partitioned=False)
    assert best.label == "pairs" and partition == 4 * MiB and "partitions" not in note
    assert len(calls) == 3
    # Another partition size must win by more than PARTITION_TOLERANCE (per-message CPU is not simulated).
    slight = {4 * MiB: 1.0, 2 * MiB: 1.0 - PARTITION_TOLERANCE / 2, MiB: 1.0 - PARTITION_TOLERANCE / 2}
    best, _, partition, _ = search(cands[:1], lambda g, p, bound=None: slight.get(p, 1.5), 4 * MiB, partitioned=True)
    assert partition == 4 * MiB
    # A later plan must beat an earlier one by more than the tie tolerance.
    tie = {"fused": 1.0, "pairs": 0.8, "unfused": 0.799}
    best, *_ = search(cands, lambda g, p, bound=None: tie[label_of[len(g)]], 4 * MiB, partitioned=False)
    assert best.label == "pairs"


def test_search_plan_reports_the_partition_it_chose():
    sizes, ready, names = ready_order_model(12, 6 * MiB, 10e-3)
    model = ps_model(4, 2, startup=2e-3)
    chosen, _ = search_plan(sizes, ready, names, model, Config(schedule="imerge"), 4, 2)
    ratio = 4 * MiB / chosen.partition_bytes  # the configured size times a power of two, never below the floor
    assert chosen.partition_bytes >= MIN_PARTITION_BYTES and ratio == 2 ** round(math.log2(ratio))
    assert f"partitions of {chosen.partition_bytes >> 10} KiB" in chosen.note
    unpartitioned, _ = search_plan(sizes, ready, names, model, Config(schedule="adaptive-ps"), 4, 2)
    assert unpartitioned.partition_bytes is None
    # simulate() installs what its search chose: every key fits the chosen partition size.
    spec = model_spec_from_profile(sizes, ready, names)
    result = simulate(spec, cluster_for(model, 4, 2), "imerge", timeline=False)
    limit = result.plan.partition_bytes
    assert limit == chosen.partition_bytes
    assert all(k.nbytes <= limit for k in result.keys)


def test_the_search_chooses_the_window_per_server():
    """A wider window per server (schedule.windows) is kept where it wins by PARTITION_TOLERANCE."""
    cands = [("fused", [[0, 1, 2]])]
    for times, want in (({None: 1.0, 2 * MiB: 0.9, 4 * MiB: 0.95}, 2 * MiB),  # two partitions win
                        ({None: 1.0, 2 * MiB: 1.0 - PARTITION_TOLERANCE / 2, 4 * MiB: 1.0}, None)):  # a tie: one
        seen = []

        def score(groups, partition, bound=None, server_credit=None, times=times, seen=seen):
            seen.append(server_credit)
            return times[server_credit]

        chosen, _ = searched_plan(cands, score, [1, 1, 1], [0.0, 0.1, 0.2], LinearModel(0.0, 1e-9), MiB,
                                  partitioned=False, windowed=True)
        assert chosen.server_credit_bytes == want and seen == [None, 2 * MiB, 4 * MiB]
        assert "window per server: 1 partition" in chosen.note


def test_an_approximate_score_wants_a_wider_margin():
    """With ``tolerance`` (the simulator's approximate fold) another partition size must win by more."""
    cands = [("fused", [[0, 1, 2]])]
    times = {MiB: 1.0, MiB // 2: 0.97, MiB // 4: 0.97, 2 * MiB: 1.0}
    assert search(cands, lambda g, p, bound=None: times.get(p, 1.5), MiB, True)[2] == MiB // 2
    assert search(cands, lambda g, p, bound=None: times.get(p, 1.5), MiB, True, tolerance=0.05)[2] == MiB


def test_the_search_turns_the_tail_credit_off_only_where_that_wins():
    """The tail credit is tried off last, on the winner with its window; off must win by the tolerance."""
    cands = [("fused", [[0, 1, 2]])]
    for untailed, want in ((0.9, False), (1.0 - PARTITION_TOLERANCE / 2, None)):
        seen = []

        def score(groups, partition, bound=None, server_credit=None, tail=True, untailed=untailed, seen=seen):
            seen.append((server_credit, tail))
            return 1.0 if tail else untailed

        chosen, _ = searched_plan(cands, score, [1, 1, 1], [0.0, 0.1, 0.2], LinearModel(0.0, 1e-9), MiB,
                                  partitioned=False, windowed=True, tailed=True)
        assert chosen.tail_credit is want and seen[-1] == (None, False)
        assert ("without the tail credit" if want is False else "with the tail credit (without: ") in chosen.note
    plain, _ = searched_plan(cands, lambda g, p, bound=None: 1.0, [1, 1, 1], [0.0, 0.1, 0.2], LinearModel(0.0, 1e-9),
                             MiB, partitioned=False)
    assert plain.tail_credit is None and "tail credit" not in plain.note


def test_a_plan_without_the_tail_credit_is_simulated_and_installed_without_it():
    """8 x 8 MiB on 8 workers and servers: where the search turns the tail credit off, the simulator's
    result is that of the same plan with tail_credit_bytes=None, and the engine installs no tail group."""
    from imerge_hooks.plan.replan import Replanner

    spec = ModelSpec(layers=[LayerSpec(f"l{i}", [8 * MiB], 0.01, 0.02) for i in range(8)], batch_size=8)
    cluster = ClusterSpec(workers=8, servers=8, bandwidth_Bps=3.1e7, startup_s=2e-4)
    res = simulate(spec, cluster, "imerge", timeline=False)
    plan = res.plan
    again = dict(groups=res.groups, partition_bytes=plan.partition_bytes or Config().partition_bytes,
                 stagger=plan.stagger, server_credit_bytes=plan.server_credit_bytes, timeline=False)
    untailed = simulate(spec, cluster, "imerge", tail_credit_bytes=None, **again)
    tailed = simulate(spec, cluster, "imerge", **again)
    assert plan.tail_credit is False and "without the tail credit" in plan.note
    assert res.iteration_s == pytest.approx(untailed.iteration_s)
    assert untailed.iteration_s < tailed.iteration_s * (1.0 - PARTITION_TOLERANCE)
    untailed_plan = dataclasses.replace(plan, tail_credit=False)
    assert Replanner._tail_of(None, list(range(8)), untailed_plan) is None


def test_the_search_staggers_in_waves_only_where_that_wins():
    """With stagger the whole search runs again in waves (schedule.key_slots); waves must win by the
    tolerance, and the plan they choose may be another one."""
    cands = [("fused", [[0, 1, 2]]), ("split", [[0], [1], [2]])]
    for in_waves, want in (({3: 0.7, 1: 0.95}, True), ({3: 0.9 * (1.0 - PARTITION_TOLERANCE / 2), 1: 0.95}, None)):
        def score(groups, partition, stagger=True, bound=None, waves=False, in_waves=in_waves):
            if not stagger:
                return 2.0
            return in_waves[len(groups)] if waves else {3: 1.0, 1: 0.9}[len(groups)]

        chosen, scored = searched_plan(cands, score, [1, 1, 1], [0.0, 0.1, 0.2], LinearModel(0.0, 1e-9), MiB,
                                       partitioned=False, staggered=True)
        assert chosen.waves is want and chosen.stagger is True
        # Rotating whole groups, "fused" wins (0.9); in waves "split" does (0.7), by more than the tolerance.
        assert len(chosen.groups) == (3 if want else 1)
        assert ("in waves (in waves: split" if want else "whole groups rotated (in waves: split") in chosen.note
    # Without stagger, waves mean nothing: the plan says None.
    chosen, _ = searched_plan(cands, lambda g, p, stagger=True, bound=None, waves=False: 0.5 if not stagger else 1.0,
                              [1, 1, 1], [0.0, 0.1, 0.2], LinearModel(0.0, 1e-9), MiB, partitioned=False,
                              staggered=True)
    assert chosen.stagger is False and chosen.waves is None


def test_the_search_in_waves_stops_each_simulation_that_cannot_beat_the_first_winner():
    """The second search (in waves) is capped: every simulation in it gets at most the first search's
    winner less the tolerance as its bound, so a plan that cannot win stops early (inf)."""
    cands = [("fused", [[0, 1, 2]]), ("split", [[0], [1], [2]])]
    first = {3: 1.0, 1: 0.9}
    bounds = []

    def score(groups, partition, stagger=True, bound=None, waves=False):
        seconds = 2.0 if not stagger else ({3: 0.95, 1: 0.92}[len(groups)] if waves else first[len(groups)])
        if waves:
            bounds.append(bound)
        return math.inf if bound is not None and seconds > bound else seconds

    chosen, _ = searched_plan(cands, score, [1, 1, 1], [0.0, 0.1, 0.2], LinearModel(0.0, 1e-9), MiB,
                              partitioned=True, staggered=True)
    cap = 0.9 * (1.0 - PARTITION_TOLERANCE)
    assert bounds and all(b is not None and b <= cap for b in bounds)
    assert chosen.waves is None and chosen.stagger is True and len(chosen.groups) == 1
    assert "whole groups rotated (in waves: none beat it by the tolerance)" in chosen.note
    # Uncapped, search() is what it was: every plan scored in full.
    best, scored, _, _ = search(cands, lambda g, p, bound=None: first[len(g)], MiB, False)
    assert best.label == "fused" and [c.iteration_s for c in scored] == [0.9, 1.0]


def test_on_an_approximate_fold_every_worker_decides_stagger_window_and_tail():
    """With ``exact`` (every worker simulated), the staggered winner is scored again on it and the last
    choices are made there by PARTITION_TOLERANCE: a 3% gain the fold's 5% tolerance would hide counts."""
    from imerge_hooks.plan.search import FOLD_TOLERANCE

    cands = [("fused", [[0, 1, 2]])]

    def score(groups, partition, stagger=True, bound=None, server_credit=None, tail=True, waves=False):
        return 2.0 if not stagger else (1.0 if tail else 0.97)

    exact_calls = []

    def exact(groups, partition, stagger=True, bound=None, server_credit=None, tail=True, waves=False):
        exact_calls.append((stagger, tail))
        return score(groups, partition, stagger, server_credit=server_credit, tail=tail) * 1.01

    common = dict(partitioned=False, staggered=True, tailed=True, tolerance=FOLD_TOLERANCE)
    folded, _ = searched_plan(cands, score, [1, 1, 1], [0.0, 0.1, 0.2], LinearModel(0.0, 1e-9), MiB, **common)
    assert folded.tail_credit is None  # 3% < 5%: the fold cannot tell
    chosen, _ = searched_plan(cands, score, [1, 1, 1], [0.0, 0.1, 0.2], LinearModel(0.0, 1e-9), MiB, exact=exact,
                              **common)
    assert chosen.tail_credit is False and chosen.stagger is True
    assert exact_calls == [(True, True), (True, False)]
    assert "on every worker: 1010.00 ms (folded: 1000.00 ms)" in chosen.note


def test_a_search_that_cannot_judge_stagger_runs_and_installs_none():
    cands = [("fused", [[0, 1, 2]]), ("split", [[0], [1], [2]])]
    seen = set()

    def score(groups, partition, stagger=True, bound=None, server_credit=None, tail=True, waves=False):
        seen.add((stagger, waves))
        return 1.0 if len(groups) == 1 else 0.9

    chosen, _ = searched_plan(cands, score, [1, 1, 1], [0.0, 0.1, 0.2], LinearModel(0.0, 1e-9), MiB,
                              partitioned=True, staggered=True, windowed=True, tailed=True, unstaggered=True)
    assert chosen.stagger is False and chosen.waves is None and len(chosen.groups) == 3
    assert seen == {(False, False)}


def test_the_replanner_installs_what_the_search_chose():
    """Stagger, waves and windows go into the engine's policy together, and a later plan without waves
    turns them off again; a plan without the tail credit gets no tail group."""
    from types import SimpleNamespace

    from imerge_hooks.plan.replan import Replanner

    calls: list = []
    engine = SimpleNamespace(topo=SimpleNamespace(num_servers=4, worker_rank=1), epoch=1,
                             cfg=Config(schedule="imerge"),
                             set_layout=lambda groups, **kw: calls.append(("layout", groups, kw)),
                             set_policy=lambda **kw: calls.append(("policy", kw)))
    replanner = object.__new__(Replanner)
    replanner.engine, replanner.order, replanner.method, replanner.pending = engine, [1, 0], "optimal", False
    base = dict(groups=[[0], [1]], predicted_end=1.0, method="optimal", group_start=[0.0, 0.5],
                group_end=[0.5, 1.0], partition_bytes=MiB, stagger=True)
    replanner._install(Plan(**base, waves=True), 0)
    replanner._install(Plan(**base), None)
    (_, groups, layout), (_, first), _, (_, second) = calls
    assert groups == [[1], [0]] and layout == {"partition_bytes": MiB, "tail_group": 0}
    assert first["stagger"] is True and first["waves"] is True and first["server_credit_bytes"] == MiB
    assert second["waves"] is False
    assert Replanner._tail_of(replanner, [1, 0], Plan(**base, tail_credit=False)) is None
