"""A small CNN on scikit-learn's bundled digits (8x8 images, no download), trained with PyTorch Lightning and IMerge.

    mpiexec -n 4 -env IMERGE_NUM_SERVERS 1 python examples/lightning_digits.py          # 3 workers + 1 server
    mpiexec -n 4 -env IMERGE_NUM_SERVERS 1 python examples/lightning_digits.py --schedule wfbp --epochs 5
    mpiexec -n 3 python examples/lightning_digits.py --strategy ddp                      # Lightning DDP, 3 ranks
    python examples/lightning_digits.py                                                  # one process

(Open MPI: ``mpirun -np 4 -x IMERGE_NUM_SERVERS=1 python examples/lightning_digits.py``.)

``--strategy imerge`` is ``Trainer(strategy="imerge")``: gradients are summed by the parameter
servers. ``--strategy ddp`` is Lightning's own DDP (gloo all-reduce) over every MPI rank, for
comparison with the same number of workers. Worker 0 prints each epoch's training loss,
validation accuracy and training samples/s, then one line for scripts to parse::

    RESULT strategy=imerge schedule=imerge workers=3 val_acc=0.9722 samples_per_s=1234.5 time_s=12.3
"""

from __future__ import annotations

import argparse
import os
import time

import pytorch_lightning as pl
import torch
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_plugin


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--strategy", choices=["imerge", "ddp"], default="imerge")
    parser.add_argument("--schedule", default=None,
                        help="IMerge schedule (default: IMERGE_SCHEDULE, else imerge); see imerge_hooks.SCHEDULES")
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=32, help="per worker")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cuda", action="store_true", help="train on the GPU of each worker's local rank")
    return parser.parse_args()


def digits() -> tuple[TensorDataset, TensorDataset]:
    """1797 images: a fixed 80/20 split into 1437 training and 360 validation images."""
    data = load_digits()
    x = torch.tensor(data.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(data.target, dtype=torch.long)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
    cut = int(0.8 * len(y))
    train, val = order[:cut], order[cut:]
    return TensorDataset(x[train], y[train]), TensorDataset(x[val], y[val])


class DigitsCNN(pl.LightningModule):
    def __init__(self, lr: float) -> None:
        super().__init__()
        self.lr = lr
        self.net = nn.Sequential(
            nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(),
            nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Flatten(), nn.Linear(32 * 4 * 4, 64), nn.ReLU(), nn.Linear(64, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.cross_entropy(self(x), y)
        self.log("train_loss", loss, on_step=False, on_epoch=True, sync_dist=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        self.log("val_loss", nn.functional.cross_entropy(logits, y), sync_dist=True)
        self.log("val_acc", (logits.argmax(1) == y).float().mean(), sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=self.lr)


class Progress(pl.Callback):
    """Per-epoch line on worker 0; training time excludes validation."""

    def __init__(self, train_samples: int) -> None:
        self.train_samples = train_samples
        self.epoch_times: list[float] = []
        self._start: float | None = None

    def on_train_epoch_start(self, trainer, pl_module):
        self._start = time.perf_counter()

    def on_validation_start(self, trainer, pl_module):
        if self._start is not None and not trainer.sanity_checking:
            self.epoch_times.append(time.perf_counter() - self._start)
            self._start = None

    def on_train_epoch_end(self, trainer, pl_module):
        if self._start is not None:  # no validation this epoch
            self.epoch_times.append(time.perf_counter() - self._start)
            self._start = None
        if trainer.is_global_zero:
            m = trainer.callback_metrics
            print(f"epoch {trainer.current_epoch:3d}  loss {float(m['train_loss']):.4f}  "
                  f"val_acc {float(m.get('val_acc', float('nan'))):.4f}  "
                  f"samples/s {self.train_samples / self.epoch_times[-1]:9.1f}", flush=True)

    def samples_per_s(self) -> float:
        """Training throughput over the epochs after the first (warm-up: profiling, planning)."""
        times = self.epoch_times[1:] or self.epoch_times
        return self.train_samples * len(times) / sum(times) if times else float("nan")


def mpi_layout() -> tuple[int, int, int]:
    """(world size, ranks on this node, nodes) of the MPI launch; (1, 1, 1) without MPI."""
    try:
        from mpi4py import MPI
    except ImportError:
        return 1, 1, 1
    world = MPI.COMM_WORLD
    local = world.Split_type(MPI.COMM_TYPE_SHARED).Get_size()
    return world.Get_size(), local, max(1, world.Get_size() // local)


def make_trainer(args: argparse.Namespace, callbacks: list) -> pl.Trainer:
    common = dict(max_epochs=args.epochs, accelerator="gpu" if args.cuda else "cpu", logger=False,
                  enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                  num_sanity_val_steps=0, callbacks=callbacks)
    if args.strategy == "ddp":
        world, local, nodes = mpi_layout()
        if world == 1:
            return pl.Trainer(devices=1, **common)
        from pytorch_lightning.plugins.environments import MPIEnvironment
        from pytorch_lightning.strategies import DDPStrategy

        backend = "nccl" if args.cuda else "gloo"
        strategy = DDPStrategy(cluster_environment=MPIEnvironment(), process_group_backend=backend)
        return pl.Trainer(strategy=strategy, devices=local, num_nodes=nodes, **common)
    strategy = "imerge" if args.schedule is None else lightning_plugin.IMergeStrategy(schedule=args.schedule)
    return pl.Trainer(strategy=strategy, devices=1, **common)


def main() -> None:
    args = parse_args()
    if "OMP_NUM_THREADS" not in os.environ and mpi_layout()[1] > 1:
        torch.set_num_threads(1)  # several ranks share this node's cores
    pl.seed_everything(args.seed, verbose=False)
    train, val = digits()
    progress = Progress(len(train))
    trainer = make_trainer(args, [progress])
    model = DigitsCNN(args.lr)
    started = time.perf_counter()
    trainer.fit(model, DataLoader(train, batch_size=args.batch_size, shuffle=True),
                DataLoader(val, batch_size=256))
    if trainer.is_global_zero:  # False on IMerge's server ranks too
        schedule = "-"
        if args.strategy == "imerge":
            from imerge_hooks.cluster import session

            schedule = args.schedule or session.config().schedule
        print(f"RESULT strategy={args.strategy} schedule={schedule} workers={trainer.world_size} "
              f"val_acc={float(trainer.callback_metrics['val_acc']):.4f} "
              f"samples_per_s={progress.samples_per_s():.1f} time_s={time.perf_counter() - started:.1f}", flush=True)


if __name__ == "__main__":
    main()
