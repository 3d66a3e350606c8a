"""DistributedOptimizer gives the same parameters as single-process training on the full batch."""

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


def train(tmp_path, workers, servers, *args, timeout=120):
    out = tmp_path / "final.pt"
    run_mpi(SCRIPT, workers + servers, str(out), *args, servers=servers, timeout=timeout).check()
    return torch.load(out)


@pytest.mark.parametrize("workers,servers", [(1, 1)])  # 3 + 2: planned_job below; more cells: the model zoo
def test_sgd_and_adam_match_full_batch(tmp_path, workers, servers):
    out = tmp_path / "{schedule}-{optimizer}.pt"
    run_mpi(SCRIPT, workers + servers, str(out), "--schedule", "default,wfbp", "--optimizer", "sgd,adam",
            servers=servers, timeout=180).check()
    for schedule in ("default", "wfbp"):
        for opt in ("sgd", "adam"):
            got = torch.load(str(out).format(schedule=schedule, optimizer=opt))
            assert max_diff(got, reference_train(opt, 5)) <= TOL, (opt, schedule, workers, servers)


def test_single_process_without_servers(tmp_path):
    got = train(tmp_path, 1, 0, "--schedule", "wfbp", "--optimizer", "adam")
    assert max_diff(got, reference_train("adam", 5)) <= TOL


def test_matches_torch_ddp(optimizer_job):
    ddp, ours = optimizer_job.params["ddp"], optimizer_job.params["wfbp"]
    assert max_diff(ddp, ours) <= TOL
    assert max_diff(ddp, reference_train("sgd", 6)) <= TOL


def test_unused_parameter(optimizer_job):
    got = optimizer_job.params["wfbp+unused"]
    ref = reference_train("sgd", 6, unused=True)
    assert max_diff(got, ref) <= TOL
    # The unused layer never moved (weight decay would have moved it had it been stepped).
    assert torch.equal(got["spare.weight"], reference_train("sgd", 0, unused=True)["spare.weight"])


def test_backward_passes_per_step(optimizer_job):
    got = optimizer_job.params["wfbp+passes2"]
    assert max_diff(got, reference_train("sgd", 6, passes=1)) <= TOL


def test_sgd_and_adam_match_full_batch_on_three_workers_two_servers(planned_job):
    """3 workers + 2 servers (conftest ``planned_job``: StepLR every step)."""
    for schedule in ("default", "wfbp"):
        for opt in ("sgd", "adam"):
            got = planned_job.params[f"{schedule}@{opt}"]
            assert max_diff(got, reference_train(opt, 6, scheduler=True)) <= TOL, (opt, schedule)


def test_planned_schedules_match_full_batch_across_plan_change(optimizer_job):
    """2 workers + 1 server, profile_steps=3: iterations 0-2 use one tensor per group, then the plan
    epoch changes (conftest ``optimizer_job``; 3 workers + 2 servers: the next test)."""
    for schedule in ("threshold", "mgwfbp", "adaptive-ps"):
        assert f"IMerge plan ({'optimal' if schedule == 'adaptive-ps' else schedule}" in optimizer_job.run.stdout
        for opt in ("sgd", "adam"):
            got = optimizer_job.params[f"{schedule}@{opt}"]
            assert max_diff(got, reference_train(opt, 6)) <= TOL, (schedule, opt)


def test_planned_schedules_on_three_workers_two_servers(planned_job):
    """The same after the plan epoch change, 3 workers + 2 servers, with StepLR (conftest ``planned_job``)."""
    for schedule in ("threshold", "mgwfbp", "adaptive-ps"):
        assert f"IMerge plan ({'optimal' if schedule == 'adaptive-ps' else schedule}" in planned_job.run.stdout
        for opt in ("sgd", "adam"):
            got = planned_job.params[f"{schedule}@{opt}"]
            assert max_diff(got, reference_train(opt, 6, scheduler=True)) <= TOL, (schedule, opt)


def test_plan_from_a_background_search_is_installed_as_a_later_epoch(tmp_path, cost_model_dir):
    """A zero CPU budget: the DP's plan is installed after profiling while the search runs in a
    background process; its plan comes at a later iteration boundary on every worker, and training
    across both plan changes matches full-batch training."""
    out = tmp_path / "final.pt"
    env = {"IMERGE_COST_MODEL_PATH": str(cost_model_dir / "ps-{workers}w-{servers}s-{hosts}.json"),
           "IMERGE_PLAN_LOG": "1", "IMERGE_PLAN_CACHE": "0", "IMERGE_PLAN_SEARCH_BUDGET_S": "0"}
    run = run_mpi(SCRIPT, 4, str(out), "--schedule", "imerge", "--optimizer", "adam", "--steps", "6",
                  "--profile-steps", "3", "--until-planned", servers=2, env=env, timeout=300).check()
    interim = run.stdout.index("the DP's plan, while the search runs in the background")
    assert run.stdout.index("chosen by simulation") > interim, run.stdout[-3000:]
    steps = {int(line.split()[-1]) for line in run.stdout.splitlines() if " STEPS " in line}
    assert len(steps) == 1 and 6 <= steps.pop() < 10000, run.stdout[-3000:]
    final = int([line for line in run.stdout.splitlines() if "@0 STEPS" in line][0].split()[-1])
    assert max_diff(torch.load(out), reference_train("adam", final)) <= TOL
