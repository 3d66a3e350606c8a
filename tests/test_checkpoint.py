"""Save on worker 0 mid-training, resume on all workers: the same parameters and optimizer
state as an uninterrupted run (including overlap_forward, whose pending updates state_dict() flushes)."""

from pathlib import Path

import pytest
import torch
from mpirun import run_mpi

SCRIPT = Path(__file__).parent / "scripts" / "checkpoint.py"


@pytest.mark.parametrize("schedule", ["imerge"])  # deferred updates: the harder case (wfbp: the model zoo)
def test_resume_equals_uninterrupted(tmp_path, cost_model_dir, schedule):
    env = {"IMERGE_COST_MODEL_PATH": str(cost_model_dir / "ps-{workers}w-{servers}s-{hosts}.json")}
    whole, part, resumed, ckpt = (str(tmp_path / n) for n in ("whole.pt", "part.pt", "resumed.pt", "ckpt.pt"))
    run_mpi(SCRIPT, 4, whole, schedule, "0", "8", servers=2, env=env, timeout=150).check()
    run_mpi(SCRIPT, 4, part, schedule, "0", "4", "-", ckpt, servers=2, env=env, timeout=150).check()
    run_mpi(SCRIPT, 4, resumed, schedule, "4", "8", ckpt, servers=2, env=env, timeout=150).check()
    a, b = torch.load(whole), torch.load(resumed)
    assert max((a["model"][k] - b["model"][k]).abs().max().item() for k in a["model"]) <= 1e-5
    for index, state in a["optimizer"]["state"].items():
        for key, value in state.items():
            assert torch.allclose(torch.as_tensor(value), torch.as_tensor(b["optimizer"]["state"][index][key]),
                                  atol=1e-5, rtol=0), (index, key)
