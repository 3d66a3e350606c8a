"""Workers on CUDA: every front end and schedule against single-process training on the same device,
a gradient finished late by a slow kernel, device memory over 500 iterations, and the overlap with
the next forward. Skipped where CUDA is absent; ``make gpu-check`` runs them on a GPU machine.

Two workers share one GPU (``share_gpus``) with one server on their host: the workers aggregate in
the host and stage through pinned memory. ``test_one_worker_per_host`` stands the workers on two
emulated hosts, the path without host aggregation (device buffers to MPI directly where it is
CUDA-aware). float32 with deterministic kernels and no TF32: the full batch and the workers'
shards differ only in summation order, a few ulps per step; 1e-5 leaves a margin of ~100x.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from mpirun import cost_model_cache, run_mpi

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="no CUDA device here: the GPU suite runs where a GPU is (make gpu-check)")

SCRIPT = Path(__file__).parent / "scripts" / "cuda_checks.py"
TOL = 1e-5
ENV = {"IMERGE_SHARE_GPUS": "1", "IMERGE_PROFILE_STEPS": "3", "IMERGE_FUSION_THRESHOLD_BYTES": "4000",
       "IMERGE_PARTITION_BYTES": "8000", "CUBLAS_WORKSPACE_CONFIG": ":4096:8",
       "IMERGE_COST_MODEL_PATH": str(cost_model_cache() / "gpu-{workers}w-{servers}s-{hosts}.json")}


def results(run) -> dict[str, float]:
    return {name: float(value) for name, value in (line.split() for line in run.lines(0, "RESULT"))}


def test_every_front_end_and_schedule_on_one_shared_gpu(tmp_path):
    run = run_mpi(SCRIPT, 3, str(tmp_path), "--checks", "optimizer,stale,ddp-hook,lightning,memory", servers=1,
                  timeout=400, env=ENV).check()
    got = results(run)
    schedules = ("default", "wfbp", "priority", "threshold", "mgwfbp", "adaptive-ps", "imerge")
    expected = ([f"optimizer:{s}" for s in schedules] + ["stale:wfbp", "stale:imerge"]
                + [f"ddp-hook:{s}" for s in schedules[:-1]] + [f"lightning:{s}" for s in schedules])
    assert sorted(got) == sorted(expected), run.stdout[-3000:]
    bad = {name: diff for name, diff in got.items() if not diff <= TOL}
    assert not bad, bad
    # The profile times gradients on the GPU: the slow kernel's tens of ms show before conv.weight's
    # gradient (host times would show ~0: the host queues all of backward at once).
    ready = json.loads(next(line for line in run.lines(0, "READY") if line.startswith("imerge")).split(" ", 1)[1])
    assert ready["conv.weight"] - ready["fc2.weight"] >= 0.005, ready
    memory = json.loads(run.lines(0, "MEMORY")[0])
    (allocated_50, _), (allocated_end, peak_late) = memory["50"], memory["500"]
    assert allocated_end <= allocated_50, memory  # nothing piles up
    # The peak from iteration 50 on stays within what the live buffers plus one iteration's activations need.
    assert peak_late <= allocated_50 + 4 * 2**20, memory


def test_the_comm_thread_is_never_parked_on_a_device_event(tmp_path):
    """A group submitted first but written late (a long kernel before its gradients) does not hold up
    the groups after it: their results arrive while the GPU still runs that kernel, including gradients
    written on a side stream (readiness is recorded on every producing stream), and training matches
    single-process training. A flag read waits for its own copy, not for the busy copy stream."""
    run = run_mpi(SCRIPT, 3, str(tmp_path), "--checks", "parked", servers=1, timeout=300, env=ENV).check()
    for rank in (0, 1):
        parked = json.loads(run.lines(rank, "PARKED")[0])
        assert all(n >= 1 for n in parked["early"][1:]), parked  # step 0 may still be setting up
        assert parked["read"] == 7.0 and parked["copy_stream_busy_after_read"], parked
    assert results(run)["parked:wfbp"] <= TOL, run.stdout[-3000:]


def test_one_worker_per_host(tmp_path):
    """No host aggregation: each worker pushes its own keys (directly from device memory where the MPI
    is CUDA-aware, else through pinned staging)."""
    run = run_mpi(SCRIPT, 3, str(tmp_path), "--checks", "optimizer,ddp-hook", "--schedules", "wfbp,imerge",
                  servers=1, hosts=["h0", "h1", "h0"], timeout=300, env=ENV).check()
    got = results(run)
    assert sorted(got) == ["ddp-hook:wfbp", "optimizer:imerge", "optimizer:wfbp"], run.stdout[-3000:]
    assert all(diff <= TOL for diff in got.values()), got


def test_next_forward_overlaps_the_slow_last_group(tmp_path):
    """With slow servers the front layers of the next forward run on the GPU before the big last
    layer's group arrives, and only that layer's pre-hook waits (event order, not wall-clock)."""
    run = run_mpi(Path(__file__).parent.parent / "scripts" / "overlap_order.py", 3, "--device", "cuda", servers=1,
                  timeout=200, env={**ENV, "IMERGE_RECORD_EVENTS": "1", "IMERGE_DEBUG_DELAY_PER_MB_S": "0.5"}).check()
    events = json.loads(run.lines(0, "EVENTS")[0])
    forwards = [name for kind, name, _ in events if kind == "forward"]
    assert forwards == ["0", "2", "4", "6"], events
    first, last = events.index(["forward", "0", None]), events.index(["forward", "6", None])
    waits = [i for i, (kind, _, ready) in enumerate(events) if kind == "wait_begin" and ready is False]
    assert any(first < i < last for i in waits), events
