"""Issue 7's bad-input matrix: each case is a clear exception or documented, tested behaviour."""

from pathlib import Path

import pytest
import torch
from matrix import train
from mpirun import run_mpi

SCRIPT = Path(__file__).parent / "scripts" / "matrix.py"


@pytest.mark.parametrize("schedule", ["imerge"])  # wfbp: the model zoo
def test_awkward_model_matches_single_process(tmp_path, schedule):
    """Mixed dtypes, non-contiguous gradients, sometimes-used parameters, freeze/unfreeze
    (a plan epoch change mid-training), set_to_none True and False."""
    out = tmp_path / "final.pt"
    env = {"IMERGE_COST_MODEL_PATH": str(tmp_path / "ps-{workers}w-{servers}s-{hosts}.json"),
           "IMERGE_PARTITION_BYTES": "256"}
    run_mpi(SCRIPT, 4, str(out), schedule, servers=2, env=env, timeout=150).check()
    ref = train(0, 1).state_dict()
    got = torch.load(out)
    assert max((got[k].double() - ref[k].double()).abs().max().item() for k in ref) <= 1e-5
    assert not torch.equal(got["frozen_then_trained.weight"], train(0, 1, steps=3).state_dict()[
        "frozen_then_trained.weight"])  # it was trained after unfreezing


def test_sparse_gradients_are_refused_with_the_tensor_name():
    run = run_mpi(SCRIPT, 3, "sparse", servers=1, timeout=60)
    assert run.returncode != 0
    assert "ERROR TypeError" in run.stdout and "'weight'" in run.stdout and "sparse" in run.stdout
