"""Train zoo cells (model, schedule, optimizer) with imerge_hooks.DistributedOptimizer, one launch for many.

Usage: python zoo_train.py OUT --matrix w2|w3 [--cells ID,ID,...]

Each cell trains a fresh model with a fresh DistributedOptimizer on this worker's shard of
every step's batch; worker 0 writes OUT/<cell>.pt (the final state_dict) and every worker says
"checksum <cell> <value>". A cell that raises on any worker is abandoned on all of them (the
workers agree after each backward and each step): each failing worker writes
OUT/<cell>.err.<rank> and the launch goes on with the next cell.
"""

from __future__ import annotations

import argparse
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from common import say
from mpi4py import MPI
from zoo_models import (
    MATRICES,
    MODELS,
    Batch,
    Cell,
    ModelSpec,
    build,
    loss_of,
    make_optimizer,
    make_scheduler,
    optimized_parameters,
    shard,
)

import imerge_hooks as imh

imh.init()
RANK, WORLD = imh.rank(), imh.size()
WORKERS = imh.cluster.session.topology().worker_comm


class CellFailed(Exception):
    """Some worker raised in this cell."""


def agree(action: Callable[..., None], errors: list[str], *args: Any) -> None:
    """Run ``action(*args)`` here; raise CellFailed on every worker if it raised on any."""
    ok = 1
    try:
        action(*args)
    except Exception:
        errors.append(traceback.format_exc())
        ok = 0
    if WORKERS.allreduce(ok, op=MPI.MIN) == 0:
        raise CellFailed


def forward_backward(spec: ModelSpec, model: torch.nn.Module, opt: torch.optim.Optimizer, step: int,
                     batch: Batch) -> None:
    """One step's forward and backward on this worker's shard (after the model's own per-step change)."""
    if spec.on_step:
        spec.on_step(model, step)
    opt.zero_grad()
    loss_of(model, batch).backward()


def update(opt: torch.optim.Optimizer, sched: Any, deferred: list[bool]) -> None:
    """Step; record whether the update was left to the next forward (the overlap)."""
    opt.step()
    deferred.append(opt._imerge_engine.deferred is not None)
    if sched:
        sched.step()


def checksum(model: torch.nn.Module) -> str:
    return f"{sum(v.double().abs().sum().item() for v in model.state_dict().values()):.12f}"


def train_cell(cell: Cell, out: Path, errors: list[str]) -> None:
    spec = MODELS[cell.model]
    model = build(cell.model)
    opt = imh.DistributedOptimizer(make_optimizer(cell.optimizer, optimized_parameters(cell.model, model)),
                                   named_parameters=model.named_parameters(), schedule=cell.schedule)
    sched = make_scheduler(cell.optimizer, opt)
    imh.broadcast_parameters(model.state_dict(), root_rank=0)
    engine = opt._imerge_engine
    deferred: list[bool] = []  # per step: step() left its update to the next forward
    try:
        for step in range(spec.steps):
            agree(forward_backward, errors, spec, model, opt, step, shard(spec.batch(step), RANK, WORLD))
            agree(update, errors, opt, sched, deferred)
        state = {k: v.detach().clone() for k, v in model.state_dict().items()}  # flushes deferred updates
        if RANK == 0:
            torch.save(state, out / f"{cell.id}.pt")
        say(RANK, "checksum", cell.id, checksum(model))
        planned = engine.replanner is not None and engine.replanner.plan is not None
        say(RANK, "cell-info", cell.id, f"planned={planned}", f"deferred={sum(deferred)}", f"epoch={engine.epoch}")
    except CellFailed:
        # Finish the round on every worker (missing gradients go as zeros) so the servers stay in step.
        engine.synchronize()
        raise
    finally:
        engine.close()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--matrix", default="w2", choices=sorted(MATRICES))
    parser.add_argument("--cells", default=None, help="only these cell ids")
    args = parser.parse_args()
    out = Path(args.out)
    cells = MATRICES[args.matrix]
    if args.cells:
        cells = [c for c in cells if c.id in args.cells.split(",")]
    for cell in cells:
        errors: list[str] = []
        start = time.monotonic()
        try:
            train_cell(cell, out, errors)
            say(RANK, "cell-ok", cell.id, f"{time.monotonic() - start:.1f}s")
        except CellFailed:
            if errors:
                (out / f"{cell.id}.err.{RANK}").write_text(errors[0])
            say(RANK, "cell-failed", cell.id)
    say(RANK, "done")


main()
