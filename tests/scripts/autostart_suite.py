"""A suite whose first test starts IMerge through ``DistributedOptimizer`` (no ``init()`` call), run on
every rank by ``pytest_job.py`` with 2 workers + 1 server. The server serves inside the first test and
its process ends there; the workers go on. Each test a rank runs says so (``@<rank> RAN <test>``)."""

import os

import torch

import imerge_hooks as imh

RANK = os.environ.get("PMI_RANK", os.environ.get("OMPI_COMM_WORLD_RANK", "?"))


def ran(name: str) -> None:
    print(f"\n@{RANK} RAN {name}", flush=True)  # on a line of its own, after pytest's progress dots


def test_the_optimizer_starts_imerge_and_trains():
    ran("optimizer")
    model = torch.nn.Linear(4, 2)
    opt = imh.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(), schedule="wfbp")
    assert not imh.is_server()
    for _ in range(2):
        opt.zero_grad()
        model(torch.ones(2, 4) * (imh.rank() + 1)).sum().backward()
        opt.step()
    assert torch.allclose(model.weight.grad, torch.full((2, 4), 3.0))  # the average of 2 and 4


def test_cross_ranks_are_known_locally_after_an_automatic_start():
    ran("cross")
    if imh.rank() == 0:  # one worker alone: a collective behind it would wait for the other until the timeout
        assert (imh.cross_rank(), imh.cross_size(), imh.is_homogeneous()) == (0, 1, True)
