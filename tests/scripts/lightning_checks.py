"""Several Lightning runs in one launch, under ``strategy=imerge`` or Lightning's own DDP (the reference).

Usage: python lightning_checks.py OUT --strategy imerge|imerge-name|ddp [--runs plain,full,...] [--lightning]
       [--server-raises]

Runs (each a fresh model and Trainer, in this order):
  plain   fit, 2 epochs, float64 SmallCNN, SGD with momentum; val loss/acc logged with sync_dist
  full    fit with accumulate_grad_batches=2 (5 micro-batches an epoch: the last step is short),
          gradient_clip_val, ModelCheckpoint every epoch; then validate(ckpt_path=...), test, predict
  manual  manual optimization, two optimizers (SGD, Adam) over two sub-networks
  bf16    float32 model, precision="bf16-mixed" on CPU; fit twice (second Trainer, same model)
  bn      BatchNorm model, 2 epochs with validation: every worker's buffers as under DDP (broadcast_buffers)
  macc    manual optimization, two manual_backward per step (accumulation), schedule "default", 2 epochs
  gan     Lightning's GAN example in small: manual optimization, toggle_optimizer, two Adams, BatchNorm in the
          generator, default schedule (imerge)
  tune    BaseFinetuning: features frozen, unfrozen at epochs 1 and 2 by unfreeze_and_add_param_group, Adam
          with a MultiStepLR, default schedule. Under --strategy ddp it runs on world rank 0 alone as the
          reference, one process whose batches of 12 are both workers' 6 (BothWorkers): DDP itself never
          averages parameters that were frozen when it wrapped the model
  script  what Lightning's example scripts do after fit, on every rank (servers too): print(predictions[0]),
          validate/test results and trainer.callback_metrics used by the next line
Worker 0 writes OUT/<run>.pt (final state_dict) and OUT/<run>.json (metrics). Every rank says what
it did; server ranks report what each entry point returned there. --server-raises: the script
raises on the server after everything (the job must still exit 0, the error reported).
"""

import argparse
import json
import math
import os
import sys
from pathlib import Path

import torch
from common import SmallCNN, say
from mpi4py import MPI
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, Sampler, TensorDataset

if "--lightning" in sys.argv:  # the unified package: lightning.pytorch (imported before lightning_plugin)
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import BaseFinetuning, ModelCheckpoint
    from lightning.pytorch.plugins import TorchCheckpointIO
else:
    import pytorch_lightning as pl
    from pytorch_lightning.callbacks import BaseFinetuning, ModelCheckpoint
    from pytorch_lightning.plugins import TorchCheckpointIO

import lightning_plugin  # noqa: E402

if not MPI.Is_initialized():  # importing imerge_hooks does not start MPI
    MPI.Init_thread(MPI.THREAD_MULTIPLE)
WORLD_RANK = MPI.COMM_WORLD.Get_rank()
parser = argparse.ArgumentParser()
parser.add_argument("out")
parser.add_argument("--strategy", default="imerge", choices=["imerge", "imerge-name", "ddp"])
parser.add_argument("--runs", default="plain,full,manual,bf16,bn,macc,gan,tune,script")
parser.add_argument("--lightning", action="store_true", help="build on lightning.pytorch")
parser.add_argument("--server-raises", action="store_true", help="raise on the server at the very end")
args = parser.parse_args()
OUT = Path(args.out)
CLIP = 0.05


def data(n: int, seed: int, dtype: torch.dtype = torch.float64) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, 1, 8, 8, generator=g).to(dtype), torch.randint(0, 10, (n,), generator=g))


class Net(pl.LightningModule):
    def __init__(self, dtype: str = "float64", record_norms: bool = False) -> None:
        super().__init__()
        self.save_hyperparameters()
        torch.manual_seed(1234)
        self.net = SmallCNN().to(getattr(torch, dtype))
        self.norms: list[float] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.cross_entropy(self(x), y)
        self.log("train_loss", loss, on_step=False, on_epoch=True, sync_dist=True)
        return loss

    def _evaluate(self, batch, prefix: str) -> None:
        x, y = batch
        logits = self(x)
        self.log(f"{prefix}_loss", nn.functional.cross_entropy(logits, y), sync_dist=True)
        self.log(f"{prefix}_acc", (logits.argmax(1) == y).double().mean(), sync_dist=True)

    def validation_step(self, batch, batch_idx):
        self._evaluate(batch, "val")

    def test_step(self, batch, batch_idx):
        self._evaluate(batch, "test")

    def predict_step(self, batch, batch_idx):
        return self(batch[0]).argmax(1)

    def on_before_optimizer_step(self, optimizer):
        if self.hparams.record_norms:  # gradients here must already be averaged over the workers
            grads = [p.grad for p in self.parameters() if p.grad is not None]
            self.norms.append(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads])).item())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


class TwoNets(pl.LightningModule):
    """Manual optimization: two sub-networks, each with its own loss and optimizer."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        torch.manual_seed(99)
        self.a = nn.Sequential(nn.Flatten(), nn.Linear(64, 16), nn.ReLU(), nn.Linear(16, 10)).double()
        self.b = nn.Sequential(nn.Flatten(), nn.Linear(64, 10)).double()

    def training_step(self, batch, batch_idx):
        x, y = batch
        opt_a, opt_b = self.optimizers()
        for net, opt in ((self.a, opt_a), (self.b, opt_b)):
            loss = nn.functional.cross_entropy(net(x), y)
            opt.zero_grad()
            self.manual_backward(loss)
            self.clip_gradients(opt, gradient_clip_val=1.0, gradient_clip_algorithm="norm")
            opt.step()

    def configure_optimizers(self):
        return (torch.optim.SGD(self.a.parameters(), lr=0.1, momentum=0.5),
                torch.optim.Adam(self.b.parameters(), lr=0.01))


class BatchNormNet(Net):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(4321)
        self.net = nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(),
                                 nn.Linear(4 * 8 * 8, 10)).double()


class ManualAccumulation(pl.LightningModule):
    """Manual optimization with two backward passes per step; validation between epochs."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        torch.manual_seed(77)
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(64, 16), nn.ReLU(), nn.Linear(16, 10)).double()

    def training_step(self, batch, batch_idx):
        x, y = batch
        opt = self.optimizers()
        opt.zero_grad()
        half = len(x) // 2
        for xs, ys in ((x[:half], y[:half]), (x[half:], y[half:])):
            self.manual_backward(nn.functional.cross_entropy(self.net(xs), ys) / 2)
        opt.step()

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", nn.functional.cross_entropy(self.net(x), y), sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


class SmallGAN(pl.LightningModule):
    """generative_adversarial_net.py's training_step, on a small generator and discriminator."""

    def __init__(self, latent_dim: int = 8) -> None:
        super().__init__()
        self.automatic_optimization = False
        torch.manual_seed(55)
        self.latent_dim = latent_dim
        self.generator = nn.Sequential(nn.Linear(latent_dim, 16), nn.BatchNorm1d(16, 0.8), nn.LeakyReLU(0.2),
                                       nn.Linear(16, 64), nn.Tanh()).double()
        self.discriminator = nn.Sequential(nn.Linear(64, 16), nn.LeakyReLU(0.2), nn.Linear(16, 1)).double()

    def forward(self, z):
        return self.generator(z)

    def training_step(self, batch):
        imgs = batch[0].flatten(1)
        opt_g, opt_d = self.optimizers()
        z = torch.randn(imgs.shape[0], self.latent_dim, generator=self.noise).type_as(imgs)
        valid, fake = torch.ones(imgs.size(0), 1).type_as(imgs), torch.zeros(imgs.size(0), 1).type_as(imgs)
        bce = nn.functional.binary_cross_entropy_with_logits
        self.toggle_optimizer(opt_g)
        g_loss = bce(self.discriminator(self(z)), valid)
        opt_g.zero_grad()
        self.manual_backward(g_loss)
        opt_g.step()
        self.untoggle_optimizer(opt_g)
        self.toggle_optimizer(opt_d)
        d_loss = (bce(self.discriminator(imgs), valid) + bce(self.discriminator(self(z).detach()), fake)) / 2
        opt_d.zero_grad()
        self.manual_backward(d_loss)
        opt_d.step()
        self.untoggle_optimizer(opt_d)
        self.log_dict({"d_loss": d_loss, "g_loss": g_loss})

    def on_train_start(self) -> None:
        self.noise = torch.Generator().manual_seed(100 + self.global_rank)  # each worker its own noise, as DDP

    def configure_optimizers(self):
        return (torch.optim.Adam(self.generator.parameters(), lr=0.01, betas=(0.5, 0.999)),
                torch.optim.Adam(self.discriminator.parameters(), lr=0.01, betas=(0.5, 0.999)))


class FeatureNet(pl.LightningModule):
    """A feature extractor and a head; computer_vision_fine_tuning.py's optimizer (trainable parameters only)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(66)
        self.features = nn.Sequential(nn.Flatten(), nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 16), nn.ReLU()).double()
        self.head = nn.Linear(16, 10).double()

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self.head(self.features(x)), y)

    def configure_optimizers(self):
        optimizer = torch.optim.Adam([p for p in self.parameters() if p.requires_grad], lr=0.01)
        return [optimizer], [torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones=[1, 2], gamma=0.5)]


class Unfreeze(BaseFinetuning):
    """MilestonesFinetuning in small: the last feature layer at epoch 1, the rest at epoch 2."""

    def freeze_before_training(self, pl_module):
        self.freeze(modules=pl_module.features)

    def finetune_function(self, pl_module, epoch, optimizer):
        if epoch == 1:
            self.unfreeze_and_add_param_group(modules=pl_module.features[-2:], optimizer=optimizer)
        elif epoch == 2:
            self.unfreeze_and_add_param_group(modules=pl_module.features[:-2], optimizer=optimizer, lr=0.005)


class BothWorkers(Sampler):
    """One process's batches of 2 x ``per``: worker 0's and worker 1's batches of one step, as the
    DistributedSampler Lightning gives each worker makes them (shuffled with the global seed)."""

    def __init__(self, n: int, per: int) -> None:
        self.n, self.per, self.epoch = n, per, 0

    def set_epoch(self, epoch: int) -> None:  # Lightning calls it every epoch, as on a DistributedSampler
        self.epoch = epoch

    def __len__(self) -> int:
        return self.n

    def __iter__(self):
        shards = []
        for rank in (0, 1):
            sampler = DistributedSampler(range(self.n), num_replicas=2, rank=rank, shuffle=True,
                                         seed=int(os.environ.get("PL_GLOBAL_SEED", 0)))
            sampler.set_epoch(self.epoch)
            shards.append(list(sampler))
        for k in range(0, len(shards[0]), self.per):
            yield from shards[0][k:k + self.per] + shards[1][k:k + self.per]


class RecordingIO(TorchCheckpointIO):
    def save_checkpoint(self, checkpoint, path, storage_options=None):
        say(WORLD_RANK, "ckpt-write", os.path.basename(path))
        super().save_checkpoint(checkpoint, path, storage_options=storage_options)


def make_strategy(find_unused: bool = False, schedule: str = "wfbp"):
    if args.strategy == "imerge":
        return lightning_plugin.IMergeStrategy(schedule=schedule, stall_warning_s=30.0)
    if args.strategy == "imerge-name":
        return "imerge"  # schedule etc. from IMERGE_* env vars
    from pytorch_lightning.plugins.environments import MPIEnvironment
    from pytorch_lightning.strategies import DDPStrategy

    return DDPStrategy(cluster_environment=MPIEnvironment(), process_group_backend="gloo",
                       find_unused_parameters=find_unused)


def trainer(**kwargs) -> pl.Trainer:
    devices = MPI.COMM_WORLD.Get_size() if args.strategy == "ddp" else 1
    options = dict(accelerator="cpu", devices=devices, logger=False, enable_checkpointing=False,
                   enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                   use_distributed_sampler=True)
    options.update(kwargs)
    if "strategy" not in options:
        options["strategy"] = make_strategy()
    return pl.Trainer(**options)


def loader(ds: TensorDataset, shuffle: bool) -> DataLoader:
    return DataLoader(ds, batch_size=6, shuffle=shuffle)


def checksum(module: nn.Module) -> str:
    return f"{sum(p.detach().double().abs().sum().item() for p in module.parameters()):.12f}"


def finish(name: str, t: pl.Trainer, module: nn.Module, extra: dict | None = None) -> None:
    metrics = {k: float(v) for k, v in t.callback_metrics.items()}
    if t.is_global_zero:
        torch.save({k: v.detach().clone() for k, v in module.state_dict().items()}, OUT / f"{name}.pt")
        (OUT / f"{name}.json").write_text(json.dumps({"metrics": metrics, **(extra or {})}))
    say(WORLD_RANK, "checksum", name, checksum(module))


def on_server() -> bool:
    if args.strategy == "ddp":
        return False
    import imerge_hooks

    return imerge_hooks.cluster.session.is_initialized() and imerge_hooks.is_server()


def server_report(name: str, value) -> None:
    if on_server():
        say(WORLD_RANK, "server-returned", name, value if isinstance(value, str) else repr(value))


pl.seed_everything(7, verbose=False)
train, val = data(60, 1), data(24, 2)
runs = args.runs.split(",")

if "plain" in runs:
    t = trainer(max_epochs=2)
    model = Net()
    server_report("fit", t.fit(model, loader(train, True), loader(val, False)))
    if not on_server():
        finish("plain", t, model)

if "full" in runs:
    ckpt_dir = OUT / "ckpt"
    t = trainer(max_epochs=2, accumulate_grad_batches=2, gradient_clip_val=CLIP, enable_checkpointing=True,
                callbacks=[ModelCheckpoint(dirpath=ckpt_dir, save_top_k=-1, every_n_epochs=1)],
                plugins=[RecordingIO()])
    model = Net(record_norms=True)
    t.fit(model, loader(train, True), loader(val, False))
    fit_metrics = {k: float(v) for k, v in t.callback_metrics.items()}
    last = sorted(ckpt_dir.glob("*.ckpt"))[-1] if ckpt_dir.exists() else None
    validated = t.validate(model, loader(val, False), ckpt_path=str(last) if last else None, verbose=False)
    server_report("validate", json.dumps(validated[0]))
    tested = t.test(model, loader(val, False), verbose=False)
    server_report("test", json.dumps(tested[0]))
    predicted = t.predict(model, loader(val, False))
    server_report("predict", sum(len(p) for p in predicted))
    if not on_server():
        reloaded = Net.load_from_checkpoint(str(last))
        diff = max((a - b).abs().max().item() for a, b in zip(reloaded.state_dict().values(),
                                                              model.state_dict().values()))
        say(WORLD_RANK, "ckpt-reload-maxdiff", diff)
        say(WORLD_RANK, "predicted", sum(len(p) for p in predicted))
        say(WORLD_RANK, "validate", json.dumps(validated[0]), "test", json.dumps(tested[0]))
        finish("full", t, model, {"fit_metrics": fit_metrics, "validate": validated[0], "test": tested[0],
                                  "norms": model.norms, "ckpts": sorted(p.name for p in ckpt_dir.glob("*.ckpt"))})

if "manual" in runs:
    t = trainer(max_epochs=1, strategy=make_strategy(find_unused=True))
    model = TwoNets()
    t.fit(model, loader(train, True))
    if not on_server():
        finish("manual", t, model)

if "bf16" in runs:
    t = trainer(max_epochs=1, precision="bf16-mixed")
    model = Net(dtype="float32")
    t.fit(model, loader(data(60, 1, torch.float32), True), loader(data(24, 2, torch.float32), False))
    t = trainer(max_epochs=1, precision="bf16-mixed")  # fit the same model again: new optimizer, new engine
    t.fit(model, loader(data(60, 3, torch.float32), True), loader(data(24, 2, torch.float32), False))
    if not on_server():
        loss = float(t.callback_metrics["train_loss"])
        say(WORLD_RANK, "bf16-loss", loss, "finite" if math.isfinite(loss) else "NOT FINITE")
        finish("bf16", t, model)

if "bn" in runs:
    t = trainer(max_epochs=2)
    model = BatchNormNet()
    t.fit(model, loader(train, True), loader(val, False))
    if not on_server():
        finish("bn", t, model)
        torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, OUT / f"bn-w{t.global_rank}.pt")

if "macc" in runs:
    strategy = lightning_plugin.IMergeStrategy(schedule="default") if args.strategy == "imerge" else None
    t = trainer(max_epochs=2, **({"strategy": strategy} if strategy is not None else {}))
    model = ManualAccumulation()
    t.fit(model, loader(train, True), loader(val, False))
    if not on_server():
        finish("macc", t, model)

if "gan" in runs:
    t = trainer(max_epochs=2, strategy=make_strategy(find_unused=True, schedule="imerge"))
    model = SmallGAN()
    t.fit(model, loader(train, True))
    if not on_server():
        finish("gan", t, model)
        say(WORLD_RANK, "gan-buffers", f"{sum(b.double().sum().item() for b in model.buffers()):.12f}")

if "tune" in runs and (args.strategy != "ddp" or WORLD_RANK == 0):
    single = args.strategy == "ddp"  # the reference: one process sees both workers' batches of 6 at once
    strategy = pl.strategies.SingleDeviceStrategy(torch.device("cpu")) if single else \
        make_strategy(find_unused=True, schedule="imerge")
    t = trainer(max_epochs=3, callbacks=[Unfreeze()], strategy=strategy, devices=1)
    model = FeatureNet()
    t.fit(model, DataLoader(train, batch_size=12, sampler=BothWorkers(len(train), 6)) if single else
          DataLoader(train, batch_size=6, shuffle=True))
    if not on_server():
        groups = [len(g["params"]) for g in t.optimizers[0].param_groups]
        finish("tune", t, model, {"groups": groups})
        say(WORLD_RANK, "tune-groups", *groups)

if "script" in runs:
    # The lines after fit in Lightning's example scripts, on every rank: a server must get values
    # its next line can use (worker 0's), as a worker does.
    t = trainer(max_epochs=1)
    model = Net()
    t.fit(model, loader(train, True), loader(val, False))
    fit_loss = float(t.callback_metrics["val_loss"])
    validated = t.validate(model, loader(val, False), verbose=False)
    val_loss = validated[0]["val_loss"]
    tested = t.test(model, loader(val, False), verbose=False)
    test_acc = tested[0]["test_acc"]
    test_loss = float(t.callback_metrics["test_loss"])
    predictions = t.predict(model, loader(val, False))
    print(predictions[0])
    say(WORLD_RANK, "script", "server" if on_server() else "worker", f"{fit_loss:.12f}", f"{val_loss:.12f}",
        f"{test_acc:.12f}", f"{test_loss:.12f}", len(predictions),
        predictions[0].tolist())

say(WORLD_RANK, "done", args.strategy, "server" if on_server() else "worker")
sys.stdout.flush()
if args.server_raises and on_server():
    raise RuntimeError("the script's last line fails on the server only")
