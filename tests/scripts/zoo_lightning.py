"""Zoo models through ``Trainer(strategy="imerge")``: automatic and manual optimization, one launch.

Usage: python zoo_lightning.py OUT [--runs ID[:SCHEDULE],...] [--schedules S,S,...]

Each run (see zoo_models.LIGHTNING_RUNS) fits a fresh LightningModule around a zoo model for one epoch of the
model's steps; worker r's loader yields its contiguous shard of each step's full batch (no
distributed sampler), so the run must match ``zoo_models.reference_train``. The schedule
comes from IMERGE_SCHEDULE (default ``imerge``); with ``--schedules`` every run fits once per
schedule, named ``<run>-<schedule>``, and ``ID:SCHEDULE`` fits one run with one schedule, named so
too. Worker 0 writes OUT/<name>.pt (the zoo model's state_dict); a worker whose fit raised writes
OUT/<name>.err.<rank>.
"""

from __future__ import annotations

import argparse
import traceback
from pathlib import Path

import pytorch_lightning as pl
import torch
from common import say
from mpi4py import MPI
from torch.utils.data import DataLoader, TensorDataset
from zoo_models import (
    LIGHTNING_RUNS,
    MODELS,
    build,
    cross_entropy,
    make_optimizer,
    make_scheduler,
    optimized_parameters,
    shard,
)

import imerge_hooks
import lightning_plugin  # noqa: F401  (registers strategy "imerge")

WORLD_RANK = MPI.COMM_WORLD.Get_rank()


class DeferralCounter(pl.Callback):
    """Counts the steps whose update was left to the next forward (the overlap was active)."""

    def __init__(self) -> None:
        self.deferred = 0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        engine = trainer.strategy.optimizers[0]._imerge_engine
        self.deferred += engine.deferred is not None


class ZooModule(pl.LightningModule):
    """A zoo model with the zoo's loss and optimizer; manual optimization steps it by hand."""

    def __init__(self, model: str, optimizer: str, manual: bool) -> None:
        super().__init__()
        self.model_name, self.optimizer_name = model, optimizer
        self.automatic_optimization = not manual
        self.net = build(model)

    def training_step(self, batch, batch_idx):
        *inputs, target = batch
        loss = cross_entropy(self.net(*inputs), target)
        if self.automatic_optimization:
            return loss
        opt = self.optimizers()
        opt.zero_grad()
        self.manual_backward(loss)
        opt.step()
        sched = self.lr_schedulers()
        if sched is not None:
            sched.step()
        return None

    def configure_optimizers(self):
        opt = make_optimizer(self.optimizer_name, optimized_parameters(self.model_name, self.net))
        sched = make_scheduler(self.optimizer_name, opt)
        if sched is None:
            return opt
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def worker_loader(t: pl.Trainer, model: str) -> DataLoader:
    """This worker's shard of every step's batch, one step per loader batch (IMerge starts at the
    first fit, so before it the strategy tells the role)."""
    rank, world = (0, 1) if t.strategy.is_server else (t.global_rank, t.world_size)
    spec = MODELS[model]
    shards = [shard(spec.batch(step), rank, world) for step in range(spec.steps)]
    columns = [torch.cat([s[0][i] for s in shards]) for i in range(len(shards[0][0]))]
    target = torch.cat([s[1] for s in shards])
    return DataLoader(TensorDataset(*columns, target), batch_size=shards[0][1].shape[0], shuffle=False)


def trainer(counter: DeferralCounter, schedule: str | None) -> pl.Trainer:
    strategy = "imerge" if schedule is None else lightning_plugin.IMergeStrategy(schedule=schedule)
    return pl.Trainer(strategy=strategy, accelerator="cpu", devices=1, max_epochs=1, logger=False, callbacks=[counter],
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      num_sanity_val_steps=0, use_distributed_sampler=False)


def fit(run: str, out: Path, schedule: str | None = None) -> None:
    model_name, opt_name, manual = LIGHTNING_RUNS[run]
    counter = DeferralCounter()
    t = trainer(counter, schedule)
    if schedule is not None:
        run = f"{run}-{schedule}"
    module = ZooModule(model_name, opt_name, manual)
    t.fit(module, worker_loader(t, model_name))
    if imerge_hooks.is_server():
        return
    state = {k: v.detach().clone() for k, v in module.net.state_dict().items()}
    if t.is_global_zero:
        torch.save(state, out / f"{run}.pt")
    say(WORLD_RANK, "checksum", run, f"{sum(v.abs().sum().item() for v in state.values()):.12f}")
    say(WORLD_RANK, "run-info", run, f"deferred={counter.deferred}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--runs", default=",".join(LIGHTNING_RUNS))
    parser.add_argument("--schedules", default=None)
    args = parser.parse_args()
    out = Path(args.out)
    schedules = args.schedules.split(",") if args.schedules else [None]
    fits = [tuple(r.split(":")) if ":" in r else (r, s) for r in args.runs.split(",")
            for s in ([None] if ":" in r else schedules)]
    for run, schedule in fits:
        try:
            fit(run, out, schedule)
            say(WORLD_RANK, "run-ok", run)
        except Exception:
            name = run if schedule is None else f"{run}-{schedule}"
            (out / f"{name}.err.{WORLD_RANK}").write_text(traceback.format_exc())
            say(WORLD_RANK, "run-failed", run)
    say(WORLD_RANK, "done")


main()
