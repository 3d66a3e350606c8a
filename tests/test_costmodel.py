"""Cost models: fits recover known parameters, PSModel interpolates monotonically."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest

from imerge_hooks.plan.costmodel import CostModel, LinearModel, PSModel

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
