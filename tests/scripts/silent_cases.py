"""Cases that used to give wrong parameters with exit code 0; each now trains as torch or raises.

Usage: python silent_cases.py OUT   (OUT has {case}; W=2 workers)
Trains the no-error cases and saves each final state; the mismatch cases print the error.
"""

import sys

import torch
from common import batch, loss_fn, make_model, make_optimizer, say, shard
from common import case as marked

import imerge_hooks as imh
from imerge_hooks import IMergeMismatchError

STEPS = 8


def loop(opt, model, rank: int, world: int, case: str, out: str) -> None:
    """The loops of test_silent_cases.reference, distributed."""
    for step in range(STEPS):
        if case.startswith("freeze") and step == 4:
            model.fc1.requires_grad_(False)
            if rank == 0:  # state_dict() applies pending updates first
                torch.save({"fc1.weight": model.state_dict()["fc1.weight"].clone()},
                           out.format(case=f"{case}-at-freeze"))
        opt.zero_grad()
        if case.startswith("no-backward") and step == 5:
            opt.step()  # step() without a backward: nothing may move
            continue
        x, y = batch(step)
        loss_fn(model, shard(x, rank, world), shard(y, rank, world)).backward()
        if case.startswith("zero-before-step") and step == 5:
            opt.zero_grad()  # discards this step's gradients: nothing may move
        opt.step()


def train_case(out: str, case: str, schedule: str) -> None:
    rank, world = imh.rank(), imh.size()
    model = make_model()
    opt = imh.DistributedOptimizer(make_optimizer("sgd", model.parameters()),
                                   named_parameters=model.named_parameters(), schedule=schedule, profile_steps=3)
    loop(opt, model, rank, world, case, out)
    if rank == 0:
        torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, out.format(case=case))
    opt.close()


def mismatch_case(case: str) -> None:
    rank = imh.rank()
    if case == "order":  # no names: worker 1 lists the parameters in another order
        model = make_model()
        params = list(model.parameters())
        if rank == 1:
            params[0], params[2] = params[2], params[0]
        kwargs = {}
    else:  # a layer with the same number of elements but another shape on worker 1
        model = torch.nn.Sequential(torch.nn.Linear(8, 4) if rank == 0 else torch.nn.Linear(4, 8))
        params, kwargs = list(model.parameters()), {"named_parameters": model.named_parameters()}
    try:
        imh.DistributedOptimizer(torch.optim.SGD(params, lr=0.1), schedule="wfbp", **kwargs)
    except IMergeMismatchError as exc:
        say(rank, f"MISMATCH {case}:", str(exc).replace("\n", " "))
    else:
        say(rank, f"NO ERROR {case}")


def run_all(out: str) -> None:
    """Every case in turn (``scripts/around_loop.py`` runs them after its own, in the same job)."""
    for case, schedule in [("freeze-wfbp", "wfbp"), ("freeze-imerge", "imerge"), ("no-backward-wfbp", "wfbp"),
                           ("no-backward-imerge", "imerge"), ("zero-before-step-default", "default")]:
        with marked(imh.rank(), f"silent_cases:{case}"):
            train_case(out, case, schedule)
    for case in ("order", "shape"):
        with marked(imh.rank(), f"silent_cases:{case}"):
            mismatch_case(case)
    say(imh.rank(), "DONE")


if __name__ == "__main__":
    imh.init()
    run_all(sys.argv[1])
