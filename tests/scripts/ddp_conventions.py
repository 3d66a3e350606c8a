"""The DDP hook's conventions, each checked on every rank of one launch.

Usage: python ddp_conventions.py world-group DIR | bad-input (launched with IMERGE_SCHEDULE=imerge)
"""

import os
import sys

import torch.distributed as dist
from common import say

import imerge_hooks as imh

mode = sys.argv[1]
if mode == "world-group":
    # torch.distributed over every MPI rank before IMerge starts: refused at once on every rank.
    rank, size = int(os.environ["PMI_RANK"]), int(os.environ["PMI_SIZE"])
    dist.init_process_group("gloo", init_method=f"file://{sys.argv[2]}", rank=rank, world_size=size)
    try:
        imh.IMergeHookState()
    except imh.IMergeUsageError as exc:
        assert "initialised over all 3 ranks" in str(exc) and "worker_group()" in str(exc), exc
        say(rank, "refused")
    dist.destroy_process_group()
else:
    imh.init()
    group = imh.worker_group()
    try:
        imh.IMergeHookState(schedule="fastest")
    except imh.IMergeConfigError as exc:
        assert "unknown schedule 'fastest'" in str(exc) and "imerge" not in str(exc), exc
        say(imh.rank(), "unknown schedule refused")
    sub = dist.new_group([0])
    try:
        imh.IMergeHookState(process_group=sub)
    except imh.IMergeConfigError as exc:
        assert "all 2 workers" in str(exc) and "1 ranks" in str(exc), exc
        say(imh.rank(), "subgroup refused")
    imh.IMergeHookState(process_group=group)  # the worker group is what it expects
    say(imh.rank(), "worker group accepted")
    # The schedule: the argument > IMERGE_SCHEDULE (launched as `imerge`: adaptive-ps here) > wfbp.
    chosen = [imh.IMergeHookState().cfg.schedule, imh.IMergeHookState(schedule="priority").cfg.schedule]
    os.environ["IMERGE_SCHEDULE"] = "default"
    chosen.append(imh.IMergeHookState().cfg.schedule)
    del os.environ["IMERGE_SCHEDULE"]
    chosen.append(imh.IMergeHookState().cfg.schedule)
    say(imh.rank(), "schedules", *chosen)
    try:
        imh.IMergeHookState(schedule="imerge")
    except imh.IMergeConfigError as exc:
        assert "overlaps with the next forward pass" in str(exc), exc
        say(imh.rank(), "imerge by name refused")
