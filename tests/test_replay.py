"""Compute replay (benchmarks/replay.py) against the profiles and the real torchvision models."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch
import torchvision

from benchmarks.replay import PROFILE_DIR, ReplayModel, load_profile

MODELS = ("resnet18", "vgg16", "alexnet", "resnet50")


def _real(name: str) -> torch.nn.Module:
    with torch.device("meta"):  # exact shapes, no memory, no init time
        return getattr(torchvision.models, name)(weights=None, num_classes=1000)


def _specs(model: torch.nn.Module) -> list[tuple[str, tuple[int, ...], int]]:
    return [(n, tuple(p.shape), p.numel() * p.element_size()) for n, p in model.named_parameters()]


@pytest.mark.parametrize("name", MODELS)
def test_profile_matches_real_model(name):
    prof = load_profile(name, "cpu")
    assert prof["model"] == name and prof["device"] == "cpu"
    for key in ("batch_size", "image_size", "iteration_s"):
        assert prof[key] > 0
    listed = [(p["name"], tuple(p["shape"]), p["bytes"]) for layer in prof["layers"] for p in layer["params"]]
    assert listed == _specs(_real(name))
    for layer in prof["layers"]:
        assert set(layer) == {"name", "forward_s", "backward_s", "params"}
        assert layer["forward_s"] >= 0 and layer["backward_s"] >= 0
        assert all(p["name"].rsplit(".", 1)[0] == layer["name"] for p in layer["params"])
    total = sum(layer["forward_s"] + layer["backward_s"] for layer in prof["layers"])
    assert total == pytest.approx(prof["iteration_s"], rel=0.25)


@pytest.mark.parametrize("name", MODELS)
def test_replay_parameters_are_the_real_ones(name):
    replay = ReplayModel(name, device="meta")
    assert _specs(replay) == _specs(_real(name))
    assert [layer.layer_name for layer in replay.replay_layers] == [s["name"] for s in load_profile(name)["layers"]]


def test_load_profile_by_path_and_errors(tmp_path):
    path = PROFILE_DIR / "alexnet-cpu.json"
    assert load_profile(path) == load_profile("alexnet") == json.loads(path.read_text())
    assert load_profile("alexnet", device="cpu")["model"] == "alexnet"
    with pytest.raises(FileNotFoundError, match="make_profiles.py"):
        load_profile("nosuchmodel")
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    with pytest.raises(ValueError, match="not a profile"):
        load_profile(bad)


def _all_equal(t: torch.Tensor, value: float) -> bool:
    return bool((t == torch.tensor(value, dtype=t.dtype)).all())


def test_gradients_shapes_values_and_accumulation():
    replay = ReplayModel("resnet18", time_scale=0.0)
    x = torch.randn(4, 1)
    out = replay(x)
    assert out.shape == x.shape
    out.sum().backward()
    value = x.mean()
    for n, p in replay.named_parameters():
        assert p.grad is not None and p.grad.shape == p.shape and p.grad.dtype == p.dtype, n
        assert p.grad.is_contiguous() and _all_equal(p.grad, value.item()), n
    # gradients kept as buffers (what IMerge does) are accumulated in place
    before = {n: p.grad.data_ptr() for n, p in replay.named_parameters()}
    replay(x).sum().backward()
    for n, p in replay.named_parameters():
        assert p.grad.data_ptr() == before[n] and _all_equal(p.grad, (2 * value).item()), n
    half = ReplayModel("resnet18", time_scale=0.0, dtype=torch.float16)
    half(x.half()).sum().backward()
    assert [p.grad.dtype for p in half.parameters()] == [torch.float16] * 62


def _timed_iterations(replay: ReplayModel, iters: int):
    """Per iteration: (forward wall, backward wall, cpu, {layer index: ready time after backward start})."""
    index = {}
    for i, layer in enumerate(replay.replay_layers):
        for p in layer.parameters():
            index[p] = i
    ready: list[tuple[int, float]] = []
    for p, i in index.items():
        p.register_post_accumulate_grad_hook(lambda _p, i=i: ready.append((i, time.perf_counter())))
    x = replay.example_input(2)
    replay(x).sum().backward()  # first iteration allocates .grad; later ones accumulate in place, like IMerge
    results = []
    for _ in range(iters):
        replay.zero_grad(set_to_none=False)
        ready.clear()
        c0, t0 = time.process_time(), time.perf_counter()
        out = replay(x)
        t1 = time.perf_counter()
        out.sum().backward()
        t2, c1 = time.perf_counter(), time.process_time()
        results.append((t1 - t0, t2 - t1, c1 - c0, list(ready), t1))
    return results


@pytest.fixture
def one_thread():
    # as replay workers run (OMP_NUM_THREADS=1): with more intra-op threads, OpenMP's workers spin
    # after each gradient accumulation and burn CPU during the sleeps
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_replay_takes_profiled_time_without_cpu_and_grads_ready_last_layer_first(one_thread):
    prof = load_profile("resnet18")
    total = sum(layer["forward_s"] + layer["backward_s"] for layer in prof["layers"])
    scale = 0.4 / total  # an iteration of ~0.4 s, whatever this machine's profile says
    replay = ReplayModel(prof, time_scale=scale)
    exp_f, exp_b = replay.expected_times()
    assert exp_f + exp_b == pytest.approx(0.4)
    layers = replay.replay_layers
    n_params = sum(len(list(layer.parameters())) for layer in layers)

    def problems(run) -> list[str]:
        fwd, bwd, cpu, ready, t_bwd = run
        out = []
        # sleeps never end early; oversleep is compensated within a pass
        if not 0.9 * exp_f <= fwd <= 1.5 * exp_f + 0.02:
            out.append(f"forward {fwd:.3f} s, expected {exp_f:.3f} s")
        if not 0.9 * exp_b <= bwd <= 1.5 * exp_b + 0.02:
            out.append(f"backward {bwd:.3f} s, expected {exp_b:.3f} s")
        # layer k is ready once the backward times of layers n-1..k have passed
        done = {i: t - t_bwd for i, t in ready}
        cum = 0.0
        for i in range(len(layers) - 1, -1, -1):
            cum += layers[i].backward_s * scale
            if not cum - 0.002 <= done[i] <= 1.5 * cum + 0.02:
                out.append(f"{layers[i].layer_name} ready at {done[i]:.3f} s, expected {cum:.3f} s")
        return out

    runs = _timed_iterations(replay, 4)
    for fwd, bwd, cpu, ready, _ in runs:
        # every parameter's hook fired once, layers in reverse order; little CPU used
        assert len(ready) == n_params
        order = [i for i, _ in ready]
        assert order == sorted(order, reverse=True)
        assert cpu < 0.25 * (fwd + bwd), (cpu, fwd, bwd)
    # timing: at least one iteration on time (other processes may load this machine)
    found = [problems(run) for run in runs]
    assert any(not p for p in found), found


def test_time_scale_is_adjustable():
    replay = ReplayModel("alexnet", time_scale=0.0, device="meta")
    assert replay.expected_times() == (0.0, 0.0)
    replay.time_scale = 0.5
    prof = load_profile("alexnet")
    assert replay.expected_times()[0] == pytest.approx(0.5 * sum(la["forward_s"] for la in prof["layers"]))


def test_profiles_on_disk_are_labelled():
    for path in Path(PROFILE_DIR).glob("*.json"):
        prof = json.loads(path.read_text())
        model, tag = path.stem.rsplit("-", 1)
        assert prof["model"] == model
        assert prof["device"].split(":", 1)[0] == tag


def test_alternate_policies_for_an_ab_in_one_plan():
    """worker_replay --alternate: (A, B) policies, B with the named fields changed; only
    partitioned schedules (they have a credit) alternate; unknown fields are refused."""
    from types import SimpleNamespace

    from benchmarks.worker_replay import _ab_policies
    from imerge_hooks.worker.schedule import SchedulePolicy

    engine = SimpleNamespace(policy=SchedulePolicy(priority=True, stagger=True, credit_bytes=8 << 20))
    a, b = _ab_policies(engine, "tail_credit_bytes=16777216,credit_bytes=none")
    assert a == vars(engine.policy) and a["tail_credit_bytes"] is None
    assert b == {**a, "tail_credit_bytes": 16 << 20, "credit_bytes": None}
    assert _ab_policies(engine, None) is None
    assert _ab_policies(SimpleNamespace(policy=SchedulePolicy()), "credit_bytes=1") is None  # not partitioned
    with pytest.raises(SystemExit, match="no field 'window'"):
        _ab_policies(engine, "window=1")
    _, b = _ab_policies(engine, "priority=false,stagger=Off,tail_credit_bytes=1048576")
    assert b["priority"] is False and b["stagger"] is False and b["tail_credit_bytes"] == 1 << 20
    with pytest.raises(SystemExit, match="priority is true or false"):
        _ab_policies(engine, "priority=2")
    with pytest.raises(SystemExit, match="credit_bytes is a byte count or none"):
        _ab_policies(engine, "credit_bytes=lots")
