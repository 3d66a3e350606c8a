"""The tensor collectives' device path on GPUs: CUDA tensors move over the workers' NCCL group, not through
the host, with the host path's results. One worker per GPU (NCCL refuses workers that share one), so it
needs 2 GPUs: skipped where CUDA is absent or only one GPU is visible. ``make gpu-check`` runs it.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from mpirun import run_mpi

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(),
                       reason="no CUDA device here: the GPU suite runs where a GPU is (make gpu-check)"),
    pytest.mark.skipif(torch.cuda.device_count() < 2,
                       reason="needs 2 GPUs: one worker per GPU, so that the workers' group runs NCCL"),
]

SCRIPT = Path(__file__).parent / "scripts" / "nccl_collectives.py"
CASES = 45  # the cases of tests/scripts/device_path_cases.py


def test_cuda_tensors_move_on_nccl_with_the_host_paths_results():
    """Every op's result on the device path equals the host path's (values, dtype, shape, device) with no
    tensor staged through the host; int16 reductions, an allreduce while a worker waits in join() and one a
    worker does not offer on the device stay on the host path."""
    run = run_mpi(SCRIPT, 3, servers=1, timeout=300).check()
    assert "FAIL" not in run.stdout, run.stdout[-6000:]
    for rank in range(2):
        assert run.lines(rank, "ALL OK") == ["2"], run.stdout[-6000:] + run.stderr[-3000:]
        passed = run.lines(rank, "PASS")
        assert len(passed) == CASES + 3 and {"decision", "join", "mixed offers"} <= set(passed), passed
