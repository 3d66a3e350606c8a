"""Simulator: hand-checked small cases, schedule orderings, layout, trace, specs and errors."""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import pytest

from imerge_hooks.core.config import SCHEDULES
from imerge_hooks.simulate import (
    EVENT_KINDS,
    ClusterSpec,
    LayerSpec,
    ModelSpec,
    calibrate_model,
    simulate,
)

KiB, MiB = 1 << 10, 1 << 20
B = 1e9  # bytes/s of every NIC in these tests
X = MiB / B  # seconds to move 1 MiB over one link at full rate
REPO = Path(__file__).resolve().parents[1]


def approx(value: float):
    return pytest.approx(value, rel=1e-9, abs=1e-12)


def one_layer(nbytes: int = MiB, fwd: float = 1e-3, bwd: float = 2e-3) -> ModelSpec:
    return ModelSpec([LayerSpec("fc", [nbytes], fwd, bwd)], batch_size=8)


# ------------------------------------------------------------------------------ (1) exact round trip
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_one_layer_one_worker_is_compute_plus_startup_plus_push_and_pull(schedule):
    startup = 0.25e-3
    res = simulate(one_layer(), ClusterSpec(1, 1, B, startup), schedule)
    expected = 1e-3 + 2e-3 + startup + 2 * X  # forward, backward, server work, push then result
    assert res.iteration_s == approx(expected)
    assert res.iteration_times == [approx(expected)] * 3
    assert res.throughput == approx(1 * 8 / expected)


@pytest.mark.parametrize("schedule", ["wfbp", "imerge"])
def test_worker_message_cost_is_serial_per_push_and_per_result(schedule):
    startup, cost = 0.25e-3, 0.4e-3
    res = simulate(one_layer(), ClusterSpec(1, 1, B, startup, worker_message_s=cost), schedule)
    # Posting the push and handling the result each take the comm thread `cost`.
    assert res.iteration_s == approx(1e-3 + 2e-3 + cost + startup + 2 * X + cost)


def test_worker_message_cost_hides_behind_the_network_until_it_fills_the_thread():
    startup = 0.25e-3

    def four_keys(cost: float) -> float:  # imerge, one worker and server, 4 keys of 256 KiB
        res = simulate(one_layer(), ClusterSpec(1, 1, B, startup, worker_message_s=cost), "imerge",
                       partition_bytes=256 * KiB, plan_search=False)
        assert len(res.keys) == 4
        return res.iteration_s

    # Posting (0.1 ms) is faster than a key's transfer (X/4 = 0.26 ms): each post ends before the
    # previous push has arrived, so only the first post and the last result's handling add time.
    assert four_keys(0.1e-3) == approx(four_keys(0.0) + 2 * 0.1e-3)
    # Posting slower than the network (0.4 ms): the thread posts all four keys (credit allows), then
    # handles the four results, which have arrived meanwhile: 8 messages in a row.
    assert four_keys(0.4e-3) == approx(1e-3 + 2e-3 + 8 * 0.4e-3)
    with pytest.raises(ValueError, match="worker_message_s"):
        ClusterSpec(1, 1, B, startup, worker_message_s=-1.0)


# ------------------------------------------------------------------------------ (1b) shared fabric
def test_fabric_cap_is_a_link_that_every_flow_crosses():
    startup = 0.25e-3
    # One flow at a time, cap B/2: every transfer takes twice as long.
    capped = simulate(one_layer(), ClusterSpec(1, 1, B, startup, fabric_Bps=B / 2), "wfbp")
    assert capped.iteration_s == approx(3e-3 + startup + 2 * 2 * X)
    # Two workers: their pushes share the server ingress (B/2 each); a cap of B/2 on the sum leaves
    # B/4 each, so each phase takes 4X instead of 2X. A cap above what the links allow changes nothing.
    two = simulate(one_layer(), ClusterSpec(2, 1, B, startup, fabric_Bps=B / 2), "wfbp")
    assert two.iteration_s == approx(3e-3 + 4 * X + 2 * startup + 4 * X)
    loose = simulate(one_layer(), ClusterSpec(2, 1, B, startup, fabric_Bps=10 * B), "wfbp")
    assert loose.iteration_s == approx(simulate(one_layer(), ClusterSpec(2, 1, B, startup), "wfbp").iteration_s)
    with pytest.raises(ValueError, match="fabric_Bps"):
        ClusterSpec(1, 1, B, startup, fabric_Bps=0.0)


# ------------------------------------------------------------------------------ (2) incast
def test_two_workers_share_the_server_ingress_and_egress():
    startup = 0.25e-3
    one = simulate(one_layer(), ClusterSpec(1, 1, B, startup), "wfbp")
    two = simulate(one_layer(), ClusterSpec(2, 1, B, startup), "wfbp")
    for res, workers in ((one, 1), (two, 2)):
        for r in range(workers):
            for kind in ("push", "pull"):
                spans = res.events(kind, f"worker {r}")
                assert len(spans) == 3  # one per iteration
                assert all(e.end - e.start == approx(workers * X) for e in spans)
    # Both pushes arrive together after 2X, the server sums them one after the other (2 startups),
    # then sends the result to both workers at once (egress shared two ways: 2X).
    assert two.iteration_s == approx(3e-3 + 2 * X + 2 * startup + 2 * X)
    assert len(two.events("update", "server 0")) == 2 * 3
    assert two.throughput == approx(2 * 8 / two.iteration_s)


# ------------------------------------------------------------------------------ (3) wfbp overlap
def test_wfbp_hides_the_last_layers_communication_under_backward():
    startup = 0.5e-3
    model = ModelSpec([LayerSpec("front", [MiB], 1e-3, 5e-3), LayerSpec("back", [MiB], 1e-3, 2e-3)], batch_size=4)
    cluster = ClusterSpec(1, 1, B, startup)
    wfbp = simulate(model, cluster, "wfbp")
    # Forward 2 ms, backward of "back" ends at 4 ms; its round trip (startup + 2X ~ 2.6 ms) ends
    # before the backward of "front" (5 ms) does, so only the front layer's round trip shows.
    assert startup + 2 * X < 5e-3
    assert wfbp.iteration_s == approx(2e-3 + 2e-3 + 5e-3 + startup + 2 * X)
    # default: both pushes leave after backward, back to back on the one connection (2X); the
    # first is summed and returned while the second arrives; the second result follows the first.
    default = simulate(model, cluster, "default")
    assert default.iteration_s == approx(9e-3 + 3 * X + startup)
    assert wfbp.iteration_s < default.iteration_s


# ------------------------------------------------------------------------------ (4) orderings
def test_startup_bound_model_default_wfbp_adaptive_ps_imerge():
    # 32 tiny tensors, 1 ms of server work per message, 4 workers: fusion pays.
    model = ModelSpec([LayerSpec(f"l{i}", [4 * KiB, 256], 1e-3, 2e-3) for i in range(16)], batch_size=32)
    cluster = ClusterSpec(4, 1, B, 1e-3)
    t = {s: simulate(model, cluster, s, timeline=False).iteration_s for s in SCHEDULES}
    assert t["default"] > t["wfbp"] > 2 * t["adaptive-ps"]
    assert t["imerge"] <= t["adaptive-ps"] * (1 + 1e-9)


def test_imerge_beats_adaptive_ps_and_overlap_with_the_next_forward_pays():
    model = ModelSpec([LayerSpec(f"l{i}", [6 * MiB, 4 * KiB], 2e-3, 4e-3) for i in range(8)], batch_size=32)
    cluster = ClusterSpec(4, 2, B, 2e-4)
    # On the DP's plan alone, interleaving (partitions spread over the servers) pays.
    adaptive = simulate(model, cluster, "adaptive-ps", plan_search=False)
    imerge = simulate(model, cluster, "imerge", plan_search=False)
    assert imerge.iteration_s < 0.9 * adaptive.iteration_s
    # The plan search never does worse than the DP's plan, and here finds a faster one.
    searched = simulate(model, cluster, "imerge")
    assert searched.iteration_s < 0.95 * imerge.iteration_s
    assert searched.plan.note.startswith("chosen by simulation")
    # Overlap on its own: one group per tensor, front layers first within a small credit window.
    overlap = simulate(model, cluster, "priority", overlap_forward=True, credit_bytes=8 * MiB)
    serial = simulate(model, cluster, "priority", overlap_forward=False, credit_bytes=8 * MiB)
    assert overlap.iteration_s < 0.95 * serial.iteration_s

    def overlapping_pulls(res):
        """Results that worker 0 receives while it runs the forward pass of iteration 1."""
        begin = sorted(e.start for e in res.events("forward", "worker 0") if e.name == "forward l0")[1]
        end = min(e.start for e in res.events("backward", "worker 0") if e.start > begin)
        return [e for e in res.events("pull", "worker 0") if begin < e.end <= end]

    assert overlapping_pulls(overlap)  # results of iteration 0 still arrive during iteration 1's forward
    assert not overlapping_pulls(serial)


# ------------------------------------------------------------------------------ (5) layout
def test_partitions_spread_bytes_evenly_over_servers():
    model = ModelSpec([LayerSpec(f"l{i}", [2 * MiB], 1e-3, 1e-3) for i in range(3)], batch_size=8)
    cluster = ClusterSpec(2, 2, B, 1e-4)

    def pushed(res):
        per_server = defaultdict(int)
        for e in res.events("push"):
            if e.track.startswith("server"):
                per_server[e.track] += e.nbytes
        return dict(per_server)

    parted = simulate(model, cluster, "priority", partition_bytes=MiB)
    assert len(parted.keys) == 6 and all(k.nbytes == MiB for k in parted.keys)
    assert pushed(parted) == {"server 0": 3 * MiB * 2 * 3, "server 1": 3 * MiB * 2 * 3}  # bytes x workers x iters
    assert parted.server_push_bytes == [6 * MiB, 6 * MiB]
    # Without partitions each 2 MiB tensor is still spread over both servers (layout.cut_keys).
    whole = simulate(model, cluster, "wfbp")
    assert len(whole.keys) == 6
    assert pushed(whole) == {"server 0": 3 * MiB * 2 * 3, "server 1": 3 * MiB * 2 * 3}


def test_stagger_and_credit():
    model = ModelSpec([LayerSpec("big", [8 * MiB], 1e-3, 1e-3)], batch_size=8)
    res = simulate(model, ClusterSpec(2, 2, B, 1e-4), "imerge", partition_bytes=MiB, credit_bytes=MiB)
    for r in range(2):
        pushes = sorted(res.events("push", f"worker {r}"), key=lambda e: e.start)
        assert pushes[0].name.endswith(f"to server {r}")  # worker r starts at server r % S
        # a window of one partition per server (schedule.windows): a worker's pushes to one server never
        # overlap in time, and with S = 2 at most two of its pushes are in flight at once
        for s in range(2):
            mine = [e for e in pushes if e.name.endswith(f"to server {s}")]
            assert all(a.end <= b.start + 1e-12 for a, b in zip(mine, mine[1:]))
        assert any(a.end > b.start + 1e-12 for a, b in zip(pushes, pushes[1:]))  # both servers at once
        assert all(a.end <= c.start + 1e-12 for a, c in zip(pushes, pushes[2:]))


def test_priority_feeds_every_server():
    """Priority (no stagger) with one window per worker had every worker push the same few keys to the
    same servers while the others idled; a window per server lets every server work at once."""
    layers = [LayerSpec(f"l{i}", [4 * MiB], 1e-3, 1e-3) for i in range(4)]
    model = ModelSpec(layers, batch_size=8)
    cluster = ClusterSpec(4, 4, B, 1e-4)
    res = simulate(model, cluster, "priority", partition_bytes=MiB, credit_bytes=2 * MiB)
    pushes = [e for e in res.timeline if e.kind == "push" and e.track.startswith("server")]
    at_once = max(len({e.track for e in pushes if e.start <= t < e.end}) for t in (p.start for p in pushes))
    assert at_once == 4
    assert res.iteration_s <= simulate(model, cluster, "wfbp").iteration_s


def test_time_scale_and_a_model_without_parameters():
    model = ModelSpec([LayerSpec("act", [], 1e-3, 2e-3), LayerSpec("pool", [], 0.5e-3, 0.5e-3)], batch_size=2)
    res = simulate(model, ClusterSpec(3, 1, B, 1e-3, time_scale=2.0), "imerge")
    assert res.iteration_s == approx(2 * 4e-3)
    assert res.groups == [] and not res.events("push")


# ------------------------------------------------------------------------------ (6) chrome trace
def test_chrome_trace_has_one_track_per_worker_and_server(tmp_path):
    model = ModelSpec([LayerSpec(f"l{i}", [3 * MiB, 4 * KiB], 1e-3, 2e-3) for i in range(3)], batch_size=8)
    res = simulate(model, ClusterSpec(3, 2, B, 1e-4), "imerge", partition_bytes=MiB)
    path = tmp_path / "sub" / "trace.json"
    res.to_chrome_trace(path)
    events = json.loads(path.read_text())["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    assert sorted(names.values()) == ["server 0", "server 1", "worker 0", "worker 1", "worker 2"]
    spans = [e for e in events if e["ph"] == "X"]
    assert {e["pid"] for e in spans} == set(names)
    assert {e["cat"] for e in spans} <= set(EVENT_KINDS)
    assert {e["cat"] for e in spans if names[e["pid"]].startswith("worker")} >= {"forward", "backward", "push", "pull"}
    assert {e["cat"] for e in spans if names[e["pid"]].startswith("server")} == {"push", "update", "pull"}
    assert len(spans) == len(res.timeline)
    end_us = max(e["ts"] + e["dur"] for e in spans)
    assert end_us == pytest.approx(max(e.end for e in res.timeline) * 1e6)
    lanes = defaultdict(list)  # spans of one thread never overlap (Perfetto needs proper nesting)
    for e in spans:
        lanes[(e["pid"], e["tid"])].append((e["ts"], e["ts"] + e["dur"]))
    for intervals in lanes.values():
        intervals.sort()
        assert all(a[1] <= b[0] + 1e-6 for a, b in zip(intervals, intervals[1:]))


# ------------------------------------------------------------------------------ specs, cost model, errors
PROFILE = {
    "model": "tiny", "device": "cpu", "batch_size": 16, "iteration_s": 0.01,
    "layers": [
        {"name": "conv1", "forward_s": 1e-3, "backward_s": 2e-3,
         "params": [{"name": "conv1.weight", "shape": [8, 3, 3, 3], "bytes": 864}]},
        {"name": "fc", "forward_s": 5e-4, "backward_s": 1e-3,
         "params": [{"name": "fc.weight", "shape": [10, 8], "bytes": 320},
                    {"name": "fc.bias", "shape": [10], "bytes": 40}]},
    ],
}


def test_model_from_profile_json(tmp_path):
    path = tmp_path / "tiny-cpu.json"
    path.write_text(json.dumps(PROFILE))
    model = ModelSpec.from_profile_json(path)
    assert model.name == "tiny" and model.batch_size == 16
    assert [(layer.name, layer.param_bytes) for layer in model.layers] == [("conv1", [864]), ("fc", [320, 40])]
    assert model.tensor_bytes == [864, 320, 40]
    res = simulate(model, ClusterSpec(2, 1, B, 1e-4), "adaptive-ps")
    assert sorted(i for g in res.groups for i in g) == [0, 1, 2]
    assert res.groups[0][0] == 2  # ready order: fc.bias, fc.weight, conv1.weight


@pytest.mark.parametrize("mutate, words", [
    (lambda p: p["layers"][1].pop("forward_s"), "layer 1 ('fc')"),
    (lambda p: p["layers"][0]["params"][0].pop("bytes"), "layer 0 ('conv1')"),
    (lambda p: p.pop("batch_size"), "batch_size"),
    (lambda p: p.pop("layers"), "not a profile"),
    (lambda p: p["layers"][0].update(backward_s=-1.0), "backward_s"),
])
def test_bad_profiles_raise_clear_errors(tmp_path, mutate, words):
    profile = json.loads(json.dumps(PROFILE))
    mutate(profile)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(profile))
    with pytest.raises(ValueError, match=words.replace("(", r"\(").replace(")", r"\)")):
        ModelSpec.from_profile_json(path)
    path.write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        ModelSpec.from_profile_json(path)


@pytest.mark.parametrize("workers, servers", [(8, 2), (2, 4)])
def test_calibrate_model_matches_the_simulated_cluster(workers, servers):
    cluster = ClusterSpec(workers, servers, B, 1e-4)
    ps = calibrate_model(cluster)
    assert ps.workers == workers and ps.servers == servers
    assert ps.a == pytest.approx(workers * 1e-4, rel=1e-6)  # W startups in a row at each server
    back = ClusterSpec.from_psmodel(ps)
    assert back.startup_s == pytest.approx(cluster.startup_s, rel=1e-6)
    assert back.bandwidth_Bps == pytest.approx(cluster.bandwidth_Bps, rel=1e-6)


def test_errors_are_clear():
    model = one_layer()
    cluster = ClusterSpec(2, 1, B, 1e-4)
    with pytest.raises(ValueError, match="unknown schedule 'fast'.*imerge"):
        simulate(model, cluster, "fast")
    for kwargs, words in [({"workers": 0}, "workers"), ({"servers": 1.5}, "servers"),
                          ({"bandwidth_Bps": 0.0}, "bandwidth_Bps"), ({"startup_s": -1.0}, "startup_s"),
                          ({"time_scale": float("nan")}, "time_scale")]:
        args = {"workers": 2, "servers": 1, "bandwidth_Bps": B, "startup_s": 0.0, **kwargs}
        with pytest.raises(ValueError, match=words):
            ClusterSpec(**args)
    for option in ("partition_bytes", "credit_bytes", "fusion_threshold_bytes", "iterations"):
        with pytest.raises(ValueError, match=option):
            simulate(model, cluster, "imerge", **{option: 0})
    with pytest.raises(ValueError, match="'fc'.*param_bytes"):
        simulate(ModelSpec([LayerSpec("fc", [-4], 0.0, 0.0)], 1), cluster, "wfbp")
    with pytest.raises(ValueError, match="no layers"):
        simulate(ModelSpec([], 1), cluster, "wfbp")
    with pytest.raises(ValueError, match="batch_size"):
        simulate(ModelSpec(model.layers, 0), cluster, "wfbp")
    with pytest.raises(ValueError, match="time"):
        simulate(model, cluster, "adaptive-ps", cost_model=object())


def test_stored_profiles_simulate():
    paths = sorted((REPO / "benchmarks" / "profiles").glob("*.json"))
    if not paths:
        pytest.skip("no benchmarks/profiles/*.json yet")
    model = ModelSpec.from_profile_json(paths[0])
    compute = sum(layer.forward_s + layer.backward_s for layer in model.layers)
    cluster = ClusterSpec(4, 2, 1.25e9, 5e-5)
    for schedule in ("wfbp", "imerge"):
        res = simulate(model, cluster, schedule, iterations=2, timeline=False)
        assert res.iteration_s >= compute * (1 - 1e-9)
        assert sorted(i for g in res.groups for i in g) == list(range(len(model.tensor_bytes)))


# ------------------------------------------------------------------------------ uneven incast sharing
def test_connection_weights_are_lognormal_with_mean_one_and_the_asked_cv():
    from statistics import fmean, pstdev

    from imerge_hooks.simulate import connection_weight

    ws = [connection_weight(0.5, 0, epoch, worker, server)
          for epoch in range(200) for worker in range(8) for server in range(2)]
    assert fmean(ws) == pytest.approx(1.0, abs=0.05)
    assert pstdev(ws) == pytest.approx(0.5, abs=0.06)
    assert connection_weight(0.5, 0, 3, 1, 0) == connection_weight(0.5, 0, 3, 1, 0)  # deterministic
    assert connection_weight(0.5, 1, 3, 1, 0) != connection_weight(0.5, 0, 3, 1, 0)  # the seed matters
    assert connection_weight(0.0, 0, 3, 1, 0) == 1.0


def test_uneven_incast_sharing_hand_checked():
    """Two workers push 1 MiB into one server with weights w0, w1 (one share period for the whole run).

    Worker a (the larger weight) gets B*wa/(wa+wb) and is delivered at t_a = X*(wa+wb)/wa; then the
    other gets the whole ingress, so the last push still lands at 2X (the link never idles). The
    server sums push a while push b still streams in, so the key completes at 2X + one startup
    (fair sharing delivers both at 2X: two startups in a row). Results share the egress evenly.
    """
    from imerge_hooks.simulate import connection_weight

    startup = 0.1e-3
    cv, seed = 0.8, 3
    w = [connection_weight(cv, seed, 0, r, 0) for r in range(2)]
    assert max(w) / min(w) > 1.2  # a seed whose shares differ clearly
    t_first = X * sum(w) / max(w)
    assert t_first + startup < 2 * X
    cluster = ClusterSpec(2, 1, B, startup, share_cv=cv, share_period_s=100.0, share_seed=seed)
    res = simulate(one_layer(), cluster, "wfbp", iterations=1)
    assert res.iteration_s == approx(3e-3 + 2 * X + startup + 2 * X)
    pushes = [e.end - e.start for r in range(2) for e in res.events("push", f"worker {r}")]
    assert sorted(pushes) == [approx(t_first), approx(2 * X)]
    assert pushes[w.index(max(w))] == approx(t_first)
    assert [e.end - e.start for r in range(2) for e in res.events("pull", f"worker {r}")] == [approx(2 * X)] * 2
    fair = simulate(one_layer(), ClusterSpec(2, 1, B, startup), "wfbp", iterations=1)
    assert fair.iteration_s == approx(3e-3 + 2 * X + 2 * startup + 2 * X)


def test_uneven_sharing_slows_many_keys_and_zero_cv_is_max_min_fair():
    """Many keys per server, shares that persist for about an iteration: a key waits for its
    slowest push, so results trail the pushes (with shares redrawn very often it averages out)."""
    model = ModelSpec([LayerSpec(f"l{i}", [4 * MiB], 1e-3, 2e-3) for i in range(8)], batch_size=8)
    fair = simulate(model, ClusterSpec(8, 2, B, 1e-5), "imerge", plan_search=False)
    zero = simulate(model, ClusterSpec(8, 2, B, 1e-5, share_cv=0.0), "imerge", plan_search=False)
    uneven = simulate(model, ClusterSpec(8, 2, B, 1e-5, share_cv=0.6, share_period_s=0.1),
                      "imerge", plan_search=False)
    assert zero.iteration_s == fair.iteration_s
    assert uneven.iteration_s > 1.05 * fair.iteration_s
    with pytest.raises(ValueError, match="share_cv"):
        ClusterSpec(2, 1, B, 0.0, share_cv=-0.1)
    with pytest.raises(ValueError, match="share_period_s"):
        ClusterSpec(2, 1, B, 0.0, share_period_s=0.0)


@pytest.mark.parametrize("schedule", ["default", "wfbp", "imerge"])
def test_uneven_sharing_after_an_idle_gap_keeps_time_moving_forward(schedule):
    """Pushes start 3 ms into each iteration, after many share periods with nothing to push: the
    first push must take the shares of the period it starts in (a share event dated in an earlier
    period would run simulated time backwards). Each iteration still costs at least forward +
    backward + both pushes and both results through the one server (4X), and every push starts
    after its iteration's backward."""
    startup = 0.1e-3
    cluster = ClusterSpec(2, 1, B, startup, share_cv=0.8, share_period_s=0.2e-3, share_seed=3)
    res = simulate(one_layer(), cluster, schedule, iterations=3)
    assert all(t >= 3e-3 + 4 * X + startup - 1e-12 for t in res.iteration_times)
    assert res.iteration_s <= 3e-3 + 4 * X + 2 * startup + 1e-12  # never slower than back-to-back sums
    starts = [0.0]
    for t in res.iteration_times:
        starts.append(starts[-1] + t)
    for r in range(2):
        pushes = sorted(e.start for e in res.events("push", f"worker {r}"))
        assert len(pushes) == 3
        for it, t in enumerate(pushes):
            assert t >= starts[it] + 3e-3 - 1e-12


def test_stagger_in_waves_completes_each_wave_before_the_group_ends():
    """16 keys of 1 MiB on 4 servers, 4 workers: rotating the whole group puts the keys before each worker's
    first server at the end of its sequence, so the group's first S - 1 keys complete only at its end; in
    waves (a key per server each) every key completes with its wave."""
    from imerge_hooks.worker.schedule import key_slots

    servers = [i % 4 for i in range(16)]
    waves = [key_slots(servers, worker, 4, True, waves=True) for worker in range(4)]
    for worker, order in enumerate(waves):
        assert sorted(order) == list(range(16))
        assert [servers[i] for i in order[:4]] == [(worker + j) % 4 for j in range(4)]
    assert all(max(o.index(k) for o in waves) < 4 * (k // 4 + 1) for k in range(16))
    whole = [key_slots(servers, worker, 4, True) for worker in range(4)]
    assert [max(o.index(k) for o in whole) for k in range(3)] == [15, 15, 15]
    model = ModelSpec([LayerSpec("front", [MiB], 1e-3, 1e-3), LayerSpec("big", [16 * MiB], 1e-3, 1e-3)], batch_size=8)
    cluster = ClusterSpec(4, 4, B, 1e-4)
    common = dict(groups=[[1], [0]], partition_bytes=MiB, stagger=True, plan_search=False)
    whole_res = simulate(model, cluster, "imerge", **common)
    waves_res = simulate(model, cluster, "imerge", waves=True, **common)
    assert waves_res.iteration_s < 0.9 * whole_res.iteration_s  # 25.5 ms against 29.6 ms
