"""Awkward but legal models, trained with IMerge and (in-process) as the single-process reference.

Mixed dtypes in one model, a weight used transposed (non-contiguous gradient), a parameter
that gets a gradient on even steps only, a layer frozen for the first steps and unfrozen
later (a plan epoch change), and zero_grad alternating set_to_none=True/False.

Usage: python matrix.py OUT SCHEDULE            (worker 0 saves the final state_dict)
       python matrix.py sparse                  (must fail clearly)
"""

import sys

import torch
from torch import nn

FULL = 12


class Awkward(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 8).double()
        self.frozen_then_trained = nn.Linear(8, 8).double()
        self.b32 = nn.Linear(8, 8)  # float32 inside a float64 model
        self.tw = nn.Parameter(torch.randn(5, 8, dtype=torch.float64) * 0.1)  # used transposed
        self.sometimes = nn.Linear(5, 5).double()

    def forward(self, x: torch.Tensor, step: int) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        h = torch.tanh(self.frozen_then_trained(h))
        h = torch.tanh(self.b32(h.float())).double()
        h = h @ self.tw.t()
        if step % 2 == 0:
            h = self.sometimes(h)
        return h


def data(step: int):
    g = torch.Generator().manual_seed(step)
    return torch.randn(FULL, 6, generator=g, dtype=torch.float64), torch.randn(FULL, 5, generator=g,
                                                                               dtype=torch.float64)


def train(rank: int, world: int, wrap=None, steps: int = 6):
    torch.manual_seed(7)
    model = Awkward()
    model.frozen_then_trained.requires_grad_(False)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.5)
    if wrap is not None:
        opt = wrap(opt, model)
    per = FULL // world
    for step in range(steps):
        if step == 3:
            model.frozen_then_trained.requires_grad_(True)
        opt.zero_grad(set_to_none=step % 2 == 0)
        x, y = data(step)
        x, y = x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]
        nn.functional.mse_loss(model(x, step), y).backward()
        opt.step()
    return model


if __name__ == "__main__":
    sys.path.insert(0, __file__.rsplit("/", 1)[0])
    from common import say

    import imerge_hooks as imh

    imh.init()
    if sys.argv[1] == "sparse":
        emb = nn.Embedding(10, 4, sparse=True)
        opt = imh.DistributedOptimizer(torch.optim.SGD(emb.parameters(), lr=0.1),
                                       named_parameters=emb.named_parameters(), schedule="wfbp")
        try:
            emb(torch.tensor([1, 2])).sum().backward()
            opt.step()
            say(imh.rank(), "NO ERROR")
        except Exception as exc:  # noqa: BLE001
            say(imh.rank(), f"ERROR {type(exc).__name__}: {exc}")
            sys.exit(3)
    else:
        out, schedule = sys.argv[1], sys.argv[2]
        model = train(imh.rank(), imh.size(), lambda opt, m: imh.DistributedOptimizer(
            opt, named_parameters=m.named_parameters(), schedule=schedule, profile_steps=2))
        if imh.rank() == 0:
            torch.save(model.state_dict(), out)
        say(imh.rank(), "done")
