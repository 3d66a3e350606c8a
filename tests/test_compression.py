"""fp16 / bf16 compression halves the bytes on the wire and stays close to the exact run."""

from pathlib import Path

import pytest
import torch
from common import reference_train
from mpirun import run_mpi

SCRIPT = Path(__file__).parent / "scripts" / "train_optimizer.py"
HOOK_SCRIPT = Path(__file__).parent / "scripts" / "train_ddp_hook.py"


@pytest.mark.parametrize("compression,bound", [("bf16", 2e-2)])  # fp16: the DDP hook test below
def test_compression_halves_wire_bytes_and_bounds_the_error(tmp_path, compression, bound):
    out = tmp_path / "final.pt"
    run = run_mpi(SCRIPT, 3, str(out), "--schedule", "wfbp", "--compression", compression, servers=1,
                  timeout=120).check()
    # the same keys at the model's precision: what uncompressed runs send (every exactness test checks them)
    squeezed, full = map(int, run.lines(0, "KEYBYTES")[0].split())
    # The test model is float64: 16-bit wire formats carry a quarter of its bytes.
    assert squeezed * 4 == full
    ref = reference_train("sgd", 5)
    got = torch.load(out)
    diff = max((got[k] - ref[k]).abs().max().item() for k in ref)
    assert 0 < diff <= bound  # numerics change, by a bounded amount


def test_ddp_hook_compresses_with_the_same_bound(tmp_path):
    out = tmp_path / "hook.pt"
    run = run_mpi(HOOK_SCRIPT, 3, str(out), "--hook", "--compression", "fp16", servers=1, timeout=120).check()
    squeezed, full = map(int, run.lines(0, "KEYBYTES")[0].split())
    assert squeezed * 4 == full
    ref = reference_train("sgd", 5)
    got = torch.load(out)
    diff = max((got[k] - ref[k]).abs().max().item() for k in ref)
    assert 0 < diff <= 2e-3
