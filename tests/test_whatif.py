"""``imerge-whatif``: every row and a recommendation on a small cluster, input errors naming the option,
the hierarchical all-reduce against a hand computation, the recommendation, the CPU budget, and the
measured error it prints."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from imerge_hooks.simulate import (
    ClusterSpec,
    LayerSpec,
    ModelSpec,
    hierarchical_allreduce_s,
    ring_allreduce_s,
    simulate_allreduce,
)
from imerge_hooks.simulate.choices import Cluster, Option, Outcome, options, predict_all, recommend
from imerge_hooks.simulate.cpu_budget import CpuBudgetSpent, can_limit, cpu_limit
from imerge_hooks.simulate.measured import load, sentence, short
from imerge_hooks.tools import whatif

REPO = Path(__file__).resolve().parent.parent
SYNTHETIC = REPO / "benchmarks" / "profiles" / "synthetic-cpu.json"
SMALL = ["--profile", str(SYNTHETIC), "--workers", "4", "--gpus-per-host", "2", "--link-gbit", "1"]


def table_rows(out: str) -> list[dict[str, str]]:
    """The printed table as dicts, columns cut where the header's dashes are."""
    lines = out.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("option "))
    spans, pos = [], 0
    for dashes in lines[at + 1].split("  "):
        spans.append((pos, pos + len(dashes)))
        pos += len(dashes) + 2
    names = [lines[at][a:b].strip() for a, b in spans]
    rows = []
    for line in lines[at + 2:]:
        if not line.strip():
            break
        rows.append({n: line[a:b].strip() if n != names[-1] else line[a:].strip() for n, (a, b) in zip(names, spans)})
    return rows


def test_small_cluster_prints_every_row_and_a_recommendation(capsys):
    assert whatif.main([*SMALL, "--server-hosts", "1", "--schedules", "imerge,mpi-allreduce"]) == 0
    out = capsys.readouterr().out
    rows = table_rows(out)
    assert [(r["option"], r["servers"]) for r in rows] == [
        ("DDP (ring all-reduce)", "-"), ("hierarchical all-reduce", "-"), ("Horovod (ring all-reduce)", "-"),
        ("imerge", "2 servers, one on each worker host"), ("imerge", "1 server on 1 of the 2 worker hosts"),
        ("imerge", "1 server on a host of its own")]
    for row in rows:  # a time, a throughput, a ratio to DDP and the measured error on every row
        assert float(row["s/iter"]) > 0 and float(row["samples/s"]) > 0 and row["vs DDP"].endswith("x")
        assert row["simulator vs measurement"].startswith("within") or row["simulator vs measurement"] == \
            "not measured"
    assert rows[0]["vs DDP"] == "1.00x"
    assert "\nUse " in out and "DDP's throughput" in out
    assert "imerge: simulator within" in out and "hierarchical: no measured cell" in out


def _fails(argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as exited:
        whatif.main(argv)
    assert exited.value.code != 0
    return capsys.readouterr().err


@pytest.mark.parametrize(("argv", "option"), [
    (["--profile", str(SYNTHETIC), "--workers", "6", "--gpus-per-host", "4", "--link-gbit", "1"], "--gpus-per-host"),
    (["--profile", str(SYNTHETIC), "--workers", "4", "--link-gbit", "-1"], "--link-gbit"),
    (["--profile", str(SYNTHETIC), "--workers", "4", "--link-gbit", "0"], "--link-gbit"),
    (["--model", "no_such_net", "--workers", "4", "--link-gbit", "1"], "--model"),
    (["--profile", "/nonexistent/profile.json", "--workers", "4", "--link-gbit", "1"], "--profile"),
    ([*SMALL, "--servers", "dedicated"], "--server-hosts"),
    ([*SMALL, "--schedules", "imerge,nccl"], "--schedules"),
    ([*SMALL, "--batch-size", "16"], "--batch-size"),
    ([*SMALL, "--image-size", "32"], "--image-size"),
    (["--profile", str(SYNTHETIC), "--workers", "1", "--link-gbit", "1"], "--workers"),
    ([*SMALL, "--cpu-budget", "nan"], "--cpu-budget"),
])
def test_bad_input_exits_non_zero_naming_the_option(argv, option, capsys):
    assert option in _fails(argv, capsys)


def test_a_file_that_is_not_a_profile_is_named(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"model": "x"}))
    assert "--profile" in _fails(["--profile", str(bad), "--workers", "4", "--link-gbit", "1"], capsys)


def test_hierarchical_allreduce_against_a_hand_computation():
    m, hosts, g, nic, local, add = 8e6, 4, 2, 100e6, 400e6, 800e6
    lat, local_lat = 1e-3, 1e-4
    # inside: G-1 = 1 step each way, m on the host's local link per step, and m/G summed
    inside = (g - 1) * (2 * (local_lat + m / local) + m / g / add)  # 2 * 0.0201 + 0.005
    across = 2 * (hosts - 1) * (lat + m / hosts / nic)  # the ring over 4 hosts: 6 * 0.021
    got = hierarchical_allreduce_s(m, hosts, g, nic, local, add, step_latency_s=lat, local_latency_s=local_lat)
    assert got == pytest.approx(inside + across) == pytest.approx(0.1712)
    # one worker per host: the ring over the hosts; one host: the in-host phases alone
    assert hierarchical_allreduce_s(m, 4, 1, nic, local, add, lat) == pytest.approx(ring_allreduce_s(m, 4, nic, lat))
    assert hierarchical_allreduce_s(m, 1, 2, nic, local, add, lat, local_lat) == pytest.approx(inside)
    assert hierarchical_allreduce_s(m, 1, 1, nic, local, add) == 0.0


def test_hierarchical_iteration_is_the_fused_all_reduce_after_the_backward():
    layer = LayerSpec("only", [8_000_000], forward_s=0.1, backward_s=0.2)
    model = ModelSpec([layer], batch_size=4)
    hosts = (0, 0, 1, 1, 2, 2, 3, 3, 4)  # 8 workers on 4 hosts, the (unused) server on a fifth
    cluster = ClusterSpec(workers=8, servers=1, bandwidth_Bps=100e6, startup_s=0.0, hosts=hosts, local_Bps=400e6,
                          reduce_Bps=800e6)
    got = simulate_allreduce(model, cluster, "hierarchical", step_latency_s=1e-3)
    negotiate = 3 * 1e-3  # ceil(log2 8) latency steps
    expected = 0.1 + 0.2 + negotiate + hierarchical_allreduce_s(8e6, 4, 2, 100e6, 400e6, 800e6, 1e-3)
    assert got.iteration_s == pytest.approx(expected)
    flat = ClusterSpec(workers=4, servers=1, bandwidth_Bps=100e6, startup_s=0.0)  # a host per worker
    assert simulate_allreduce(model, flat, "hierarchical").iteration_s == pytest.approx(
        simulate_allreduce(model, flat, "mpi-allreduce").iteration_s)
    with pytest.raises(ValueError, match="same number of workers"):
        simulate_allreduce(model, ClusterSpec(workers=3, servers=1, bandwidth_Bps=1e8, startup_s=0.0,
                                              hosts=(0, 0, 1, 2)), "hierarchical")


def test_ring_charges_its_in_host_hops_only_when_asked():
    assert ring_allreduce_s(8e6, 8, 100e6, 0.0, per_host=4, local_Bps=None) == ring_allreduce_s(8e6, 8, 100e6, 0.0)
    # 3 hops inside a host share 150 MB/s: 3 * 1 MB / 150e6 = 20 ms a step against the NIC's 10 ms
    assert ring_allreduce_s(8e6, 8, 100e6, 0.0, per_host=4, local_Bps=150e6) == pytest.approx(14 * 0.02)



def test_recommendation_picks_the_smallest_predicted_time():
    made = [Outcome(Option("ddp"), 2.0, 10.0), Outcome(Option("hierarchical"), 1.5, 13.0),
            Outcome(Option("imerge", "colocated", 4), 1.2, 16.0), Outcome(Option("imerge", "colocated", 2), None,
                                                                          skipped="budget"),
            Outcome(Option("wfbp", "colocated", 4), float("inf"), 0.0), Outcome(Option("wfbp", "dedicated", 2), 1.3)]
    best, second = recommend(made)
    assert best.option == Option("imerge", "colocated", 4) and second.option == Option("wfbp", "dedicated", 2)
    tie = [Outcome(Option("ddp"), 1.0, 8.0), Outcome(Option("imerge", "colocated", 2), 1.0, 8.0)]
    assert recommend(tie)[0].option.schedule == "ddp"  # a tie goes to the earlier row
    with pytest.raises(ValueError):
        recommend([Outcome(Option("imerge", "colocated", 2), skipped="budget")])


def test_the_printed_recommendation_is_the_fastest_row(capsys):
    whatif.main(SMALL)
    out = capsys.readouterr().out
    rows = table_rows(out)
    fastest = min(rows, key=lambda r: float(r["s/iter"]))
    advice = out.split("\nUse ")[1].splitlines()[0]
    assert advice.startswith(fastest["option"]) and f"{fastest['s/iter']} s per iteration" in advice
    if fastest["servers"] != "-":
        assert fastest["servers"] in advice


def test_options_cover_each_server_layout_once():
    cluster = Cluster(workers=16, per_host=4, link_Bps=1e9, startup_s=1e-4)
    rows = options(cluster, ["imerge"], ["colocated", "colocated-half", "dedicated"], 3)
    assert rows == [Option("ddp"), Option("hierarchical"), Option("imerge", "colocated", 4),
                    Option("imerge", "colocated", 2), Option("imerge", "dedicated", 3)]
    one_host = Cluster(workers=4, per_host=4, link_Bps=1e9, startup_s=1e-4)
    assert options(one_host, ["imerge"], ["colocated", "colocated-half"], 0)[2:] == [Option("imerge", "colocated", 1)]


def test_cells_over_the_cpu_budget_are_skipped_and_said_so(capsys):
    model = ModelSpec.from_profile_json(SYNTHETIC)
    cluster = Cluster(workers=4, per_host=2, link_Bps=1.25e8, startup_s=2e-4)
    out = predict_all(model, cluster, options(cluster, ["imerge"], ["colocated"], 0), cpu_budget_s=0.5)
    assert out[0].iteration_s is not None and out[1].iteration_s is not None  # the all-reduces always run
    assert out[2].iteration_s is None and "CPU budget" in out[2].skipped
    whatif.main([*SMALL, "--cpu-budget", "0.5"])
    printed = capsys.readouterr().out
    assert "CPU budget" in printed and "raise --cpu-budget" in printed
    assert "Of the options predicted, use " in printed


@pytest.mark.skipif(not can_limit(), reason="no CPU timer here")
def test_cpu_limit_stops_a_busy_block():
    start = time.process_time()
    with pytest.raises(CpuBudgetSpent):
        with cpu_limit(0.2):
            while True:
                try:
                    sum(range(1000))
                except Exception:  # noqa: BLE001 - it must not catch the budget
                    pass
    assert time.process_time() - start < 2.0
    with cpu_limit(5.0):
        pass  # a block that ends in time leaves no timer behind
    time.sleep(0)


def test_measured_error_is_shipped_and_phrased():
    errors = load()
    assert errors["imerge"]["cells"] >= 10 and errors["ddp"]["cells"] >= 10
    assert short(errors, "imerge").startswith("within ") and short(errors, "hierarchical") == "not measured"
    assert sentence(errors, "imerge").startswith("imerge: simulator within ")
    assert "benchmarks/clusters.py" in errors["imerge"]["where"]


def test_profile_module_times_every_parameterised_layer():
    import torch

    from imerge_hooks.simulate.torch_profile import profile_module

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10))
    spec = profile_module(net, torch.randn(4, 16), torch.randint(0, 10, (4,)), name="mlp")
    assert [layer.name for layer in spec.layers] == ["0", "2"] and spec.batch_size == 4
    assert [layer.param_bytes for layer in spec.layers] == [[16 * 32 * 4, 32 * 4], [32 * 10 * 4, 10 * 4]]
    assert all(layer.forward_s >= 0 and layer.backward_s >= 0 for layer in spec.layers)
    assert sum(p.grad is None for p in net.parameters()) == 0 and not net._forward_hooks  # hooks removed


def test_model_option_profiles_the_named_torchvision_model(monkeypatch, capsys):
    from imerge_hooks.simulate import torch_profile

    asked = []

    def fake(name, batch_size, image_size=224, **_):
        asked.append((name, batch_size, image_size))
        return ModelSpec.from_profile_json(SYNTHETIC)

    monkeypatch.setattr(torch_profile, "profile_torchvision", fake)
    assert whatif.main(["--model", "resnet18", "--batch-size", "4", "--image-size", "32", "--workers", "4",
                        "--link-gbit", "1", "--time-scale", "0.5"]) == 0
    assert asked == [("resnet18", 4, 32)]
    assert "compute 0.2400 s per iteration (time scale 0.5)" in capsys.readouterr().out
