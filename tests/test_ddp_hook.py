"""The DDP comm hook gives the same parameters as DDP's own all-reduce."""

from pathlib import Path

import pytest
import torch
from common import reference_train
from mpirun import run_mpi

SCRIPT = Path(__file__).parent / "scripts" / "train_ddp_hook.py"
CONVENTIONS = Path(__file__).parent / "scripts" / "ddp_conventions.py"
TOL = 1e-5


def max_diff(a: dict, b: dict) -> float:
    return max((a[k] - b[k]).abs().max().item() for k in a)


def test_hook_matches_ddp_allreduce(optimizer_job):
    """2 workers + 1 server (conftest ``optimizer_job``; 2 servers: the planned fusion test below)."""
    ref, ours = optimizer_job.params["ddp"], optimizer_job.params["wfbp+hook"]
    assert max_diff(ours, ref) <= TOL
    assert max_diff(ours, reference_train("sgd", 6)) <= TOL


@pytest.fixture(scope="module")
def two_workers_two_servers(tmp_path_factory):
    """One job of 2 workers + 2 servers, a fresh model per run: both planned kinds (after profiling,
    adjacent DDP buckets are merged: a plan epoch change), then priority with no_sync() accumulation."""
    tmp = tmp_path_factory.mktemp("two-two")
    out = tmp / "hook-{schedule}.pt"
    env = {"IMERGE_PROFILE_STEPS": "3", "IMERGE_FUSION_THRESHOLD_BYTES": "10000000", "IMERGE_LOG_LEVEL": "INFO",
           "IMERGE_COST_MODEL_PATH": str(tmp / "ps-{workers}w-{servers}s-{hosts}.json")}
    runs = ("threshold", "adaptive-ps", "priority+accumulate2")
    run = run_mpi(SCRIPT, 4, str(out), "--hook", "--schedule", ",".join(runs), "--steps", "7", servers=2,
                  env=env, timeout=240).check()
    return run, {r: torch.load(str(out).format(schedule=r)) for r in runs}


def test_hook_with_no_sync_accumulation_and_priority(two_workers_two_servers):
    _, params = two_workers_two_servers
    assert max_diff(params["priority+accumulate2"], reference_train("sgd", 7)) <= TOL


def test_planned_fusion_of_ddp_buckets(two_workers_two_servers):
    run, params = two_workers_two_servers
    for method in ("threshold", "optimal"):
        assert f"IMerge: {method} plan with " in run.stderr and " installed as plan epoch " in run.stderr, method
    layouts = [line.split() for line in run.lines(0, "GROUPS")]
    assert len(layouts) == 3
    groups, _, buckets = layouts[0]  # threshold above the model's bytes: every bucket in one group
    assert int(groups) == 1 < int(buckets)
    for schedule in ("threshold", "adaptive-ps"):
        assert max_diff(params[schedule], reference_train("sgd", 7)) <= TOL, schedule
def test_hook_refuses_torch_distributed_over_every_rank(tmp_path):
    """DDP initialised over all ranks, then IMerge started: the last rank would become a server and
    the workers would hang in DDP's collectives; every rank is told at once instead."""
    run = run_mpi(CONVENTIONS, 3, "world-group", str(tmp_path / "rendezvous"), servers=1, timeout=60).check()
    assert all(run.lines(r, "refused") == [""] for r in range(3))


def test_hook_names_its_schedules_and_checks_the_process_group():
    """Also: the schedule's precedence (argument > IMERGE_SCHEDULE > wfbp; a job-wide `imerge` runs
    as adaptive-ps, said once), and a job whose workers never used IMerge is named by server 0."""
    run = run_mpi(CONVENTIONS, 3, "bad-input", servers=1, timeout=60, env={"IMERGE_SCHEDULE": "imerge"}).check()
    for r in range(2):
        assert run.lines(r, "unknown schedule refused") and run.lines(r, "subgroup refused")
        assert run.lines(r, "worker group accepted")
        assert run.lines(r, "schedules") == ["adaptive-ps priority default wfbp"]
        assert run.lines(r, "imerge by name refused")
    assert run.stderr.count("IMERGE_SCHEDULE is 'imerge', which overlaps") == 1, run.stderr
    assert run.stderr.count("none ever pushed a gradient to the servers") == 1, run.stderr


TORCHRUN_STYLE = Path(__file__).parent / "scripts" / "torchrun_style.py"


def test_torchrun_style_script_trains_distributed(tmp_path):
    """A script that decides on distributed mode from RANK/WORLD_SIZE and calls
    init_process_group("gloo") itself: init() exported the workers-only world, worker_group()
    reuses the script's group, the hook trains exactly, and a contradicting value is refused."""
    run = run_mpi(TORCHRUN_STYLE, 3, str(tmp_path), servers=1, timeout=60).check()
    for r in range(2):
        env = dict(kv.split("=", 1) for kv in run.lines(r, "env")[0].split())
        assert [env[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")] == [str(r), "2", str(r), "2"]
        assert env["MASTER_ADDR"] == "127.0.0.1" and int(env["MASTER_PORT"]) > 0
        refused = run.lines(r, "refused")
        assert refused and "worker 1: WORLD_SIZE='7' (expected '2')" in refused[0], run.stdout
        assert run.lines(r, "distributed") == ["True"] and run.lines(r, "schedule") == ["wfbp"]
        assert run.lines(r, "pushed")[0].split()[0] != "0"
    assert "none ever pushed a gradient" not in run.stderr
    params = [torch.load(tmp_path / f"params.{r}.pt") for r in range(2)]
    assert max_diff(params[0], params[1]) == 0.0
    assert max_diff(params[0], reference_train("sgd", 5)) <= TOL
