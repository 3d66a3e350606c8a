"""The examples run as their docstrings say (with small sizes)."""

from pathlib import Path

import pytest
import torch
from mpirun import run_mpi

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    return {"IMERGE_COST_MODEL_PATH": str(tmp_path_factory.mktemp("cm") / "ps-{workers}w-{servers}s-{hosts}.json")}


def result_line(run) -> str:
    return next(line for line in run.stdout.splitlines() if line.startswith("RESULT"))


def test_horovod_style_learns_digits_and_resumes(env, tmp_path):
    """Horovod's patterns: fp16 compression, backward_passes_per_step, metric allreduce, then a
    second launch that resumes from worker 0's checkpoint by broadcasting epoch and state."""
    ckpt = str(tmp_path / "ckpt.pt")
    common = ("--checkpoint", ckpt, "--fp16-allreduce", "--batches-per-allreduce", "2")
    run_mpi(EXAMPLES / "horovod_style.py", 3, "--epochs", "1", *common, servers=1, env=env, timeout=150).check()
    run = run_mpi(EXAMPLES / "horovod_style.py", 3, "--epochs", "2", *common, servers=1, env=env,
                  timeout=150).check()
    assert "resumed at epoch 1" in run.stdout and "epoch 0:" not in run.stdout
    assert float(result_line(run).split("val_acc=")[1]) > 0.8


def test_ddp_hook_learns_digits_across_a_checkpoint(env, tmp_path):
    """One epoch, a checkpoint holding the hook state's settings as plain data (it loads with
    ``weights_only=True``, here and in the example), a new launch that resumes with them."""
    ckpt = str(tmp_path / "ckpt.pt")
    run_mpi(EXAMPLES / "ddp_hook.py", 3, "--epochs", "1", "--checkpoint", ckpt, "--schedule", "priority", servers=1,
            env=env, timeout=150).check()
    saved = torch.load(ckpt, weights_only=True)
    assert saved["hook_state"]["schedule"] == "priority" and "num_servers" not in saved["hook_state"]
    run = run_mpi(EXAMPLES / "ddp_hook.py", 3, "--epochs", "2", "--checkpoint", ckpt, servers=1, env=env,
                  timeout=150).check()  # the example's default schedule is wfbp: the checkpoint's wins
    assert "resumed after epoch 0 (schedule priority)" in run.stdout
    assert "epoch 0:" not in run.stdout
    assert float(result_line(run).split("val_acc=")[1]) > 0.8
