"""Bad input gets a clear exception that says what is wrong and where; nothing hangs."""

from pathlib import Path

import pytest
from mpirun import run_mpi

SCRIPT = Path(__file__).parent / "scripts" / "bad_input.py"


def errors(run) -> str:
    return "\n".join(line for line in run.stdout.splitlines() if "ERROR" in line)


def test_num_servers_not_below_world_size():
    run = run_mpi(SCRIPT, 2, "too_many_servers", timeout=60)
    assert run.returncode != 0
    assert "num_servers=2" in errors(run) and "only 2 rank(s)" in errors(run)


def test_workers_without_servers_explains_env_var():
    run = run_mpi(SCRIPT, 2, "mismatch", servers=0, timeout=60)
    assert run.returncode != 0
    assert "IMERGE_NUM_SERVERS" in errors(run)


def test_mismatched_models_name_tensor_worker_and_server():
    run = run_mpi(SCRIPT, 3, "mismatch", servers=1, timeout=60)
    assert run.returncode != 0
    text = errors(run)
    assert "IMergeMismatchError" in text
    assert "worker 1" in text and "server 0" in text and "0.weight" in text and "(9, 4)" in text and "(8, 4)" in text
    assert text.count("IMergeMismatchError") == 2  # both workers are told, neither waits forever


@pytest.fixture(scope="module")
def local_refusals():
    """Misuse a worker's own checks refuse (no other rank involved): the cases share one job."""
    return run_mpi(SCRIPT, 2, "int_param,zero_grad_in_flight,dtype_change", servers=1, timeout=60)


def case_lines(run, case: str) -> str:
    return "\n".join(line for line in run.stdout.splitlines() if line.startswith(f"@0 {case} "))


def test_non_floating_tensor_is_refused_with_its_name(local_refusals):
    assert local_refusals.returncode != 0
    text = case_lines(local_refusals, "int_param")
    assert "ERROR" in text and "'counts'" in text and "torch.int64" in text and "worker 0" in text


def test_zero_grad_while_pushing_is_refused(local_refusals):
    text = case_lines(local_refusals, "zero_grad_in_flight")
    # Either the push already finished (then zero_grad is legal) or the user is told what to do.
    assert "NO ERROR" in text or "zero_grad() called while gradients are being pushed" in text, \
        local_refusals.stdout[-3000:]


def test_a_parameter_converted_after_wrapping_is_named(local_refusals):
    """``model.double()`` after ``DistributedOptimizer``: an IMerge error naming the parameter, not
    torch's autograd dtype error from inside the engine."""
    text = case_lines(local_refusals, "dtype_change")
    assert "ERROR IMergeUsageError" in text and "'1.bias' changed from torch.float32 on cpu to torch.float64" in text, \
        local_refusals.stdout[-3000:]
    assert "Convert the model first" in text
