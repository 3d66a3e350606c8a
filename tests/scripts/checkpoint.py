"""Checkpoint on worker 0, resume on all workers: same result as an uninterrupted run.

Usage: python checkpoint.py OUT SCHEDULE FIRST LAST [CKPT_IN] [CKPT_OUT]
Trains steps FIRST..LAST-1 (StepLR every step); loads CKPT_IN first if given (worker 0 reads
it and broadcasts), saves CKPT_OUT on worker 0 at the end if given (mid-training under
overlap_forward: state_dict() flushes the deferred updates).
"""

import sys

import torch
from common import batch, loss_fn, make_model, make_optimizer, say, shard

import imerge_hooks as imh

out, schedule, first, last = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
ckpt_in = sys.argv[5] if len(sys.argv) > 5 and sys.argv[5] != "-" else None
ckpt_out = sys.argv[6] if len(sys.argv) > 6 else None
imh.init()
rank, world = imh.rank(), imh.size()
model = make_model()
opt = imh.DistributedOptimizer(make_optimizer("adam", model.parameters()), named_parameters=model.named_parameters(),
                               schedule=schedule, profile_steps=2)
sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7)  # as common.reference_train
if ckpt_in is not None:
    state = torch.load(ckpt_in) if rank == 0 else None
    state = imh.broadcast_object(state, root_rank=0)
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["optimizer"])
    sched.load_state_dict(state["scheduler"])
imh.broadcast_parameters(model.state_dict(), root_rank=0)
for step in range(first, last):
    opt.zero_grad()
    x, y = batch(step)
    loss_fn(model, shard(x, rank, world), shard(y, rank, world)).backward()
    opt.step()
    sched.step()
if ckpt_out is not None:
    state = {"optimizer": opt.state_dict(), "model": model.state_dict(), "scheduler": sched.state_dict()}
    if rank == 0:
        torch.save(state, ckpt_out)
if rank == 0:
    torch.save({"model": {k: v.clone() for k, v in model.state_dict().items()}, "optimizer": opt.state_dict()}, out)
say(rank, "done")
