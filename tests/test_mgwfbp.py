"""MG-WFBP baseline: the alpha-beta line its rule gets from a PS table, the rule on hand examples,
and a simulated startup-bound cell where it beats WFBP (simulated time only)."""

from __future__ import annotations

import pytest

from imerge_hooks.plan.costmodel import LinearModel, PSModel, mgwfbp_model, planner_model
from imerge_hooks.plan.planner import plan
from imerge_hooks.simulate import ClusterSpec, LayerSpec, ModelSpec, calibrate_model, simulate

KiB = 1 << 10
GRID = [float(KiB * 4**k) for k in range(9)]


def ps_table(workers: int, servers: int, a: float, per_server_Bps: float) -> PSModel:
    """A PS table that lies exactly on ``a + W*m/(S*B)``."""
    slope = workers / (servers * per_server_Bps)
    return PSModel.fit(workers, servers, GRID, [a + slope * m for m in GRID])


def test_mgwfbp_line_from_hand_made_table():
    ps = ps_table(workers=8, servers=4, a=1.6e-3, per_server_Bps=5e8)  # slope 4e-9 s/B
    line = mgwfbp_model(ps)
    # a = 8 pushes x 200 us at one server; 4 servers share the groups: 400 us per group.
    assert line.alpha == pytest.approx(4e-4)
    # a round trip's bytes cross the busiest link twice (push, result): half the slope.
    assert line.beta == pytest.approx(2e-9)
    assert planner_model("mgwfbp", ps) == line
    assert planner_model("optimal", ps) is ps
    given = LinearModel(alpha=1e-3, beta=1e-9)
    assert planner_model("mgwfbp", given) is given


@pytest.mark.parametrize("workers, servers", [(4, 4), (8, 2), (2, 8)])
def test_mgwfbp_line_is_the_simulated_clusters_per_push_startup_and_link(workers, servers):
    """On the simulator's calibration the line is the cluster itself: alpha = startup x W/S (one
    group's pushes at one of S servers), beta = the busiest link's time per byte, one way."""
    link, startup = 1.25e9, 2e-4
    cluster = ClusterSpec(workers=workers, servers=servers, bandwidth_Bps=link, startup_s=startup)
    line = mgwfbp_model(calibrate_model(cluster))
    assert line.alpha == pytest.approx(startup * workers / servers, rel=1e-3)
    assert line.beta == pytest.approx(max(workers / servers, 1.0) / link, rel=1e-3)


def test_rule_merges_within_alpha_and_not_beyond():
    ps = ps_table(workers=4, servers=4, a=4e-3, per_server_Bps=1e9)  # alpha 1 ms, beta 0.5 ns/B
    sizes, ready = [1.0 * KiB] * 4, [0.0, 0.5e-3, 2.5e-3, 20e-3]
    # Tensor 1 comes 0.5 ms after tensor 0's message could start (< alpha 1 ms): merged. Tensor 2
    # comes 2 ms after the merged message could start and after it ended: its own group.
    assert plan(sizes, ready, ps, "mgwfbp").groups == [[0, 1], [2], [3]]
    # The line fitted to the round trips (alpha = a = 4 ms) would wait those 2 ms for tensor 2.
    fitted = LinearModel.fit(ps.sizes, ps.times)
    assert fitted.alpha == pytest.approx(4e-3)
    assert plan(sizes, ready, fitted, "mgwfbp").groups == [[0, 1, 2], [3]]


def test_rule_merges_for_free_while_the_channel_is_busy():
    ps = ps_table(workers=4, servers=4, a=4e-3, per_server_Bps=1e9)
    # Tensor 0's 8 MB hold the channel for 1 + 4 ms; tensors 1 and 2 are ready at 2 and 3 ms, after
    # alpha (no waiting merge into tensor 0) but before the channel is free: 1 and 2 go together.
    sizes, ready = [8e6, 1.0 * KiB, 1.0 * KiB], [0.0, 2e-3, 3e-3]
    assert plan(sizes, ready, ps, "mgwfbp").groups == [[0], [1, 2]]


def test_simulated_startup_bound_cell_mgwfbp_beats_wfbp():
    """48 small tensors, 50 us of backward apart, on 8 workers and 8 servers with 200 us per push:
    one message per tensor is bound by the servers' startups, and MG-WFBP's merges remove them."""
    layers = [LayerSpec(f"layer{i}", [32 * KiB], forward_s=2e-5, backward_s=5e-5) for i in range(48)]
    model = ModelSpec(layers=layers, batch_size=8, name="small-tensors")
    cluster = ClusterSpec(workers=8, servers=8, bandwidth_Bps=1.25e9 * 0.94, startup_s=2e-4)
    wfbp = simulate(model, cluster, "wfbp", timeline=False)
    mgwfbp = simulate(model, cluster, "mgwfbp", timeline=False)
    assert len(mgwfbp.groups) < len(wfbp.groups)
    assert mgwfbp.iteration_s <= wfbp.iteration_s
