"""The GPU checks, several per launch (a CUDA start-up costs seconds per rank).

Usage: python cuda_checks.py OUTDIR --checks optimizer,ddp-hook,lightning,stale,memory
       [--schedules default,wfbp,...] [--device cuda|cpu]

Workers train on their bound GPU (``init()`` binds worker r of a host to its local rank; the
tests let workers share one GPU). Worker 0 trains the same model single-process on the full
batch on the same device and prints ``RESULT <check> <max |difference|>``; other lines:
``MEMORY``, ``READY``. The overlap check is ``tests/scripts/overlap_order.py --device cuda``.
``--device cpu`` runs the same checks on CPU (to try the script without a GPU).
"""

from __future__ import annotations

import argparse
import json
import os

import torch
from torch import nn

import imerge_hooks as imh

parser = argparse.ArgumentParser()
parser.add_argument("out")
parser.add_argument("--checks", default="optimizer")
parser.add_argument("--schedules", default="default,wfbp,priority,threshold,mgwfbp,adaptive-ps,imerge")
parser.add_argument("--device", default="cuda")
parser.add_argument("--steps", type=int, default=6)
parser.add_argument("--iterations", type=int, default=500, help="memory check")
args = parser.parse_args()

# float32 with deterministic kernels and no TF32: full batch and shards differ only by summation order.
torch.use_deterministic_algorithms(True)
torch.backends.cudnn.benchmark = False
torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False

imh.init()
rank, world = imh.rank(), imh.size()
device = torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")
FULL_BATCH = 8 * world
if args.device == "cuda":
    assert torch.cuda.current_device() == imh.session.topology().local_rank % torch.cuda.device_count()


def say(*parts: object) -> None:
    print(f"@{imh.session.topology().world_rank}", *parts, flush=True)


class SlowGradient(torch.autograd.Function):
    """Identity whose backward first runs a long kernel on the gradient's stream (CUDA): the
    gradient it produces is the last of backward and lands well after the earlier ones."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        if grad.is_cuda:
            torch.cuda._sleep(50_000_000)  # tens of milliseconds of GPU time
        return grad * 1.0


class Net(nn.Module):
    def __init__(self, slow: bool = False) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.fc1 = nn.Linear(8 * 8 * 8, 64)
        self.fc2 = nn.Linear(64, 10)
        self.slow = slow

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = SlowGradient.apply(self.conv.weight) if self.slow else self.conv.weight
        x = torch.relu(nn.functional.conv2d(x, weight, self.conv.bias, padding=1))
        return self.fc2(torch.relu(self.fc1(x.flatten(1))))


def make_model(slow: bool = False) -> Net:
    torch.manual_seed(1234)
    return Net(slow).to(device)


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(FULL_BATCH, 3, 8, 8, generator=g), torch.randint(0, 10, (FULL_BATCH,), generator=g)


def shard(t: torch.Tensor) -> torch.Tensor:
    per = t.shape[0] // world
    return t[rank * per:(rank + 1) * per]


def optimizer(params) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.05, momentum=0.9, weight_decay=1e-3)


def reference(steps: int, slow: bool = False) -> dict[str, torch.Tensor]:
    """Single process, full batch, same device."""
    model = make_model(slow)
    opt = optimizer(model.parameters())
    for step in range(steps):
        opt.zero_grad()
        x, y = batch(step)
        nn.functional.cross_entropy(model(x.to(device)), y.to(device)).backward()
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def report(check: str, model: nn.Module, steps: int, slow: bool = False) -> None:
    got = {k: v.detach().clone() for k, v in model.state_dict().items()}
    if rank == 0:
        ref = reference(steps, slow)
        say("RESULT", check, max((got[k] - ref[k]).abs().max().item() for k in ref))


def train_optimizer(schedule: str, steps: int, slow: bool = False) -> nn.Module:
    model = make_model(slow)
    opt = imh.DistributedOptimizer(optimizer(model.parameters()), named_parameters=model.named_parameters(),
                                   schedule=schedule)
    imh.broadcast_parameters(model.state_dict(), root_rank=0)
    for step in range(steps):
        opt.zero_grad()
        x, y = batch(step)
        nn.functional.cross_entropy(model(shard(x).to(device)), shard(y).to(device)).backward()
        opt.step()
    opt.synchronize()
    engine = opt._imerge_engine
    if engine.replanner is not None and engine.replanner.profile is not None:
        profile = engine.replanner.profile
        say("READY", schedule, json.dumps(dict(zip(profile.names, profile.ready_times))))
    engine.close()
    return model


def check_optimizer() -> None:
    for schedule in args.schedules.split(","):
        report(f"optimizer:{schedule}", train_optimizer(schedule, args.steps), args.steps)


def check_stale() -> None:
    """A long kernel queued before backward's last gradient: a push that read its group before the
    gradient was written would send zeros (or last step's values) and the parameters would differ.
    The profile of ``imerge`` (READY) must show that gradient late: ready times are GPU times."""
    for schedule in ("wfbp", "imerge"):
        report(f"stale:{schedule}", train_optimizer(schedule, args.steps, slow=True), args.steps, slow=True)


def check_ddp_hook() -> None:
    for schedule in [s for s in args.schedules.split(",") if s != "imerge"]:  # a hook cannot defer the update
        model = make_model()
        ddp = nn.parallel.DistributedDataParallel(model, process_group=imh.worker_group(), bucket_cap_mb=0.01)
        state = imh.IMergeHookState(schedule=schedule, named_parameters=model.named_parameters())
        ddp.register_comm_hook(state, imh.ps_hook)
        opt = optimizer(model.parameters())
        for step in range(args.steps):
            opt.zero_grad()
            x, y = batch(step)
            nn.functional.cross_entropy(ddp(shard(x).to(device)), shard(y).to(device)).backward()
            opt.step()
        report(f"ddp-hook:{schedule}", model, args.steps)
        if state.engine is not None:
            state.engine.close()


def check_lightning() -> None:
    import pytorch_lightning as pl
    from torch.utils.data import DataLoader

    from lightning_plugin import IMergeStrategy

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = make_model()

        def training_step(self, data, _index):
            x, y = data
            return nn.functional.cross_entropy(self.net(x), y)

        def configure_optimizers(self):
            return optimizer(self.parameters())

    shards = [(shard(x), shard(y)) for x, y in map(batch, range(args.steps))]
    for schedule in args.schedules.split(","):
        module = Module()
        trainer = pl.Trainer(strategy=IMergeStrategy(schedule=schedule), accelerator="gpu" if device.type == "cuda"
                             else "cpu", devices=1, max_steps=args.steps, logger=False, enable_checkpointing=False,
                             enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False)
        trainer.fit(module, DataLoader(shards, batch_size=None))
        if device.type == "cuda":
            assert module.device == device, (module.device, device)
        report(f"lightning:{schedule}", module.net, args.steps)


def check_memory() -> None:
    """Allocated and peak device memory stay flat from iteration 50 to the last (results, staging
    and plan epochs do not pile up)."""
    model = make_model()
    opt = imh.DistributedOptimizer(optimizer(model.parameters()), named_parameters=model.named_parameters(),
                                   schedule="imerge")
    x, y = batch(0)
    x, y = shard(x).to(device), shard(y).to(device)
    marks = {}
    for iteration in range(1, args.iterations + 1):
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        if iteration in (50, args.iterations) and device.type == "cuda":
            torch.cuda.synchronize()
            marks[iteration] = (torch.cuda.memory_allocated(), torch.cuda.max_memory_allocated())
            torch.cuda.reset_peak_memory_stats()
    opt.synchronize()
    opt._imerge_engine.close()
    say("MEMORY", json.dumps({str(k): v for k, v in marks.items()}))


CHECKS = {"optimizer": check_optimizer, "stale": check_stale, "ddp-hook": check_ddp_hook,
          "lightning": check_lightning, "memory": check_memory}
for name in args.checks.split(","):
    CHECKS[name]()
say("DONE", os.environ.get("IMERGE_HOST", ""))
