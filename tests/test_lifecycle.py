"""DistributedOptimizer's lifecycle: schedulers built before wrapping, close()/with, set_backward_passes_per_step."""

import torch
from common import reference_train


def max_diff(a: dict, b: dict) -> float:
    return max((a[k] - b[k]).abs().max().item() for k in b)


def test_lifecycle(loop_job):
    """``scripts/lifecycle.py`` runs in the shared 2 worker + 1 server job (conftest ``loop_job``)."""
    out, run = loop_job["lifecycle"], loop_job["run"]
    # An LR scheduler patched optimizer.step before wrapping: the steps still average over workers.
    assert max_diff(torch.load(str(out).format(case="scheduler")), reference_train("sgd", 4, scheduler=True)) <= 1e-5
    # close() (the end of the with-block) gives back the plain optimizer class.
    assert run.lines(0, "after close:") == ["SGD Optimizer"]
    assert max_diff(torch.load(str(out).format(case="accumulation")), reference_train("sgd", 4)) <= 1e-5
