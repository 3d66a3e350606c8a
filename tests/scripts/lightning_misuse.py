"""Misuse of ``Trainer(strategy="imerge")``; prints what happened, tagged by world rank.

Usage: python lightning_misuse.py devices2   (under mpiexec: Trainer(devices=2) is refused on every rank)
       python lightning_misuse.py single     (no mpiexec: one process, no servers, trains like one device)
"""

import sys

import pytorch_lightning as pl
import torch
from common import say
from mpi4py import MPI
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_plugin  # noqa: F401  (registers "imerge")

if not MPI.Is_initialized():  # importing imerge_hooks does not start MPI
    MPI.Init_thread(MPI.THREAD_MULTIPLE)
RANK = MPI.COMM_WORLD.Get_rank()


class Tiny(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(4, 2)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.cross_entropy(self.layer(x), y)
        self.log("loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def trainer(**kwargs) -> pl.Trainer:
    return pl.Trainer(strategy="imerge", accelerator="cpu", max_epochs=1, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, **kwargs)


mode = sys.argv[1]
if mode == "devices2":
    try:
        trainer(devices=2)
        say(RANK, "NO ERROR")
    except Exception as e:  # noqa: BLE001 - the test reads the message
        say(RANK, "ERROR", type(e).__name__, str(e).replace("\n", " "))
elif mode == "single":
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(16, 4, generator=g), torch.randint(0, 2, (16,), generator=g))
    t = trainer(devices=1)
    before = Tiny()
    t.fit(before, DataLoader(data, batch_size=4))
    say(RANK, "single", "world_size", t.world_size, "global_zero", t.is_global_zero,
        "strategy", type(t.strategy).__name__, "steps", t.global_step, "loss", float(t.callback_metrics["loss"]))
else:
    raise SystemExit(f"unknown mode {mode}")
say(RANK, "exit", mode)
