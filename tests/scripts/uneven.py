"""Workers with different numbers of batches; each calls imerge_hooks.join() when out of data.

Usage: python uneven.py OUT SCHEDULE N0 N1 [N2 ...]   (Ni = batches of worker i; OUT has {rank})
"""

import sys

import torch
from common import batch, loss_fn, make_model, make_optimizer, say, shard

import imerge_hooks as imh

out, schedule, counts = sys.argv[1], sys.argv[2], [int(c) for c in sys.argv[3:]]
imh.init()
rank, world = imh.rank(), imh.size()
model = make_model()
opt = imh.DistributedOptimizer(make_optimizer("sgd", model.parameters()), named_parameters=model.named_parameters(),
                               schedule=schedule)
for step in range(counts[rank]):
    opt.zero_grad()
    x, y = batch(step)
    loss_fn(model, shard(x, rank, world), shard(y, rank, world)).backward()
    opt.step()
last = imh.join()
torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, out.format(rank=rank))
say(rank, "joined; last to join:", last)
