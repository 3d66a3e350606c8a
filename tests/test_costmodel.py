"""Cost models: fits recover known parameters, PSModel interpolates monotonically; the start-up
calibration's budget (which sizes it measures, how often, and how it extends the rest)."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest

from imerge_hooks.plan import calibrate
from imerge_hooks.plan.costmodel import CostModel, LinearModel, PSModel, extend_table, extension_slope

KiB, MiB = 1 << 10, 1 << 20
GRID = [float(KiB * 4**k) for k in range(9)]  # 1 KiB .. 64 MiB


def test_linear_fit_recovers_alpha_beta():
    alpha, beta = 5e-5, 2e-9
    model = LinearModel.fit(GRID, [alpha + beta * m for m in GRID])
    assert model.alpha == pytest.approx(alpha, rel=1e-6)
    assert model.beta == pytest.approx(beta, rel=1e-9)
    assert model.time(1000.0) == pytest.approx(alpha + beta * 1000.0)
    assert isinstance(model, CostModel)


def test_linear_fit_with_noise():
    rng = random.Random(1)
    alpha, beta = 1e-3, 1e-8
    sizes = [float(rng.randint(1, 100)) * MiB for _ in range(200)]
    times = [(alpha + beta * m) * (1 + rng.uniform(-0.01, 0.01)) for m in sizes]
    model = LinearModel.fit(sizes, times)
    assert model.beta == pytest.approx(beta, rel=0.02)
    assert model.alpha == pytest.approx(alpha, abs=0.3 * alpha + 1e-3)


def test_linear_fit_clips_to_non_negative():
    # A negative intercept is refitted through the origin; a falling table gives beta 0.
    up = LinearModel.fit([1.0, 2.0, 3.0], [0.0, 1.5, 3.0])
    assert up.alpha == 0.0 and up.beta > 0
    down = LinearModel.fit([1.0, 2.0, 3.0], [3.0, 2.0, 1.0])
    assert down.beta == 0.0 and down.alpha == pytest.approx(2.0)


def test_linear_round_trip():
    model = LinearModel(alpha=1e-4, beta=3e-10)
    assert LinearModel.from_dict(json.loads(json.dumps(model.to_dict()))) == model
    np.testing.assert_allclose(model.time_array(np.array(GRID)), [model.time(m) for m in GRID])


def _ps_table() -> PSModel:
    # Startup jump at 64 KiB (incast), and a noisy dip at 16 MiB that must be flattened.
    times = [1e-4, 1.1e-4, 1.3e-4, 2e-3, 2.2e-3, 4e-3, 1.2e-2, 1.1e-2, 1.6e-1]
    return PSModel.fit(4, 2, GRID, times, hosts=["n0", "n1"])


def test_psmodel_matches_grid_and_is_monotone():
    model = _ps_table()
    mono = np.maximum.accumulate(model.times)
    for m, t in zip(GRID, mono):
        assert model.time(m) == pytest.approx(t)
    xs = np.geomspace(1.0, 1e10, 4000)
    ys = model.time_array(xs)
    assert np.all(np.diff(ys) >= 0)
    np.testing.assert_allclose(ys[::97], [model.time(x) for x in xs[::97]])
    # Below the grid: never below the first value.
    assert model.time(0.0) == model.time(1.0) == pytest.approx(model.times[0])


def test_psmodel_interpolates_linearly_between_points():
    model = _ps_table()
    lo, hi = GRID[2], GRID[3]
    mid = (lo + hi) / 2
    assert model.time(mid) == pytest.approx((model.time(lo) + model.time(hi)) / 2)


def test_psmodel_extrapolates_with_fitted_slope_continuously():
    model = _ps_table()
    last, t_last = GRID[-1], model.time(GRID[-1])
    slope = model.workers / (model.servers * model.bandwidth)
    assert model.time(last * (1 + 1e-12)) == pytest.approx(t_last, rel=1e-9)
    for k in (1.5, 2.0, 10.0):
        assert model.time(k * last) == pytest.approx(t_last + slope * (k - 1) * last)


def test_psmodel_fit_recovers_a_and_bandwidth():
    workers, servers, a, bw = 8, 2, 3e-4, 1.25e9
    times = [a + workers * m / (servers * bw) for m in GRID]
    model = PSModel.fit(workers, servers, GRID, times)
    assert model.a == pytest.approx(a, rel=1e-5)
    assert model.bandwidth == pytest.approx(bw, rel=1e-6)
    # Constructed without a/bandwidth: fitted the same way.
    assert PSModel(workers, servers, GRID, times).bandwidth == pytest.approx(bw, rel=1e-6)
    line = model.describe()
    assert "us" in line and "MB/s" in line and "W=8" in line and "S=2" in line


def test_psmodel_flat_table_still_has_positive_bandwidth():
    model = PSModel.fit(2, 1, GRID, [1e-3] * len(GRID))
    assert model.a == pytest.approx(1e-3)
    assert 0 < model.bandwidth < float("inf")
    assert model.time(2 * GRID[-1]) >= model.time(GRID[-1])


def test_psmodel_json_round_trip(tmp_path):
    model = _ps_table()
    path = tmp_path / "cache" / "psmodel-4w-2s.json"
    model.to_json(path)
    back = PSModel.from_json(path)
    assert back == model
    assert back.hosts == ["n0", "n1"]
    xs = np.geomspace(1.0, 1e9, 50)
    np.testing.assert_allclose(back.time_array(xs), model.time_array(xs))
    assert PSModel.from_dict(model.to_dict()) == model
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temp files left


@pytest.mark.parametrize("kwargs", [
    {"workers": 0, "servers": 1, "sizes": [1.0], "times": [1.0]},
    {"workers": 1, "servers": 1, "sizes": [1.0, 2.0], "times": [1.0]},
    {"workers": 1, "servers": 1, "sizes": [], "times": []},
    {"workers": 1, "servers": 1, "sizes": [2.0, 1.0], "times": [1.0, 2.0]},
    {"workers": 1, "servers": 1, "sizes": [1.0], "times": [-1.0]},
    {"workers": 1, "servers": 1, "sizes": [1.0], "times": [1.0], "a": 0.0, "bandwidth": 0.0},
])
def test_psmodel_rejects_bad_tables(kwargs):
    with pytest.raises(ValueError, match="IMerge"):
        PSModel(**kwargs)


def test_psmodel_measured_defaults_to_the_whole_grid_and_round_trips(tmp_path):
    model = _ps_table()
    assert model.measured == len(GRID) and "extended" not in model.describe()
    old_cache = {k: v for k, v in model.to_dict().items() if k != "measured"}  # written before the field existed
    assert PSModel.from_dict(old_cache) == model
    part = PSModel.fit(4, 2, GRID, model.times, measured=6)
    assert part.measured == 6 and "measured up to 1048576 B, extended beyond" in part.describe()
    part.to_json(tmp_path / "m.json")
    assert PSModel.from_json(tmp_path / "m.json") == part
    for bad in (0, len(GRID) + 1):
        with pytest.raises(ValueError, match="measured"):
            PSModel.fit(4, 2, GRID, model.times, measured=bad)


def test_extend_table_continues_a_line_exactly():
    workers, servers, a, bw = 4, 2, 2e-3, 1.6e7
    line = [a + workers * m / (servers * bw) for m in GRID]
    full = PSModel.fit(workers, servers, GRID, line)
    for n in range(2, len(GRID) + 1):
        ext = extend_table(GRID[:n], line[:n], GRID)
        np.testing.assert_allclose(ext, line, rtol=1e-9)
        model = PSModel.fit(workers, servers, GRID, ext, measured=n)
        assert model.a == pytest.approx(full.a, rel=1e-6) and model.bandwidth == pytest.approx(full.bandwidth, rel=1e-6)


def test_extension_slope_is_robust_and_never_negative():
    sizes = [1.0, 2.0, 3.0, 4.0]
    assert extension_slope(sizes, [1.0, 2.0, 3.0, 4.0]) == pytest.approx(1.0)
    # A low last point (noise) does not make the bytes free: the chord from the first point stands in.
    assert extension_slope(sizes, [1.0, 2.0, 3.0, 3.01]) == pytest.approx((3.01 - 1.0) / 3.0)
    assert extension_slope(sizes, [4.0, 3.0, 2.0, 1.0]) == 0.0  # falling: flat (running maximum)
    assert extension_slope([4.0], [2.0]) == pytest.approx(0.5)  # one point: proportional to size
    ext = extend_table(sizes[:2], [1.0, 2.0], sizes)
    assert ext == pytest.approx([1.0, 2.0, 3.0, 4.0])
    with pytest.raises(ValueError, match="prefix of the grid"):
        extend_table([2.0], [1.0], sizes)
    with pytest.raises(ValueError, match="prefix of the grid"):
        extend_table([], [], sizes)


class FakeLink:
    """Stands for ``measure``'s sampler: a table T(m) and a clock that advances by what each size costs
    (the warm-up of the first half of the grid, then per size a warm-up and the timed samples, each
    after a barrier)."""

    def __init__(self, times: list[float], barrier_s: float = 2e-3) -> None:
        self.times, self.barrier_s = times, barrier_s
        self.clock = sum(times[: len(times) // 2])
        self.calls: list[tuple[int, int]] = []

    def __call__(self, index: int, repeats: int) -> tuple[float, float, float]:
        self.calls.append((index, repeats))
        self.clock += (repeats + 1) * self.times[index] + repeats * self.barrier_s
        return self.times[index], self.clock, self.barrier_s


def _line(workers: int, servers: int, a: float, bw: float) -> list[float]:
    return [a + workers * m / (servers * bw) for m in GRID]


FULL_REPEATS = [12, 12, 12, 12, 12, 5, 5, 3, 2]  # what the calibration has always measured per size


def test_measure_grid_without_budget_measures_every_size_as_before():
    link = FakeLink(_line(3, 1, 2e-3, 18e6))  # a slow link: only the budget may cut it short
    times = calibrate.measure_grid([int(m) for m in GRID], link, None)
    assert times == link.times
    assert [i for i, _ in link.calls] == list(range(len(GRID)))
    # Once bandwidth-bound (from 256 KiB here) a size expected to take long gets fewer repeats, never < 2.
    repeats = [r for _, r in link.calls]
    assert repeats[:5] == FULL_REPEATS[:5] and all(2 <= r <= f for r, f in zip(repeats, FULL_REPEATS))
    assert repeats[-1] == 2 and sum(repeats) < sum(FULL_REPEATS)


def test_measure_grid_on_a_fast_link_is_unchanged_by_the_budget():
    # Loopback-like table (3 workers, 1 server on this machine): it fits the budget, so nothing changes.
    link = FakeLink([5.4e-3, 6.7e-3, 4.2e-3, 3.9e-3, 4.6e-3, 5.5e-3, 8.0e-3, 1.73e-2, 6.83e-2], barrier_s=6e-3)
    times = calibrate.measure_grid([int(m) for m in GRID], link, calibrate.STARTUP_BUDGET_S)
    assert times == link.times and [r for _, r in link.calls] == FULL_REPEATS


@pytest.mark.parametrize("workers,servers", [(2, 1), (3, 1), (4, 2)])
def test_measure_grid_on_a_slow_link_stops_within_the_budget_and_keeps_the_model(workers, servers):
    table = _line(workers, servers, 2e-3, 16e6)  # 250 Mbit/s-like: the whole grid takes ~40-60 s
    budget = calibrate.STARTUP_BUDGET_S
    whole = FakeLink(table)
    calibrate.measure_grid([int(m) for m in GRID], whole, None)
    link = FakeLink(table)
    times = calibrate.measure_grid([int(m) for m in GRID], link, budget)
    assert whole.clock > 10 * budget and link.clock <= budget
    assert 2 <= len(times) < len(GRID) and times == table[:len(times)]
    assert max(times) >= calibrate.BANDWIDTH_BOUND * times[0]  # stopped only once the bytes dominate
    full = PSModel.fit(workers, servers, GRID, table)
    model = PSModel.fit(workers, servers, GRID, extend_table(GRID[:len(times)], times, GRID), measured=len(times))
    assert model.a == pytest.approx(full.a, rel=1e-6) and model.bandwidth == pytest.approx(full.bandwidth, rel=1e-6)


def test_measure_grid_never_stops_before_the_bytes_dominate():
    # A huge startup (0.5 s) and a fast link: the budget is spent on the first sizes, but a table that
    # is still flat says nothing about the bandwidth, so it goes on until the time has grown 8-fold.
    table = [0.5 + m / 2e6 for m in GRID]
    link = FakeLink(table, barrier_s=0.0)
    times = calibrate.measure_grid([int(m) for m in GRID], link, 0.0)
    bound = next(i for i in range(len(GRID)) if table[i] >= calibrate.BANDWIDTH_BOUND * table[0])
    assert len(times) == bound + 1 and link.clock > 1.0


def test_measure_grid_on_a_loaded_machine_takes_fewer_samples_but_every_size():
    # 4 workers + 2 servers on 2 busy cores: every round trip ~12 ms at small sizes, barriers and spread
    # add 25 ms per sample, and the table only becomes bandwidth-bound at 64 MiB.
    table = [12.0e-3, 12.5e-3, 15.8e-3, 12.5e-3, 14.8e-3, 12.3e-3, 24.3e-3, 74.4e-3, 254.7e-3]
    whole, link = FakeLink(table, barrier_s=25e-3), FakeLink(table, barrier_s=25e-3)
    calibrate.measure_grid([int(m) for m in GRID], whole, None)
    times = calibrate.measure_grid([int(m) for m in GRID], link, calibrate.STARTUP_BUDGET_S)
    assert times == table  # nothing is cut while the table is not bandwidth-bound
    repeats = [r for _, r in link.calls]
    assert all(min(calibrate.MIN_SHARED_REPEATS, f) <= r <= f for r, f in zip(repeats, FULL_REPEATS))
    assert [r for _, r in whole.calls] == FULL_REPEATS and link.clock < 0.9 * whole.clock


def test_budgeted_model_plans_as_the_whole_grid_on_a_slow_cluster(capsys):
    # benchmarks/calibrate_budget.py: the simulated calibration of 3 workers and 1 server on 250 Mbit/s
    # links takes ~50 s on the whole grid; the budget measures 6 sizes in ~1.4 s and every planner
    # picks the same plan for the synthetic profile from the extended table.
    from benchmarks import calibrate_budget

    assert calibrate_budget.main(["--cluster", "3x1@250mbit", "--profiles", "synthetic-cpu"]) == 0
    out = capsys.readouterr().out
    assert "measures 6/9 sizes" in out and "a 600 -> 600 us, B 15.6 -> 15.6 MB/s" in out, out
    assert out.count(": same plan") == len(calibrate_budget.SCHEDULES), out
