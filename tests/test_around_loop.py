"""Code users write around the loop trains as torch does under the default (overlapped) schedule.

One launch (2 workers + 1 server, shared with ``test_silent_cases.py``) runs every case of
``scripts/around_loop.py``; each is compared with the same loop in one process
(``around_loop.reference``), on every worker.
"""

import json
from pathlib import Path

import pytest
import torch
from around_loop import CASES, COMPILED, STEPS, reference

SCRIPTS = Path(__file__).parent / "scripts"

WORLD = 2
TOL = 1e-5


@pytest.fixture(scope="module")
def around(loop_job):
    """The launch is shared with ``test_silent_cases.py`` (conftest ``loop_job``)."""
    return Path(loop_job["around_loop"]), loop_job["run"]


def _load(out, case, rank):
    return torch.load(str(out).format(case=f"{case}-rank{rank}"))


def _diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


@pytest.mark.parametrize("case", CASES)
def test_every_worker_trains_as_torch(around, case):
    out, _ = around
    ref = reference(case, WORLD)
    for rank in range(WORLD):
        got = _load(out, case, rank)
        assert _diff(got["final"], ref["final"]) <= TOL, (case, rank)


def test_state_dict_right_after_every_step_is_the_stepped_model(around):
    out, _ = around
    ref = reference("checkpoint", WORLD)
    got = _load(out, "checkpoint", 0)
    assert len(got["states"]) == STEPS
    for step, (mine, theirs) in enumerate(zip(got["states"], ref["states"])):
        assert _diff(mine, theirs) <= TOL, f"state_dict() after step {step}"


def test_ema_over_state_dict_and_over_parameters(around):
    out, _ = around
    ref = reference("ema", WORLD)
    got = _load(out, "ema", 0)
    assert _diff(got["ema"], ref["ema"]) <= TOL
    assert _diff(got["ema_parameters"], ref["ema_parameters"]) <= TOL


def test_an_optimizer_that_overrides_step_sees_every_parameter_once_per_step(around):
    out, run = around
    ref = reference("clip-in-step", WORLD)
    got = _load(out, "clip-in-step", 0)
    assert len(got["norms"]) == STEPS
    assert max(abs(a - b) for a, b in zip(got["norms"], ref["norms"])) <= TOL
    assert "ClipInStep overrides step()" in run.stderr


def test_step_hooks_fire_once_per_step_with_every_parameter(around):
    _, run = around
    for rank in range(WORLD):
        hooks = json.loads(run.lines(rank, "HOOKS")[0])
        assert hooks == {"pre": STEPS, "post": STEPS, "global": STEPS, "params_seen": [10]}, hooks


def test_model_zero_grad_after_step_keeps_the_overlap(around):
    """Hugging Face Trainer's order: every used parameter is still updated by the forward's gates."""
    _, run = around
    for rank in range(WORLD):
        applied = json.loads(run.lines(rank, "APPLIED hf-order")[0])
        others = {k: v for k, v in applied.items() if k not in ("forward gates", "step() (no forward gate)")}
        # after the loop, the script's own state_dict() applies the last step's updates: no more than one step's
        assert applied.get("forward gates", 0) > 0 and sum(others.values()) <= 8, applied


# What worker 0 says, once per compile case, about why step() applies its updates at once
COMPILED_REASONS = {
    "compile": "the forward runs a module compiled with torch.compile() or Module.compile()",
    "compile-wrapper": "the forward runs SmallCNN, compiled with torch.compile(module)",
    "compile-block": "the forward runs SmallCNN.fc1, compiled with torch.compile(module)",
    "compile-block-method": "the forward runs SmallCNN.conv2, compiled with Module.compile()",
}


@pytest.mark.parametrize("case", sorted(COMPILED))
def test_compiled_model_is_exact_steps_at_once_and_never_recompiles(around, case):
    """Every way to compile (the model, its wrapper, a block in an eager parent; ``COMPILED``): exactness is
    checked with the other cases; here the overlap's fate is said once and learning leaves no recompile."""
    _, run = around
    said = [line for line in run.stderr.splitlines() if "step() applies the update at once" in line]
    assert sum(COMPILED_REASONS[case] in line for line in said) == 1, said
    for rank in range(WORLD):
        assert json.loads(run.lines(rank, f"APPLIED {case} ")[0]) == {}
        after, end = run.lines(rank, f"COMPILES_AFTER_LEARNING {case} "), run.lines(rank, f"COMPILES_AT_END {case} ")
        assert int(after[0]) > 0 and after == end, (after, end)


def test_overlap_summary_at_shutdown(around):
    _, run = around
    assert "deferred updates" in run.stderr and "applied by the forward's gates" in run.stderr
