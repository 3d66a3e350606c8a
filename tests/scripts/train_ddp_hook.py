"""Train SmallCNN under torch DDP, with or without imerge_hooks.ps_hook.

Usage: python train_ddp_hook.py OUT [--hook] [--schedule wfbp[,imerge,...]] [--accumulate 2]

With several schedules, each trains a fresh model in turn and OUT names its file with ``{schedule}``;
the schedule ``allreduce`` trains with DDP's own all-reduce (no hook), the reference in the same launch.
A schedule may carry its own variant: ``priority+accumulate2`` (as --accumulate 2) or
``wfbp+fp16`` (as --compression fp16).
"""

import argparse
import contextlib
import copy
import pickle

import torch
from common import batch, key_bytes, loss_fn, make_model, make_optimizer, say, shard

import imerge_hooks as imh

parser = argparse.ArgumentParser()
parser.add_argument("out")
parser.add_argument("--hook", action="store_true")
parser.add_argument("--schedule", default="wfbp")
parser.add_argument("--steps", type=int, default=5)
parser.add_argument("--bucket-cap-mb", type=float, default=0.01, help="small buckets: several per model")
parser.add_argument("--accumulate", type=int, default=1, help="micro-batches per step, using no_sync()")
parser.add_argument("--compression", default="none")
args = parser.parse_args()

imh.init()
rank, world = imh.rank(), imh.size()
say(rank, "AGGREGATE", imh.cluster.session.topology().aggregate_in_host, imh.cluster.session.topology().host)


def train(spec: str, out: str) -> None:
    schedule, _, variant = spec.partition("+")
    if variant and not (variant.startswith("accumulate") or variant in ("fp16", "bf16")):
        raise SystemExit(f"unknown variant {variant!r} of {spec!r}")
    accumulate = int(variant[len("accumulate"):]) if variant.startswith("accumulate") else args.accumulate
    compression = variant if variant in ("fp16", "bf16") else args.compression
    model = make_model()
    ddp = torch.nn.parallel.DistributedDataParallel(model, process_group=imh.worker_group(),
                                                    bucket_cap_mb=args.bucket_cap_mb)
    state = None
    if args.hook and schedule != "allreduce":  # "allreduce": DDP's own all-reduce, the reference
        state = imh.IMergeHookState(schedule=schedule, named_parameters=model.named_parameters(),
                                    compression=compression)
        # A hook state goes into checkpoints and copies, as PowerSGD's does.
        copied = pickle.loads(pickle.dumps(copy.deepcopy(state)))
        assert copied.cfg == state.cfg and copied.comm is state.comm
        settings = state.state_dict()  # what a checkpoint holds: plain data
        again = imh.IMergeHookState(**settings)
        again.load_state_dict(settings)
        assert again.cfg == state.cfg
        ddp.register_comm_hook(state, imh.ps_hook)
    opt = make_optimizer("sgd", model.parameters())
    for step in range(args.steps):
        opt.zero_grad()
        x, y = batch(step)
        x, y = shard(x, rank, world), shard(y, rank, world)
        for micro in range(accumulate):
            last = micro == accumulate - 1
            ctx = contextlib.nullcontext() if last else ddp.no_sync()
            with ctx:
                loss_fn(ddp, shard(x, micro, accumulate), shard(y, micro, accumulate)).div(accumulate).backward()
        opt.step()
    if rank == 0:
        torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, out)
    if state is not None:
        say(rank, "KEYBYTES", spec, *key_bytes(state.engine))
        say(rank, "GROUPS", len(state.engine.groups), "BUCKETS", len(state.signature))
        if state.engine is not None:  # retire its keys before the next schedule registers its own
            state.engine.close()


for schedule in args.schedule.split(","):  # OUT may hold {schedule}
    train(schedule, args.out.format(schedule=schedule))
say(rank, "done")
