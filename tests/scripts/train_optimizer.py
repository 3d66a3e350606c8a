"""Train SmallCNN with imerge_hooks.DistributedOptimizer (or DDP over imerge's worker group).

Usage: python train_optimizer.py OUT --schedule wfbp[,default,...] --optimizer sgd[,adam,...] [--steps 5]
       [--unused] [--passes 2] [--ddp] [--scheduler] [--state-at K] [--compression fp16] [--until-planned]
Every (schedule, optimizer) pair trains a fresh model in this one job (fewer launches; the schedule
``ddp`` is torch DDP over gloo, as --ddp). A schedule may carry its own variant: ``wfbp+unused``
(as --unused), ``wfbp+passes2`` (as --passes 2) or ``wfbp+bf16`` (as --compression bf16) for that run only;
``wfbp+hook`` trains that schedule through DDP with ``imerge_hooks.ps_hook`` (small buckets) instead
(variants combine: ``wfbp+hook+fp16``);
``wfbp@adam`` trains that run with Adam only (not every optimizer of --optimizer);
worker 0 saves the final state_dict to OUT.format(schedule=..., optimizer=...) (OUT itself
when there is one pair), and with --state-at K the model+optimizer state after step K to
that path + ".mid". --until-planned: after --steps, go on stepping (a little slower) while a
background plan search is pending (every worker knows the same), at most 10000 steps; says STEPS n.
"""

import argparse
import time

import torch
from common import batch, key_bytes, loss_fn, make_model, make_optimizer, say, shard

import imerge_hooks as imh

parser = argparse.ArgumentParser()
parser.add_argument("out")
parser.add_argument("--schedule", default="wfbp")
parser.add_argument("--optimizer", default="sgd")
parser.add_argument("--steps", type=int, default=5)
parser.add_argument("--passes", type=int, default=1)
parser.add_argument("--unused", action="store_true")
parser.add_argument("--ddp", action="store_true", help="reference: torch DDP (gloo all-reduce) instead")
parser.add_argument("--scheduler", action="store_true", help="StepLR stepped every iteration")
parser.add_argument("--profile-steps", type=int, default=None)
parser.add_argument("--compression", default=None)
parser.add_argument("--state-at", type=int, default=None, help="save model+optimizer state after this step")
parser.add_argument("--until-planned", action="store_true", help="step on while a background plan search runs")
args = parser.parse_args()

imh.init()
rank, world = imh.rank(), imh.size()
say(rank, "AGGREGATE", imh.cluster.session.topology().aggregate_in_host, imh.cluster.session.topology().host)


def run(spec: str, opt_name: str, out: str) -> None:
    schedule, *variants = spec.split("+")
    unused = args.unused or "unused" in variants
    passes = next((int(v[len("passes"):]) for v in variants if v.startswith("passes")), args.passes)
    compression = next((v for v in variants if v in ("fp16", "bf16")), args.compression)
    unknown = [v for v in variants if not (v in ("unused", "fp16", "bf16", "hook") or v.startswith("passes"))]
    if unknown:
        raise SystemExit(f"unknown variant(s) {unknown} of {spec!r}")
    model = make_model(unused)
    ddp = args.ddp or schedule == "ddp" or "hook" in variants
    hook = None
    if ddp:
        net = torch.nn.parallel.DistributedDataParallel(model, process_group=imh.worker_group(),
                                                        bucket_cap_mb=0.01 if "hook" in variants else 25)
        opt = make_optimizer(opt_name, model.parameters())
        if "hook" in variants:
            hook = imh.IMergeHookState(schedule=schedule, named_parameters=model.named_parameters(),
                                       compression=compression or "none")
            net.register_comm_hook(hook, imh.ps_hook)
    else:
        net = model
        opt = imh.DistributedOptimizer(make_optimizer(opt_name, model.parameters()),
                                       named_parameters=model.named_parameters(), schedule=schedule,
                                       backward_passes_per_step=passes, profile_steps=args.profile_steps,
                                       compression=compression)
        imh.broadcast_parameters(model.state_dict(), root_rank=0)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7) if args.scheduler else None
    step = 0
    # --until-planned: every worker sees the same pending flag and counts the same steps, so all stop
    # at the same step (a cap in seconds would differ from worker to worker)
    while step < args.steps or (args.until_planned and opt._imerge_engine.replanner.pending and step < 10000):
        if step >= args.steps:
            time.sleep(0.02)
        opt.zero_grad()
        x, y = batch(step)
        x, y = shard(x, rank, world), shard(y, rank, world)
        for p in range(passes):
            loss = loss_fn(net, shard(x, p, passes), shard(y, p, passes)).div(passes)
            loss.backward()
        opt.step()
        if sched:
            sched.step()
        if args.state_at == step + 1:
            snapshot = {"optimizer": opt.state_dict(), "model": {k: v.clone() for k, v in model.state_dict().items()}}
            if rank == 0:
                torch.save(snapshot, out + ".mid")
        step += 1
    if rank == 0:
        torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, out)
    if not ddp:
        say(rank, "KEYBYTES", spec, *key_bytes(opt._imerge_engine))
    if hook is not None and hook.engine is not None:  # retire its keys before the next run registers its own
        say(rank, "KEYBYTES", spec, *key_bytes(hook.engine))
        hook.engine.close()
    say(rank, "STEPS", step)
    say(rank, "done", spec, opt_name)


# ``SPEC@OPTIMIZER`` trains that run with that optimizer only, instead of every one of --optimizer
pairs = [(s.partition("@")[0], o) for s in args.schedule.split(",")
         for o in ([s.partition("@")[2]] if "@" in s else args.optimizer.split(","))]
for schedule, opt_name in pairs:
    run(schedule, opt_name, args.out.format(schedule=schedule, optimizer=opt_name) if len(pairs) > 1 else args.out)
