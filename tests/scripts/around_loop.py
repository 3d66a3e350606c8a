"""What users do around the training loop, under the default (overlapped) schedule.

Usage: python around_loop.py OUT [MODULE=OUT ...]   (OUT has {case}; W=2 workers + 1 server; each
MODULE=OUT runs that script's cases next in the same job: ``MODULE.run_all(OUT)``)
Each case trains STEPS steps of ``worker_loss`` and saves, on every worker, the final state plus what
the case reads along the way; ``reference`` replays the same loop in one process on every worker's
shard (the average of the workers' losses), which is what data-parallel training must equal.
"""

from __future__ import annotations

import importlib
import json
import sys
from collections.abc import Callable

import torch
from common import batch, case, make_model, say, shard
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook

STEPS = 10
UNFREEZE_AT = 5
CASES = ["checkpoint", "ema", "clip-in-step", "step-hooks", "hf-order", "zero-gradient", "moe-unfreeze", "compile",
         "compile-wrapper", "compile-block", "compile-block-method"]
# How each compile case compiles (the reference trains the same module eagerly):
# "compile": model.compile(); "compile-wrapper": model = torch.compile(model); "compile-block": a block
# wrapped by torch.compile with the default backend (inductor) in an eager parent; "compile-block-method":
# block.compile() in an eager parent. All but the inductor one count their graphs with their own backend.
COMPILED = {"compile": "model.compile()", "compile-wrapper": "torch.compile(model)",
            "compile-block": "torch.compile(model.fc1), inductor", "compile-block-method": "model.conv2.compile()"}


class ClipInStep(torch.optim.SGD):
    """A user's optimizer that clips the global norm inside its own step()."""

    def step(self, closure=None):
        params = [p for g in self.param_groups for p in g["params"] if p.grad is not None]
        self.norms.append(float(torch.nn.utils.clip_grad_norm_(params, 0.5)))
        return super().step(closure)


def make(case: str) -> tuple[nn.Module, torch.optim.Optimizer]:
    model = make_model()
    model.extra = nn.Linear(10, 10).to(torch.float64)  # an expert / branch that not every worker uses
    if case == "moe-unfreeze":
        model.extra.requires_grad_(False)
    if case == "clip-in-step":
        opt = ClipInStep(model.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-3)
        opt.norms = []
    else:
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-3)
    return model, opt


def worker_loss(case: str, model: nn.Module, step: int, rank: int, world: int) -> torch.Tensor:
    x, y = batch(step)
    out = model(shard(x, rank, world))
    loss = nn.functional.cross_entropy(out, shard(y, rank, world))
    if case == "zero-gradient" and rank == 0:
        loss = loss + 0.0 * model.extra(out).sum()  # an exactly-zero gradient, on worker 0 only
    if case == "moe-unfreeze" and rank == 0:
        loss = loss + 0.1 * model.extra(out).pow(2).mean()  # the expert only worker 0's tokens pick
    return loss


def before_step(case: str, model: nn.Module, step: int) -> None:
    if case == "moe-unfreeze" and step == UNFREEZE_AT:
        model.extra.requires_grad_(True)


def reference(case: str, world: int) -> dict:
    """Single process: each step's gradient is the average of the workers' losses' gradients."""
    model, opt = make(case)
    ema = {k: v.detach().clone() for k, v in model.state_dict().items()}
    ema_by_parameters = torch.optim.swa_utils.AveragedModel(
        model, multi_avg_fn=torch.optim.swa_utils.get_ema_multi_avg_fn(0.9))
    states = []
    for step in range(STEPS):
        before_step(case, model, step)
        opt.zero_grad()
        (sum(worker_loss(case, model, step, r, world) for r in range(world)) / world).backward()
        opt.step()
        states.append({k: v.detach().clone() for k, v in model.state_dict().items()})
        for k, v in model.state_dict().items():
            ema[k].mul_(0.9).add_(v, alpha=0.1)
        ema_by_parameters.update_parameters(model)
    return {"final": states[-1], "states": states, "ema": ema, "norms": getattr(opt, "norms", []),
            "ema_parameters": {n: p.detach().clone() for n, p in ema_by_parameters.module.named_parameters()}}


def compile_model(case: str, model: nn.Module) -> tuple[nn.Module, Callable[[], int]]:
    """Compile ``model`` (or one of its blocks) as ``case`` says; returns it and a count of graphs compiled."""
    if case not in COMPILED:
        return model, lambda: 0
    if case == "compile-block":  # the default backend: count dynamo's graphs
        from torch._inductor import config as inductor_config

        inductor_config.compile_threads = 1  # no compile worker processes forked from an MPI rank
        start = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        model.fc1 = torch.compile(model.fc1)
        return model, lambda: torch._dynamo.utils.counters["stats"]["unique_graphs"] - start
    graphs = []

    def backend(gm, _inputs):
        graphs.append(len(graphs))
        return gm.forward

    if case == "compile":
        model.compile(backend=backend)
    elif case == "compile-wrapper":
        model = torch.compile(model, backend=backend)
    else:
        model.conv2.compile(backend=backend)
    return model, lambda: len(graphs)


def train(case: str, out: str) -> None:
    import imerge_hooks as imh

    rank, world = imh.rank(), imh.size()
    model, opt = make(case)
    counts = {"pre": 0, "post": 0, "global": 0, "params_seen": set()}
    handles = []
    if case == "step-hooks":
        def post(o, *_):
            counts["post"] += 1
            counts["params_seen"].add(sum(len(g["params"]) for g in o.param_groups))

        handles = [opt.register_step_pre_hook(lambda *_: counts.__setitem__("pre", counts["pre"] + 1)),
                   opt.register_step_post_hook(post),
                   register_optimizer_step_post_hook(
                       lambda *_: counts.__setitem__("global", counts["global"] + 1))]
    model, compiles = compile_model(case, model)
    opt = imh.DistributedOptimizer(opt, named_parameters=model.named_parameters(), profile_steps=3)
    ema = {k: v.detach().clone() for k, v in model.state_dict().items()}
    ema_by_parameters = torch.optim.swa_utils.AveragedModel(
        model, multi_avg_fn=torch.optim.swa_utils.get_ema_multi_avg_fn(0.9))
    states = []
    for step in range(STEPS):
        before_step(case, model, step)
        if case != "hf-order":
            opt.zero_grad()
        worker_loss(case, model, step, rank, world).backward()
        opt.step()
        if case == "hf-order":
            model.zero_grad()  # Hugging Face Trainer's order: after step()
        if case == "checkpoint":
            states.append({k: v.detach().clone() for k, v in model.state_dict().items()})  # right after step()
        if case == "ema":
            for k, v in model.state_dict().items():  # timm's ModelEma reads state_dict()
                ema[k].mul_(0.9).add_(v, alpha=0.1)
            ema_by_parameters.update_parameters(model)  # torch's AveragedModel reads parameters()
        if case in COMPILED and step == 4:
            say(rank, "COMPILES_AFTER_LEARNING", case, compiles())
    engine = opt._imerge_engine
    say(rank, "APPLIED", case, json.dumps(dict(engine.applied_by)))
    if case in COMPILED:
        say(rank, "COMPILES_AT_END", case, compiles())
    if case == "step-hooks":
        say(rank, "HOOKS", json.dumps({k: (sorted(v) if isinstance(v, set) else v) for k, v in counts.items()}))
        for h in handles:
            h.remove()
    # torch.compile(module) wraps it: its state_dict keys carry "_orig_mod."; the reference's do not
    final = {k.replace("_orig_mod.", ""): v.detach().clone() for k, v in model.state_dict().items()}
    result = {"final": final, "states": states,
              "ema": ema, "norms": getattr(opt, "norms", [])}
    if case == "ema":
        result["ema_parameters"] = {n: p.detach().clone() for n, p in ema_by_parameters.module.named_parameters()}
    torch.save(result, out.format(case=f"{case}-rank{rank}"))
    opt.close()


def main() -> None:
    import imerge_hooks as imh

    imh.init()
    for name in CASES:
        with case(imh.rank(), f"around_loop:{name}"):
            train(name, sys.argv[1])
        say(imh.rank(), "DONE", name)
    for then in sys.argv[2:]:  # MODULE=OUT: another script's cases run next, in this job
        name, _, out = then.partition("=")
        with case(imh.rank(), name):
            importlib.import_module(name).run_all(out)


if __name__ == "__main__":
    main()
