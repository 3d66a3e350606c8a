"""Misuse cases; each must end with a clear exception on the affected workers, never a hang.

Usage: python bad_input.py CASE[,CASE...]   (CASE: too_many_servers | mismatch | int_param | zero_grad_in_flight
| dtype_change; several cases run in turn in one job, each line says its case; exit code 3 if any raised)
"""

import sys

import torch
from common import say

import imerge_hooks as imh


def run(case: str) -> None:
    if case == "too_many_servers":
        imh.init(num_servers=2)
    imh.init()
    rank = imh.rank()
    if case == "mismatch":
        width = 8 if rank == 0 else 9  # worker 1 builds a different model
        model = torch.nn.Sequential(torch.nn.Linear(4, width), torch.nn.Linear(width, 2))
        imh.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                 named_parameters=model.named_parameters())
    elif case == "int_param":
        weight = torch.nn.Parameter(torch.ones(3))
        counts = torch.zeros(3, dtype=torch.int64)
        imh.DistributedOptimizer(torch.optim.SGD([weight, counts], lr=0.1), named_parameters=[("weight", weight),
                                                                                      ("counts", counts)])
    elif case == "zero_grad_in_flight":
        model = torch.nn.Linear(4, 2)
        opt = imh.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                       named_parameters=model.named_parameters(), schedule="wfbp")
        model(torch.ones(1, 4)).sum().backward()
        opt.zero_grad()
        opt.step()
    elif case == "dtype_change":  # the model is converted after the optimizer was wrapped
        model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
        opt = imh.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                       named_parameters=model.named_parameters())
        for step in range(4):
            if step == 2:
                model.double()
            opt.zero_grad()
            model(torch.ones(2, 4, dtype=next(model.parameters()).dtype)).sum().backward()
            opt.step()


failed = False
for case in sys.argv[1].split(","):  # cases refused locally share a job; each says what happened
    try:
        run(case)
        say(0, case, "NO ERROR")
    except Exception as exc:  # noqa: BLE001
        say(0, case, f"ERROR {type(exc).__name__}: {exc}".replace("\n", " "))
        failed = True
sys.exit(3 if failed else 0)
