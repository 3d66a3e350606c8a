"""The simulator's steady state: a run still in its transient runs longer, and its time is that of the
iterations after the transient, so no simulated cell comes out below its physical bound."""

from __future__ import annotations

from pathlib import Path

import pytest

from imerge_hooks.simulate import ClusterSpec, ModelSpec, simulate
from imerge_hooks.simulate import run as run

REPO = Path(__file__).resolve().parents[1]
MiB = 1 << 20


def vgg16_on_two_gpu_hosts() -> tuple[ModelSpec, ClusterSpec]:
    """VGG-16 at V100 speed (``benchmarks/gpu_speed.py``'s scale of its CPU profile) on 2 hosts of 8 workers
    with a server each, 10 Gbit/s NICs: the hosts-of-8 cell of ``benchmarks/gpu_tables.py`` at W = 16."""
    spec = ModelSpec.from_profile_json(REPO / "benchmarks" / "profiles" / "vgg16-cpu.json")
    hosts = tuple(w // 8 for w in range(16)) + (0, 1)
    cluster = ClusterSpec(workers=16, servers=2, bandwidth_Bps=1.1955e9, startup_s=2e-4, time_scale=0.0049918,
                          hosts=hosts, host_aggregation=True, local_Bps=96e9, reduce_Bps=12e9)
    return spec, cluster


def test_a_transient_run_is_simulated_to_its_steady_state():
    """The DP's plan, 4 MiB partitions, 4 in flight per server: iterations 2 and 3 (0.43 s, 0.48 s) are
    still the transient; averaged, they came out below the NICs' bound. The steady state is above it."""
    spec, cluster = vgg16_on_two_gpu_hosts()
    bound = cluster.busiest_link_share() * spec.total_bytes / cluster.bandwidth_Bps
    res = simulate(spec, cluster, "imerge", timeline=False, plan_search=False, partition_bytes=4 * MiB,
                   server_credit_bytes=16 * MiB)
    first_three = res.iteration_times[:3]
    assert sum(first_three[1:]) / 2 < bound  # what the mean of iterations 2-3 said
    assert len(res.iteration_times) > 3
    assert res.iteration_s >= bound
    steady = res.iteration_times[-len(res.iteration_times) // 2:]
    assert res.iteration_s == pytest.approx(sum(steady) / len(steady))
    assert abs(steady[-1] - steady[-2]) <= run.STEADY_TOLERANCE * max(steady[-2:])
    longer = simulate(spec, cluster, "imerge", timeline=False, plan_search=False, partition_bytes=4 * MiB,
                      server_credit_bytes=16 * MiB, iterations=run.MAX_ITERATIONS)
    assert res.iteration_s == pytest.approx(longer.iteration_s, rel=0.01)


def test_a_steady_run_keeps_its_three_iterations():
    spec, cluster = vgg16_on_two_gpu_hosts()
    res = simulate(spec, cluster, "wfbp", timeline=False)
    assert len(res.iteration_times) == 3
    assert res.iteration_s == pytest.approx(sum(res.iteration_times[1:]) / 2)


@pytest.mark.parametrize("times, window", [([1.0], [1.0]), ([1.0, 2.0], [2.0]), ([1.0, 2.0, 3.0], [2.0, 3.0]),
                                           ([1.0] * 5 + [2.0], [1.0, 1.0, 2.0]), (list(range(12)), list(range(6, 12)))])
def test_the_steady_window_is_the_last_half_never_the_first_iteration(times, window):
    assert run._steady_window(times) == window


@pytest.mark.parametrize("times, period", [
    ([0.5, 1.0, 1.005], 1),
    ([0.5, 1.0, 1.1], None),
    # a queue that drains every other iteration: settled, though no two neighbours agree
    ([9.7, 9.8, 11.35, 11.9, 13.1, 11.69, 13.1, 11.69, 13.1, 11.69, 13.1, 11.69], 2),
    ([13.1, 13.1, 11.6, 14.1, 14.1, 13.1, 13.5, 13.18, 13.5, 13.14, 14.03, 13.18, 13.5, 13.14, 14.03, 13.18], 4),
    ([1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0], None),
    # a transient whose last two iterations pass within 1% for the two before: not a cycle (it is one of
    # 3 from there: 11.88, 12.469, 12.666)
    ([10.157, 9.803, 12.199, 11.983, 12.295, 11.88], None),
])
def test_a_run_is_settled_once_its_last_cycle_repeats(times, period):
    assert run._period(times) == period


def test_the_steady_time_of_a_cycle_averages_whole_cycles():
    times = [9.7, 9.8, 11.35, 11.9, 13.1, 11.69, 13.1, 11.69, 13.1, 11.69, 13.1, 11.69, 13.1, 11.69]
    window = run._steady_window(times, run._period(times))
    assert window == [13.1, 11.69] * 3  # the last half (7) cut to whole cycles of 2
    assert run._steady_window([1.0, 2.0, 3.0, 4.0, 3.0, 4.0], 2) == [3.0, 4.0]
