"""`priority` and `imerge` (partitions, stagger, credit, priority, overlap with the next forward)
give the same parameters and optimizer state as synchronous single-process training."""

from pathlib import Path

import pytest
import torch
from common import reference_train
from mpirun import run_mpi

SCRIPT = Path(__file__).parent / "scripts" / "train_optimizer.py"
TOL = 1e-5


def max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


def state_diff(a, b) -> float:
    """Largest difference between two optimizer state_dicts (tensors and numbers)."""
    worst = 0.0
    for index, sa in a["state"].items():
        for key, va in sa.items():
            vb = b["state"][index][key]
            worst = max(worst, (torch.as_tensor(va, dtype=torch.float64)
                                - torch.as_tensor(vb, dtype=torch.float64)).abs().max().item())
    assert [g["lr"] for g in a["param_groups"]] == pytest.approx([g["lr"] for g in b["param_groups"]])
    return worst


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    cache = tmp_path_factory.mktemp("costmodel")
    # Small partitions and credit so a small model still gets several partitions per group.
    return {"IMERGE_COST_MODEL_PATH": str(cache / "ps-{workers}w-{servers}s-{hosts}.json"),
            "IMERGE_PARTITION_BYTES": "8192", "IMERGE_CREDIT_BYTES": "32768"}


def test_matches_synchronous_training(planned_job):
    """3 workers + 2 servers (conftest ``planned_job``; more cells: the model zoo): the final parameters
    and, after step 4, the parameters and the optimizer state (overlap flushed by state_dict())."""
    for schedule, opt in [(s, o) for s in ("priority", "imerge") for o in ("sgd", "adam", "adamw")]:
        ref_final = reference_train(opt, 6, scheduler=True)
        assert max_diff(planned_job.params[f"{schedule}@{opt}"], ref_final) <= TOL, (schedule, opt)
        mid = planned_job.params[f"{schedule}@{opt}.mid"]
        ref_params, ref_opt = reference_train(opt, 4, scheduler=True, with_optimizer=True)
        assert max_diff(mid["model"], ref_params) <= TOL, (schedule, opt, "mid-training params")
        assert state_diff(mid["optimizer"], ref_opt) <= TOL, (schedule, opt, "mid-training optimizer state")


def test_late_layer_waits_while_front_layers_already_ran(env):
    """Overlap really happens: with slow communication the front layers run before the big last
    layer's group has arrived, and only that layer's pre-hook waits (event order, not wall-clock)."""
    import json

    run = run_mpi(Path(__file__).parent / "scripts" / "overlap_order.py", 3, servers=1, timeout=120,
                  env={**env, "IMERGE_RECORD_EVENTS": "1", "IMERGE_DEBUG_DELAY_PER_MB_S": "0.5"}).check()
    events = json.loads(run.lines(0, "EVENTS")[0])
    forwards = [name for kind, name, _ in events if kind == "forward"]
    assert forwards == ["0", "2", "4", "6"], events
    first_forward = events.index(["forward", "0", None])
    last_forward = events.index(["forward", "6", None])
    waits = [i for i, (kind, _, ready) in enumerate(events) if kind == "wait_begin" and ready is False]
    assert waits, f"no pre-hook had to wait: {events}"
    # The last layer's pre-hook waited for its (slow, large) group after the front layers had already run.
    assert any(first_forward < i < last_forward for i in waits), events
