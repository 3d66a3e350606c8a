"""Save on worker 0 mid-training, resume on all workers: the same parameters and optimizer
state as uninterrupted training (including overlap_forward, whose pending updates state_dict() flushes).

The uninterrupted run is the single-process reference (``common.reference_train``): the same
model, Adam and StepLR on the full batch, which every equivalence test holds IMerge to."""

from pathlib import Path

import pytest
import torch
from common import reference_train
from mpirun import run_mpi

SCRIPT = Path(__file__).parent / "scripts" / "checkpoint.py"


@pytest.mark.parametrize("schedule", ["imerge"])  # deferred updates: the harder case (wfbp: the model zoo)
def test_resume_equals_uninterrupted(tmp_path, cost_model_dir, schedule):
    env = {"IMERGE_COST_MODEL_PATH": str(cost_model_dir / "ps-{workers}w-{servers}s-{hosts}.json")}
    part, resumed, ckpt = (str(tmp_path / n) for n in ("part.pt", "resumed.pt", "ckpt.pt"))
    run_mpi(SCRIPT, 4, part, schedule, "0", "4", "-", ckpt, servers=2, env=env, timeout=150).check()
    run_mpi(SCRIPT, 4, resumed, schedule, "4", "8", ckpt, servers=2, env=env, timeout=150).check()
    model, optimizer = reference_train("adam", 8, scheduler=True, with_optimizer=True)
    b = torch.load(resumed)
    assert max((model[k] - b["model"][k]).abs().max().item() for k in model) <= 1e-5
    for index, state in optimizer["state"].items():
        for key, value in state.items():
            assert torch.allclose(torch.as_tensor(value), torch.as_tensor(b["optimizer"]["state"][index][key]),
                                  atol=1e-5, rtol=0), (index, key)
