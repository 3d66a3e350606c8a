"""The GPU checks, several per launch (a CUDA start-up costs seconds per rank).

Usage: python cuda_checks.py OUTDIR --checks optimizer,ddp-hook,lightning,stale,memory,parked
       [--schedules default,wfbp,...] [--device cuda|cpu]

Workers train on their bound GPU (``init()`` binds worker r of a host to its local rank; the
tests let workers share one GPU). Worker 0 trains the same model single-process on the full
batch on the same device and prints ``RESULT <check> <max |difference|>``; other lines:
``MEMORY``, ``READY``, ``PARKED``. The overlap check is ``tests/scripts/overlap_order.py --device cuda``.
``--device cpu`` runs the same checks on CPU (to try the script without a GPU).
"""

from __future__ import annotations

import argparse
import json
import os
import time

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
    assert torch.cuda.current_device() == imh.cluster.session.topology().local_rank % torch.cuda.device_count()


def say(*parts: object) -> None:
    print(f"@{imh.cluster.session.topology().world_rank}", *parts, flush=True)


class SlowGradient(torch.autograd.Function):
    """Identity whose backward first runs a long kernel on the gradient's stream (CUDA): the
    gradient it produces is the last of backward and lands well after the earlier ones."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return _slow(grad, 50_000_000)  # tens of milliseconds of GPU time


def _slow(grad: torch.Tensor, cycles: int, done: list | None = None) -> torch.Tensor:
    """A long kernel on the current stream before the gradient goes on (CUDA); ``done`` gets the event after it."""
    if grad.is_cuda:
        torch.cuda._sleep(cycles)
        if done is not None:
            event = torch.cuda.Event()
            event.record()
            done.append(event)
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


class SlowOutput(SlowGradient):
    """``SlowGradient`` with about a second of GPU time, recording the event after it (``SLOW_DONE``): the
    gradients behind it land only when the GPU gets past it."""

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return _slow(grad, 1_000_000_000, SLOW_DONE)


SLOW_DONE: list = []


class TwoStreams(nn.Module):
    """``fc_b`` runs on a side stream (autograd runs its backward there too), ``fc_a`` after it on the
    current stream with a long kernel before its gradients. ``fc_a``'s backward nodes are the later
    ones, so its hooks run (and its groups are submitted) first; ``fc_b``'s gradients are written long
    before ``fc_a``'s."""

    def __init__(self) -> None:
        super().__init__()
        self.fc_b = nn.Linear(16, 10)
        self.fc_a = nn.Linear(16, 10)
        self.side = torch.cuda.Stream() if device.type == "cuda" else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.side is None:
            b = self.fc_b(x)
        else:
            self.side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(self.side):
                b = self.fc_b(x)
            torch.cuda.current_stream().wait_stream(self.side)
            b.record_stream(torch.cuda.current_stream())
        return b + SlowOutput.apply(self.fc_a(x))


def check_parked() -> None:
    """The comm thread is never parked on a device event: while the GPU runs the long kernel before
    ``fc_a``'s gradients, ``fc_b``'s groups (submitted after ``fc_a``'s, written on a side stream) are
    pushed and their results arrive; the trained parameters match single-process training (nothing
    read before it was written, on either stream). Then a flag read (``DeviceStreams.read_scalar``)
    returns while the copy stream is still busy."""
    from imerge_hooks.worker import streams

    torch.manual_seed(1234)
    model = TwoStreams().to(device)
    torch.manual_seed(1234)
    ref = TwoStreams().to(device)
    ref.load_state_dict(model.state_dict())
    opt = imh.DistributedOptimizer(optimizer(model.parameters()), named_parameters=model.named_parameters(),
                                   schedule="wfbp")
    ref_opt = optimizer(ref.parameters())
    engine = opt._imerge_engine
    early = []  # per step: how many groups completed before the GPU got past the long kernel
    for step in range(args.steps):
        g = torch.Generator().manual_seed(2000 + step)
        x, y = torch.randn(FULL_BATCH, 16, generator=g).to(device), torch.randint(0, 10, (FULL_BATCH,), generator=g)
        opt.zero_grad()
        SLOW_DONE.clear()
        nn.functional.cross_entropy(model(shard(x)), shard(y)).backward()
        done_first = 0
        if SLOW_DONE:
            deadline = time.monotonic() + 30
            while not SLOW_DONE[0].query() and time.monotonic() < deadline:
                done_first = sum(group.done.is_set() for group in engine.groups)
                time.sleep(0.001)
        early.append(done_first)
        opt.step()
        if rank == 0:
            ref_opt.zero_grad()
            nn.functional.cross_entropy(ref(x), y).backward()
            ref_opt.step()
    opt.synchronize()
    result = {"early": early, "groups": len(engine.groups)}
    engine.close()
    if device.type == "cuda":
        ops = streams.for_device(device)
        value = torch.full((4,), 7.0, device=device)
        torch.cuda.synchronize()
        with torch.cuda.stream(streams.copy_stream(device)):
            torch.cuda._sleep(1_000_000_000)
        start = time.monotonic()
        result["read"] = ops.read_scalar(value, 2)
        result["read_s"] = time.monotonic() - start
        result["copy_stream_busy_after_read"] = not streams.copy_stream(device).query()
        torch.cuda.synchronize()
    say("PARKED", json.dumps(result))
    if rank == 0:
        got, want = model.state_dict(), ref.state_dict()
        say("RESULT", "parked:wfbp", max((got[k] - want[k]).abs().max().item() for k in want))


CHECKS = {"optimizer": check_optimizer, "stale": check_stale, "ddp-hook": check_ddp_hook,
          "lightning": check_lightning, "memory": check_memory, "parked": check_parked}
for name in args.checks.split(","):
    CHECKS[name]()
say("DONE", os.environ.get("IMERGE_HOST", ""))
