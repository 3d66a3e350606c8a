"""Shared by the multi-process test scripts and by the in-process references."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator

import torch
from torch import nn

FULL_BATCH = 12  # divisible by 1, 2, 3 and 4 workers


class SmallCNN(nn.Module):
    """No BatchNorm: every parameter has a real gradient (Adam would amplify float noise)."""

    def __init__(self, unused: bool = False) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 4, 3, padding=1)
        self.conv2 = nn.Conv2d(4, 8, 3, padding=1)
        self.fc1 = nn.Linear(8 * 8 * 8, 32)
        self.fc2 = nn.Linear(32, 10)
        self.spare = nn.Linear(4, 4) if unused else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.conv1(x))
        x = torch.relu(self.conv2(x))
        x = torch.relu(self.fc1(x.flatten(1)))
        return self.fc2(x)


def make_model(unused: bool = False, dtype: torch.dtype = torch.float64) -> SmallCNN:
    torch.manual_seed(1234)
    return SmallCNN(unused).to(dtype)


def batch(step: int, dtype: torch.dtype = torch.float64) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(FULL_BATCH, 1, 8, 8, generator=g).to(dtype)
    y = torch.randint(0, 10, (FULL_BATCH,), generator=g)
    return x, y


def shard(t: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    per = t.shape[0] // world
    return t[rank * per:(rank + 1) * per]


def make_optimizer(name: str, params, lr: float = 0.05) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=0.9, weight_decay=1e-3)
    if name == "adam":
        return torch.optim.Adam(params, lr=lr / 10)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr / 10, weight_decay=1e-2)
    raise ValueError(name)


def loss_fn(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(model(x), y)


def reference_train(opt_name: str, steps: int, unused: bool = False, passes: int = 1,
                    scheduler: bool = False, with_optimizer: bool = False):
    """Single-process training on the full (concatenated) batch."""
    model = make_model(unused)
    opt = make_optimizer(opt_name, model.parameters())
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7) if scheduler else None
    for step in range(steps):
        opt.zero_grad()
        x, y = batch(step)
        for p in range(passes):
            loss_fn(model, shard(x, p, passes), shard(y, p, passes)).div(passes).backward()
        opt.step()
        if sched:
            sched.step()
    params = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return (params, opt.state_dict()) if with_optimizer else params


def say(rank: int, *parts: object) -> None:
    sys.stdout.write(f"@{rank} " + " ".join(str(p) for p in parts) + "\n")
    sys.stdout.flush()


@contextlib.contextmanager
def case(rank: int, name: str) -> Iterator[None]:
    """One case of a launch that several run in turn: ``CASE name`` before it and ``CASE-DONE name`` after,
    so that a launch that fails says which case broke on which rank (``tests/mpirun.py: MPIRun.broken``)."""
    say(rank, "CASE", name)
    yield
    say(rank, "CASE-DONE", name)


def key_bytes(engine) -> tuple[int, int]:
    """The bytes of an engine's keys on the wire, and of the same elements at the model's own precision
    (what an uncompressed run sends)."""
    wire = full = 0
    for group in engine.groups:
        for key in group.keys:
            elements = key.nbytes // torch.empty(0, dtype=getattr(torch, key.dtype)).element_size()
            wire += key.nbytes
            full += elements * group.flat.element_size()
    return wire, full
