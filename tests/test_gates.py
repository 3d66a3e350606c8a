"""Forward gates (imerge_hooks.gates): where each parameter's deferred update is applied."""

import torch
import torch.nn.functional as F
from torch import nn

from imerge_hooks.gates import LEARNING_ITERATIONS, AccessGuard, GateLearner


class Parent(nn.Module):
    """Uses its child's weight functionally, without calling the child."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x):
        return F.linear(x, self.proj.weight, self.proj.bias)


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(8, 11, bias=False)  # registered first, tied to the embedding
        self.embed = nn.Embedding(11, 8)
        self.embed.weight = self.head.weight
        self.attn = nn.MultiheadAttention(8, 2, batch_first=True)
        self.parent = Parent()
        self.block = nn.Linear(8, 8)  # called twice
        self.outside = nn.Parameter(torch.ones(8))  # used outside every module forward
        self.unused = nn.Linear(8, 8)

    def forward(self, tokens):
        h = self.embed(tokens)
        h = self.attn(h, h, h, need_weights=False)[0]
        h = self.block(self.block(self.parent(h)))
        return self.head(h)


def learn(model: Model) -> tuple[dict[str, str], set[str]]:
    names = [n for n, _ in model.named_parameters()]
    params = [p for _, p in model.named_parameters()]
    learner = GateLearner(params)
    tokens = torch.randint(0, 11, (2, 5))
    for _ in range(LEARNING_ITERATIONS):
        out = model(tokens).sum(-1) * model.outside[:5]
        out.sum().backward()
        learner.end_iteration()
    assert learner.learned
    by_module, modules, ungated = learner.gates()
    learner.close()
    gates = {names[i]: type(modules[m]).__name__ for m, indices in by_module.items() for i in indices}
    return gates, {names[i] for i in ungated}


def test_gates_follow_first_use_not_registration():
    gates, ungated = learn(Model())
    assert gates["head.weight"] == "Embedding"  # tied: first used by the embedding
    assert gates["attn.out_proj.weight"] == "MultiheadAttention"  # out_proj is never called
    assert gates["attn.in_proj_weight"] == "MultiheadAttention"
    assert gates["parent.proj.weight"] == "Parent"
    assert gates["block.weight"] == "Linear"
    assert ungated == {"outside", "unused.weight", "unused.bias"}  # applied at step(), never deferred


def test_learning_stops_recording_after_close():
    model = nn.Linear(4, 4)
    learner = GateLearner(list(model.parameters()))
    learner.close()
    model(torch.ones(1, 4))
    learner.end_iteration()
    assert learner.iterations == 0


class Use(nn.Module):
    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.shared = [weight]  # not registered here

    def forward(self, x):
        return F.linear(x, self.shared[0])


def test_gate_that_changes_between_iterations_is_dropped():
    a = nn.Linear(4, 4)
    learner = GateLearner([a.weight])
    a(torch.ones(1, 4))
    learner.end_iteration()
    Use(a.weight)(torch.ones(1, 4))  # first used in another module this time
    learner.end_iteration()
    _, _, ungated = learner.gates()
    learner.close()
    assert ungated == {0}


def test_access_guard_applies_a_pending_parameter_before_user_code_reads_it():
    model = nn.Sequential(nn.Linear(2, 2))
    weight = model[0].weight
    applied = []
    pending = {id(weight)}

    def on_fetch(t):
        if id(t) in pending:
            pending.discard(id(t))
            applied.append("fetch")

    def flush():
        applied.append("flush")

    AccessGuard.activate(on_fetch, flush)
    try:
        _ = model[0].weight
        list(model.parameters())
    finally:
        AccessGuard.deactivate(on_fetch, flush)
    assert applied == ["fetch", "flush"]
    assert nn.Module.__getattr__ is AccessGuard._original_getattr
    _ = model[0].weight
    assert applied == ["fetch", "flush"]
