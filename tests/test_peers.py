"""The all-reduce peers of the benchmarks (benchmarks/peers.py) and their simulator model.

* ``mpi-allreduce`` (Horovod's data plane on MPI) gives the parameters of full-batch training,
  with fusion buffers small enough that the workers negotiate several of them per backward.
* ``benchmarks/worker_replay.py`` runs ``ddp``, ``ddp-tuned`` and ``mpi-allreduce`` next to an
  IMerge schedule in one launch and reports them as the runner expects.
* ``imerge_hooks/simulate/allreduce.py``: the ring all-reduce time, DDP's bucket rule, the
  iteration (forward + max(backward, last all-reduce)) and Horovod's fuse-what-is-ready, by hand.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from common import reference_train
from mpirun import run_mpi

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.peers import ddp_caps  # noqa: E402
from imerge_hooks.simulate import (  # noqa: E402  # noqa: E402
    ClusterSpec,
    LayerSpec,
    ModelSpec,
    allreduce_bound_s,
    ddp_buckets,
    ring_allreduce_s,
    simulate_allreduce,
)

SCRIPT = Path(__file__).parent / "scripts" / "peers_allreduce.py"
MiB = 1 << 20


def test_mpi_allreduce_matches_full_batch_training(tmp_path):
    """Fusion buffers of 4 KiB (several negotiated per backward) and 64 MiB (one), in one job."""
    out = tmp_path / "final-{fusion}.pt"
    sizes = (4096, 64 * MiB)
    run_mpi(SCRIPT, 3, str(out), ",".join(map(str, sizes)), servers=1, timeout=150).check()
    want = reference_train("sgd", 4)
    for fusion in sizes:
        got = torch.load(str(out).format(fusion=fusion))
        assert got.keys() == want.keys()
        assert max((got[k] - want[k]).abs().max().item() for k in got) <= 1e-10, fusion


def test_worker_replay_runs_the_peers_beside_imerge():
    run = run_mpi(REPO / "benchmarks" / "worker_replay.py", 3, "--model", "resnet18", "--schedules",
                  "ddp,ddp-tuned,mpi-allreduce,wfbp", "--time-scale", "0.02", "--iters", "2", "--warmup", "1",
                  servers=1, timeout=240).check()
    results = {}
    for line in run.stdout.splitlines():
        if line.startswith("RESULT "):
            doc = json.loads(line[len("RESULT "):])
            results[doc["schedule"]] = doc
    assert set(results) == {"ddp", "ddp-tuned", "mpi-allreduce", "wfbp"}, run.stdout[-3000:]
    for doc in results.values():
        assert doc["workers"] == 2 and doc["samples_per_s"] > 0 and len(doc["iteration_s_each"]) == 2
        assert doc["timed_monotonic_s"][1] > doc["timed_monotonic_s"][0]
    assert results["ddp"]["bucket_cap_mb"] == 25.0
    tuning = results["ddp-tuned"]["bucket_tuning_s"]
    profile = json.loads((REPO / "benchmarks" / "profiles" / "resnet18-cpu.json").read_text())
    total = sum(p["bytes"] for layer in profile["layers"] for p in layer["params"])
    assert [float(c) for c in tuning] == ddp_caps(total) and all(t > 0 for t in tuning.values())
    assert results["ddp-tuned"]["bucket_cap_mb"] == min(ddp_caps(total), key=lambda c: tuning[str(c)])


def _model(layers: list[tuple[int, float, float]]) -> ModelSpec:
    return ModelSpec([LayerSpec(f"l{i}", [b], f, w) for i, (b, f, w) in enumerate(layers)], batch_size=4)


def test_ring_allreduce_time_and_bound_by_hand():
    # 4 workers, 8 MB at 100 MB/s: 6 steps of 2 MB (20 ms) plus 1 ms latency each
    assert ring_allreduce_s(8e6, 4, 100e6, step_latency_s=1e-3) == pytest.approx(6 * 0.021)
    assert ring_allreduce_s(8e6, 1, 100e6) == 0.0
    assert allreduce_bound_s(8e6, 4, 100e6) == pytest.approx(1.5 * 0.08)
    # a fabric cap of 200 MB/s: each step moves 4 x 2 MB = 8 MB in all, 40 ms
    assert ring_allreduce_s(8e6, 4, 100e6, step_latency_s=0.0, fabric_Bps=200e6) == pytest.approx(6 * 0.04)


def test_ddp_buckets_close_once_they_reach_their_cap():
    sizes = [5, 1, 1, 3, 2, 2]
    order = [5, 4, 3, 2, 1, 0]  # ready order: last layer first
    assert ddp_buckets(sizes, order, bucket_bytes=4, first_bucket_bytes=1) == [[5], [4, 3], [2, 1, 0]]
    assert ddp_buckets(sizes, order, bucket_bytes=100, first_bucket_bytes=100) == [order]


def test_ddp_iteration_is_forward_plus_backward_or_the_last_allreduce():
    # two layers of 10 MB; W=2 at 10 MB/s: an all-reduce of m takes 2 * (m/2) / 10 MB/s = m / 10 MB/s
    model = _model([(10_000_000, 0.1, 0.5), (10_000_000, 0.1, 0.5)])
    cluster = ClusterSpec(workers=2, servers=1, bandwidth_Bps=10e6, startup_s=0.0)
    one_bucket_each = simulate_allreduce(model, cluster, "ddp", bucket_bytes=1, first_bucket_bytes=1,
                                         step_latency_s=0.0)
    # layer 1 ready at 0.5 s, its all-reduce 0.5..1.5; layer 0 ready at 1.0, waits, 1.5..2.5; + forward 0.2
    assert one_bucket_each.groups == [[1], [0]]
    assert one_bucket_each.iteration_s == pytest.approx(0.2 + 2.5)
    together = simulate_allreduce(model, cluster, "ddp", step_latency_s=0.0)  # 25 MiB: one bucket after the first
    assert together.groups == [[1], [0]]  # the first bucket closes at 1 MiB
    fused = simulate_allreduce(model, cluster, "ddp", bucket_bytes=64 * MiB, first_bucket_bytes=64 * MiB,
                               step_latency_s=0.0)
    assert fused.groups == [[1, 0]] and fused.iteration_s == pytest.approx(0.2 + 1.0 + 2.0)
    assert fused.throughput == pytest.approx(2 * 4 / fused.iteration_s)


def test_mpi_allreduce_fuses_what_is_ready_while_the_channel_is_busy():
    # three layers of 10 MB, backward 0.5 s each; W=2 at 10 MB/s (1 s per 10 MB all-reduce)
    model = _model([(10_000_000, 0.0, 0.5)] * 3)
    cluster = ClusterSpec(workers=2, servers=1, bandwidth_Bps=10e6, startup_s=0.0)
    res = simulate_allreduce(model, cluster, "mpi-allreduce", step_latency_s=0.0)
    # layer 2 alone at 0.5 (until 1.5); layers 1 (ready 1.0) and 0 (ready 1.5) fused at 1.5, until 3.5
    assert res.groups == [[2], [1, 0]]
    assert res.iteration_s == pytest.approx(3.5)
    small = simulate_allreduce(model, cluster, "mpi-allreduce", fusion_bytes=10_000_000, step_latency_s=0.0)
    assert small.groups == [[2], [1], [0]]


def test_simulate_allreduce_refuses_bad_input():
    model = _model([(1000, 0.1, 0.1)])
    cluster = ClusterSpec(workers=2, servers=1, bandwidth_Bps=1e6, startup_s=0.0)
    with pytest.raises(ValueError, match="unknown peer 'nccl'"):
        simulate_allreduce(model, cluster, "nccl")
    with pytest.raises(ValueError, match="bucket_bytes must be an int >= 1"):
        simulate_allreduce(model, cluster, "ddp", bucket_bytes=0)
    with pytest.raises(ValueError, match="step_latency_s"):
        simulate_allreduce(model, cluster, "ddp", step_latency_s=-1.0)


def test_compare_tables_the_stored_result_set(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    from benchmarks import compare

    assert compare.main(["--plot", str(tmp_path / "peers.png")]) == 0
    out = capsys.readouterr().out
    assert "imerge S=W/2" in out and "measured (emulated cluster)" in out and "simulated" in out
    assert (tmp_path / "peers.png").stat().st_size > 0
