"""imerge_hooks.join(): every worker calls it when out of data; the others finish their iterations."""

from pathlib import Path

import torch
from common import batch, loss_fn, make_model, make_optimizer, shard
from mpirun import run_mpi

SCRIPT = Path(__file__).parent / "scripts" / "uneven.py"


def reference(counts: list[int], divisor: str) -> dict:
    """Each step sums the shard losses of the workers that still have data, divided by all workers
    (``divisor="workers"``, as Horovod and DDP's Join) or by the active ones."""
    world = len(counts)
    model = make_model()
    opt = make_optimizer("sgd", model.parameters())
    for step in range(max(counts)):
        active = [r for r in range(world) if counts[r] > step]
        x, y = batch(step)
        opt.zero_grad()
        loss = sum(loss_fn(model, shard(x, r, world), shard(y, r, world)) for r in active)
        (loss / (world if divisor == "workers" else len(active))).backward()
        opt.step()
    return model.state_dict()


def test_uneven_batches_then_every_worker_holds_the_last_joiners_model(tmp_path):
    """Two runs in one job, each ending in its own join() (as epochs do): wfbp dividing by every
    worker (Horovod's and DDP's Join), then priority dividing by the workers that trained."""
    counts = [5, 3, 4]
    out = tmp_path / "final-{run}-{rank}.pt"
    runs = [("wfbp", "workers"), ("priority", "active")]
    run = run_mpi(SCRIPT, 5, str(out), ",".join(f"{s}/{d}" for s, d in runs), *map(str, counts), servers=2,
                  timeout=150).check()
    for schedule, divisor in runs:
        ref = reference(counts, divisor)
        for rank in range(3):
            got = torch.load(str(out).format(run=f"{schedule}-{divisor}", rank=rank))
            assert max((got[k] - ref[k]).abs().max().item() for k in ref) <= 1e-5, (schedule, rank)
        assert all(f"joined {schedule}/{divisor} ; last to join: 0" in run.ranks[r] for r in range(3))


def test_plan_change_during_join_raises_at_once(tmp_path, cost_model_dir):
    """Worker 1 joins after 2 steps; worker 0's plan change at step 3 cannot happen without it: the job
    ends at once (timeout_s, 600 s, outlasts the launch's, which would kill the job and fail the test)."""
    run = run_mpi(SCRIPT, 3, str(tmp_path / "final-{rank}.pt"), "adaptive-ps", "6", "2", servers=1, timeout=120,
                  env={"IMERGE_PROFILE_STEPS": "3", "IMERGE_TIMEOUT_S": "600",
                       "IMERGE_COST_MODEL_PATH": str(cost_model_dir / "ps-{workers}w-{servers}s-{hosts}.json")})
    assert run.returncode != 0
    assert "waits in join()" in run.stderr and "IMerge worker 1" in run.stderr, run.stderr[-3000:]
