"""Workers with different numbers of batches; each calls imerge_hooks.join() when out of data.

Usage: python uneven.py OUT RUNS N0 N1 [N2 ...]   (Ni = batches of worker i; OUT has {rank}, and {run}
with several runs). RUNS: comma-separated ``SCHEDULE`` or ``SCHEDULE/DIVISOR`` (``join_divisor`` of
that run's optimizer); each run trains a fresh model to its own join() in this one job, as epochs do.
"""

import sys

import torch
from common import batch, loss_fn, make_model, make_optimizer, say, shard

import imerge_hooks as imh

out, runs, counts = sys.argv[1], sys.argv[2].split(","), [int(c) for c in sys.argv[3:]]
imh.init()
rank, world = imh.rank(), imh.size()
for spec in runs:
    schedule, _, divisor = spec.partition("/")
    model = make_model()
    opt = imh.DistributedOptimizer(make_optimizer("sgd", model.parameters()),
                                   named_parameters=model.named_parameters(), schedule=schedule,
                                   **({"join_divisor": divisor} if divisor else {}))
    for step in range(counts[rank]):
        opt.zero_grad()
        x, y = batch(step)
        loss_fn(model, shard(x, rank, world), shard(y, rank, world)).backward()
        opt.step()
    last = imh.join()
    torch.save({k: v.detach().clone() for k, v in model.state_dict().items()},
               out.format(rank=rank, run=spec.replace("/", "-")))
    say(rank, "joined", spec, "; last to join:", last)
    opt._imerge_engine.close()  # retired before the next run's optimizer joins
