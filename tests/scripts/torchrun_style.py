"""A script written for torchrun, with IMerge's two lines added: it reads RANK/WORLD_SIZE/LOCAL_RANK
from the environment, initialises torch.distributed itself (env://) when WORLD_SIZE > 1, wraps DDP
and registers the hook. Each worker saves its parameters to OUT/params.<rank>.pt.

Usage: python torchrun_style.py OUT [STEPS]
"""

import os
import sys

import torch
import torch.distributed as dist
from common import batch, loss_fn, make_model, make_optimizer, say, shard

import imerge_hooks as imh

imh.init()  # added line 1 (server ranks serve here and exit)

# What init() exported, against IMerge's own view of the workers-only world.
me = imh.rank()
expected = {"RANK": me, "WORLD_SIZE": imh.size(), "LOCAL_RANK": imh.local_rank(), "LOCAL_WORLD_SIZE": imh.local_size()}
assert all(os.environ[k] == str(v) for k, v in expected.items()), {k: os.environ.get(k) for k in expected}
address, port = imh.cluster.torch_world.master_address_port()
assert (os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"]) == (address, str(port))
say(me, "env", *(f"{k}={os.environ[k]}" for k in imh.cluster.torch_world.TORCH_ENV))

# A value that contradicts the workers-only world (here on worker 1 only) is refused on every worker.
saved = os.environ["WORLD_SIZE"]
if me == 1:
    os.environ["WORLD_SIZE"] = "7"
try:
    imh.cluster.torch_world.export_torch_env()
    say(me, "contradiction accepted")
except imh.IMergeConfigError as exc:
    say(me, "refused", str(exc).replace("\n", " "))
os.environ["WORLD_SIZE"] = saved

# ---------------------------------------------------------------- the torchrun-style script
rank = int(os.environ.get("RANK", 0))
world_size = int(os.environ.get("WORLD_SIZE", 1))
local_rank = int(os.environ.get("LOCAL_RANK", 0))
distributed = world_size > 1
if distributed:
    dist.init_process_group("gloo")  # env://: MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE
say(rank, "distributed", distributed)
group = imh.worker_group()  # IMerge's own group: the script's default group, not a second rendezvous
assert group is dist.group.WORLD and dist.get_world_size(group) == world_size

model = make_model()
ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.01) if distributed else model
if distributed:
    state = imh.IMergeHookState(named_parameters=model.named_parameters())
    ddp.register_comm_hook(state, imh.ps_hook)  # added line 2
    say(rank, "schedule", state.cfg.schedule)
opt = make_optimizer("sgd", ddp.parameters())
steps = int(sys.argv[2]) if len(sys.argv) > 2 else 5
for step in range(steps):
    opt.zero_grad()
    x, y = batch(step)
    loss_fn(ddp, shard(x, rank, world_size), shard(y, rank, world_size)).backward()
    opt.step()
torch.save({k: v.detach().clone() for k, v in model.state_dict().items()},
           os.path.join(sys.argv[1], f"params.{rank}.pt"))
if distributed:
    say(rank, "pushed", sum(len(g.keys) for g in state.engine.groups), "keys", len(state.signature), "buckets")
    dist.destroy_process_group()
say(rank, "done")
