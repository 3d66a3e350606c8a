"""imerge_hooks.join(): workers that run out of data let the others finish their iterations."""

from pathlib import Path

import pytest
import torch
from common import batch, loss_fn, make_model, make_optimizer, shard
from mpirun import run_mpi

SCRIPT = Path(__file__).parent / "scripts" / "uneven.py"


def reference(counts: list[int]) -> dict:
    """Each step averages over the workers that still have data (their shards, equal sizes)."""
    world = len(counts)
    model = make_model()
    opt = make_optimizer("sgd", model.parameters())
    for step in range(max(counts)):
        active = [r for r in range(world) if counts[r] > step]
        x, y = batch(step)
        xs = torch.cat([shard(x, r, world) for r in active])
        ys = torch.cat([shard(y, r, world) for r in active])
        opt.zero_grad()
        loss_fn(model, xs, ys).backward()
        opt.step()
    return model.state_dict()


@pytest.mark.parametrize("schedule", ["wfbp", "priority"])
def test_uneven_batches_average_over_contributors(tmp_path, schedule):
    counts = [5, 3, 4]
    out = tmp_path / "final.pt"
    run = run_mpi(SCRIPT, 5, str(out), schedule, *map(str, counts), servers=2, timeout=120).check()
    ref = reference(counts)
    got = torch.load(out)
    assert max((got[k] - ref[k]).abs().max().item() for k in ref) <= 1e-5
    assert all("last to join: 0" in run.ranks[r] for r in range(3))
