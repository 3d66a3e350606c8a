import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent / "scripts"))

from mpirun import cost_model_cache, run_mpi  # noqa: E402


@pytest.fixture
def cost_model_dir() -> Path:
    """One PS cost-model cache for every test of this pytest process (calibration runs once per W, S)."""
    return cost_model_cache()


SCRIPTS = Path(__file__).parent / "scripts"


def cost_model_env() -> dict[str, str]:
    """The shared PS cost-model cache as the jobs below see it."""
    return {"IMERGE_COST_MODEL_PATH": str(cost_model_cache() / "ps-{workers}w-{servers}s-{hosts}.json")}


class Job:
    """One launch's output and worker 0's saved parameters per run."""

    def __init__(self, run, params: dict) -> None:
        self.run, self.params = run, params

    def key_bytes(self, spec: str) -> tuple[int, int]:
        """(bytes on the wire, bytes at the model's precision) of run ``spec``'s keys (worker 0)."""
        for line in self.run.lines(0, "KEYBYTES"):
            name, squeezed, full = line.split()
            if name == spec:
                return int(squeezed), int(full)
        raise AssertionError(f"no KEYBYTES line for {spec}\n{self.run.stdout[-3000:]}")


def optimizer_runs(tmp: Path, workers: int, servers: int, runs: list[str], *args: str, env: dict[str, str],
                   mid: bool = False) -> Job:
    """``scripts/train_optimizer.py`` with ``runs`` (``SPEC`` or ``SPEC@OPTIMIZER``, default SGD) in one
    launch; worker 0's parameters per run (and with ``mid`` the state it saved after ``--state-at``)."""
    out = str(tmp / "{schedule}-{optimizer}.pt")
    run = run_mpi(SCRIPTS / "train_optimizer.py", workers + servers, out, "--schedule", ",".join(runs),
                  "--optimizer", "sgd", *args, servers=servers, env=env, timeout=400).check()
    params = {}
    for spec in runs:
        schedule, _, optimizer = spec.partition("@")
        path = out.format(schedule=schedule, optimizer=optimizer or "sgd")
        params[spec] = torch.load(path)
        if mid:
            params[spec + ".mid"] = torch.load(path + ".mid")
    return Job(run, params)


@pytest.fixture(scope="session")
def optimizer_job(tmp_path_factory) -> Job:
    """2 workers + 1 server, 6 steps, a fresh model per run in one launch (read by several test files).
    DistributedOptimizer with SGD: torch DDP (gloo, the reference), wfbp, wfbp with an unused layer, with
    two backward passes per step, with bf16 on the wire; DDP with ``ps_hook``: wfbp, and wfbp with fp16;
    the planned schedules with SGD and Adam, whose plan epoch changes after 3 profiled steps."""
    runs = ["ddp", "wfbp", "wfbp+unused", "wfbp+passes2", "wfbp+bf16", "wfbp+hook", "wfbp+hook+fp16",
            *(f"{s}@{o}" for s in ("threshold", "mgwfbp", "adaptive-ps") for o in ("sgd", "adam"))]
    env = {**cost_model_env(), "IMERGE_FUSION_THRESHOLD_BYTES": "20000", "IMERGE_PLAN_LOG": "1"}
    return optimizer_runs(tmp_path_factory.mktemp("optimizer-job"), 2, 1, runs, "--steps", "6", "--profile-steps",
                          "3", env=env)


@pytest.fixture(scope="session")
def planned_job(tmp_path_factory) -> Job:
    """3 workers + 2 servers, DistributedOptimizer with every schedule, one launch: StepLR every step,
    6 steps, a plan epoch change after 3 profiled steps, the model and optimizer state after step 4
    (``.mid``), small partitions and credit so the small model still gets several partitions per
    group. Runs are ``SCHEDULE@OPTIMIZER``."""
    runs = [f"{s}@{o}" for s in ("default", "wfbp", "threshold", "mgwfbp", "adaptive-ps") for o in ("sgd", "adam")]
    runs += [f"{s}@{o}" for s in ("priority", "imerge") for o in ("sgd", "adam", "adamw")]
    env = {**cost_model_env(), "IMERGE_PARTITION_BYTES": "8192", "IMERGE_CREDIT_BYTES": "32768",
           "IMERGE_FUSION_THRESHOLD_BYTES": "20000", "IMERGE_PLAN_LOG": "1"}
    return optimizer_runs(tmp_path_factory.mktemp("planned-job"), 3, 2, runs, "--steps", "6", "--profile-steps", "3",
                          "--scheduler", "--state-at", "4", env=env, mid=True)


@pytest.fixture(scope="session")
def loop_job(tmp_path_factory) -> dict:
    """2 workers + 1 server, one launch: the code users write around the loop (``scripts/around_loop.py``),
    then the cases that once trained wrong silently (``silent_cases.py``), the optimizer's lifecycle
    (``lifecycle.py``), a finished group's release (``comm_release.py``) and the comm thread's readiness
    (``device_readiness.py``).
    Returns each script's output pattern by name, and the run as "run"."""
    tmp = tmp_path_factory.mktemp("loop")
    outs = {name: str(tmp / f"{name}-{{case}}.pt") for name in ("around_loop", "silent_cases", "lifecycle")}
    then = [f"{name}={outs[name]}" for name in ("silent_cases", "lifecycle")] + ["comm_release", "device_readiness"]
    env = {**cost_model_env(), "IMERGE_LOG_LEVEL": "info"}
    run = run_mpi(SCRIPTS / "around_loop.py", 3, outs["around_loop"], *then, servers=1, timeout=300, env=env).check()
    return {**outs, "run": run}
