"""What used to give wrong parameters silently (exit code 0) trains as torch does, or fails naming the cause."""

import re
from pathlib import Path

import pytest
import torch
from common import batch, loss_fn, make_model, make_optimizer
from mpirun import run_mpi
from silent_cases import STEPS

SCRIPTS = Path(__file__).parent / "scripts"
CASES = ["freeze-wfbp", "freeze-imerge", "no-backward-wfbp", "no-backward-imerge", "zero-before-step-default"]


def reference(case: str) -> dict:
    """The same loop, single process, full batch, plain torch."""
    model = make_model()
    opt = make_optimizer("sgd", model.parameters())
    for step in range(STEPS):
        if case.startswith("freeze") and step == 4:
            model.fc1.requires_grad_(False)
        opt.zero_grad()
        if case.startswith("no-backward") and step == 5:
            opt.step()
            continue
        loss_fn(model, *batch(step)).backward()
        if case.startswith("zero-before-step") and step == 5:
            opt.zero_grad()
        opt.step()
    return model.state_dict()


@pytest.fixture(scope="module")
def silent_run(loop_job):
    """The cases run in the launch of ``test_around_loop.py``, after its own (conftest ``loop_job``)."""
    return Path(loop_job["silent_cases"]), loop_job["run"]


@pytest.mark.parametrize("case", CASES)
def test_trains_as_torch(silent_run, case):
    out, _ = silent_run
    got, ref = torch.load(str(out).format(case=case)), reference(case)
    assert max((got[k] - ref[k]).abs().max().item() for k in ref) <= 1e-5, case


def test_frozen_parameter_never_moves(silent_run):
    out, _ = silent_run
    for case in ("freeze-wfbp", "freeze-imerge"):
        got, frozen = torch.load(str(out).format(case=case)), torch.load(str(out).format(case=f"{case}-at-freeze"))
        assert torch.equal(got["fc1.weight"], frozen["fc1.weight"]), case


@pytest.mark.parametrize("case,words", [("order", ["conv1.weight", "conv2.weight", "worker 1", "worker 0"]),
                                        ("shape", ["0.weight", "(4, 8)", "(8, 4)", "worker 1"])])
def test_model_mismatch_names_the_tensor_and_workers(silent_run, case, words):
    _, run = silent_run
    for rank in (0, 1):
        line = next((x for x in run.lines(rank, f"MISMATCH {case}:")), None)
        assert line is not None, run.stdout[-3000:]
        assert all(w in line for w in words), line


def test_worker_that_skips_a_backward_is_named_at_once():
    """At its next push, not at a deadline: IMerge's timeout (600 s) outlasts the launch's, which would kill
    the job and fail the test, and no timeout is what ended it."""
    run = run_mpi(SCRIPTS / "skipped_backward.py", 3, servers=1, timeout=120, env={"IMERGE_TIMEOUT_S": "600"})
    assert run.returncode != 0
    assert "IMergeTimeoutError" not in run.stderr and "timed out" not in run.stderr, run.stderr[-3000:]
    assert "finished without noticing" not in run.stdout
    # Named by the server (each worker pushes) or, with host aggregation (one host here), by a worker of its host.
    assert re.search(r"worker 1 pushed|worker 1 \(host [^)]*\)", run.stderr) and "out of step" in run.stderr, \
        run.stderr[-3000:]
