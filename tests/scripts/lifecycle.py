"""The optimizer's public lifecycle: LR scheduler built before wrapping, close() / with-block,
set_backward_passes_per_step(). Usage: python lifecycle.py OUT (OUT has {case}; W=2 workers)."""

import sys

import torch
from common import batch, case, loss_fn, make_model, make_optimizer, say, shard

import imerge_hooks as imh

STEPS = 4


def scheduler_before_wrapping(out: str) -> None:
    """Lightning and many scripts build the scheduler first: IMerge must still average."""
    rank, world = imh.rank(), imh.size()
    model = make_model()
    opt = make_optimizer("sgd", model.parameters())
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7)
    with imh.DistributedOptimizer(opt, named_parameters=model.named_parameters(), schedule="wfbp") as opt:
        for step in range(STEPS):
            opt.zero_grad()
            x, y = batch(step)
            loss_fn(model, shard(x, rank, world), shard(y, rank, world)).backward()
            opt.step()
            sched.step()
    say(rank, "after close:", type(opt).__name__, type(opt).__mro__[1].__name__)
    if rank == 0:
        torch.save(model.state_dict(), out.format(case="scheduler"))


def accumulation(out: str) -> None:
    rank, world = imh.rank(), imh.size()
    model = make_model()
    opt = imh.DistributedOptimizer(make_optimizer("sgd", model.parameters()),
                                   named_parameters=model.named_parameters(), schedule="wfbp")
    opt.set_backward_passes_per_step(2)
    for step in range(STEPS):
        opt.zero_grad()
        x, y = batch(step)
        xs, ys = shard(x, rank, world), shard(y, rank, world)
        for p in range(2):
            loss_fn(model, shard(xs, p, 2), shard(ys, p, 2)).div(2).backward()
        opt.step()
    opt.close()
    if rank == 0:
        torch.save(model.state_dict(), out.format(case="accumulation"))


def run_all(out: str) -> None:
    with case(imh.rank(), "lifecycle:scheduler-before-wrapping"):
        scheduler_before_wrapping(out)
    with case(imh.rank(), "lifecycle:accumulation"):
        accumulation(out)
    say(imh.rank(), "DONE")


if __name__ == "__main__":
    imh.init()
    run_all(sys.argv[1])
