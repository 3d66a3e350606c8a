"""imerge_hooks.join(): every worker calls it when out of data; the others finish their iterations."""

import time
from pathlib import Path

import pytest
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


@pytest.mark.parametrize("schedule,divisor", [("wfbp", "workers"), ("priority", "active")])
def test_uneven_batches_then_every_worker_holds_the_last_joiners_model(tmp_path, schedule, divisor):
    counts = [5, 3, 4]
    out = tmp_path / "final-{rank}.pt"
    run = run_mpi(SCRIPT, 5, str(out), schedule, *map(str, counts), servers=2, timeout=120,
                  env={"IMERGE_JOIN_DIVISOR": divisor}).check()
    ref = reference(counts, divisor)
    for rank in range(3):
        got = torch.load(str(out).format(rank=rank))
        assert max((got[k] - ref[k]).abs().max().item() for k in ref) <= 1e-5, rank
    assert all("last to join: 0" in run.ranks[r] for r in range(3))


def test_plan_change_during_join_raises_at_once(tmp_path, cost_model_dir):
    """Worker 1 joins after 2 steps; worker 0's plan change at step 3 cannot happen without it."""
    start = time.monotonic()
    run = run_mpi(SCRIPT, 3, str(tmp_path / "final-{rank}.pt"), "adaptive-ps", "6", "2", servers=1, timeout=120,
                  env={"IMERGE_PROFILE_STEPS": "3", "IMERGE_TIMEOUT_S": "600",
                       "IMERGE_COST_MODEL_PATH": str(cost_model_dir / "ps-{workers}w-{servers}s-{hosts}.json")})
    elapsed = time.monotonic() - start
    assert run.returncode != 0
    assert "waits in join()" in run.stderr and "IMerge worker 1" in run.stderr, run.stderr[-3000:]
    assert elapsed < 60, elapsed
