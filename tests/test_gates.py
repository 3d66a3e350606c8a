"""Forward gates (imerge_hooks.worker.gates): where each parameter's deferred update is applied."""

import contextlib
import copy
import io
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from imerge_hooks.worker.gates import LEARNING_ITERATIONS, GateLearner
from imerge_hooks.worker.read_guard import AccessGuard


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


class _FakeEngine:
    """What AccessGuard asks of an engine: apply a pending parameter on fetch, take zero_grad of pending ones."""

    def __init__(self, pending):
        self.pending = {id(p) for p in pending}
        self.applied = []
        self.zeroed = []

    def on_fetch(self, param, reason):
        if id(param) in self.pending:
            self.pending.discard(id(param))
            self.applied.append(reason)

    def zero_pending(self, params, set_to_none):
        taken = {id(p) for p in params if id(p) in self.pending}
        self.zeroed += [set_to_none] * len(taken)
        return taken


def test_access_guard_applies_a_pending_parameter_before_user_code_reads_it():
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    engine = _FakeEngine([model[0].weight])
    AccessGuard.retain()
    AccessGuard.activate(engine)
    try:
        _ = model[0].weight
    finally:
        AccessGuard.deactivate(engine)
        AccessGuard.release()
    assert engine.applied == ["a read of Linear.weight"]
    assert nn.Module.__getattr__ is AccessGuard.original(nn.Module, "__getattr__")
    _ = model[0].bias  # not pending: nothing
    assert engine.applied == ["a read of Linear.weight"]


@pytest.mark.parametrize("read,reason", [
    (lambda m: next(m.parameters()), "Module.parameters()/named_parameters()"),
    (lambda m: m.state_dict(), "Module.state_dict()"),
    (lambda m: m.load_state_dict(m.state_dict()), "Module.state_dict()"),
    (lambda m: copy.deepcopy(m), "copy.deepcopy()"),
    (lambda m: torch.save(m, io.BytesIO()), "pickling a Parameter (torch.save of a module)"),
])
def test_every_way_to_read_parameters_applies_them_first(read, reason):
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    first = model[0].weight
    engine = _FakeEngine(list(model.parameters()))
    AccessGuard.retain()
    AccessGuard.activate(engine)
    try:
        read(model)
        assert id(first) not in engine.pending  # the first parameter was brought up to date before the read
        assert engine.applied[0] == reason
    finally:
        AccessGuard.deactivate(engine)
        AccessGuard.release()
    assert nn.Module.state_dict is not None and nn.Module.named_parameters is AccessGuard.original(
        nn.Module, "named_parameters")


def test_next_parameters_applies_only_the_parameter_it_yields():
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    engine = _FakeEngine(list(model.parameters()))
    AccessGuard.retain()
    AccessGuard.activate(engine)
    try:
        next(model.parameters())
    finally:
        AccessGuard.deactivate(engine)
        AccessGuard.release()
    assert len(engine.applied) == 1 and len(engine.pending) == 3


def test_module_zero_grad_leaves_pending_gradients_to_the_engine():
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    model(torch.ones(1, 2)).sum().backward()
    engine = _FakeEngine([model[0].weight])
    AccessGuard.retain()
    AccessGuard.activate(engine)
    try:
        model.zero_grad()
    finally:
        AccessGuard.deactivate(engine)
        AccessGuard.release()
    assert engine.zeroed == [True] and engine.applied == []  # no update was forced
    assert model[0].weight.grad is not None  # the engine clears it after the update
    assert all(p.grad is None for p in list(model.parameters())[1:])


def test_warnings_raised_while_learning_point_at_the_users_line():
    model = nn.Sequential(nn.Linear(2, 2))
    learner = GateLearner(list(model.parameters()))

    class Warns(nn.Module):
        def forward(self, x):
            return torch.nn.functional.softmax(x)  # implicit dim: torch warns (stacklevel 2: this line)

    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            Warns()(model(torch.ones(1, 2)))
    finally:
        learner.close()
    assert caught and all(w.filename == __file__ for w in caught), [(w.filename, w.lineno) for w in caught]


class Net(nn.Module):
    """An eager parent around a block; ``aside`` holds modules it calls without registering them."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 8)
        self.block = nn.Sequential(nn.Linear(8, 8), nn.ReLU())
        self.out = nn.Linear(8, 2)
        self.aside: list[nn.Module] = []
        self.around_aside = None  # a context manager the forward enters around the ``aside`` modules

    def forward(self, x):
        h = self.block(self.inp(x))
        for module in self.aside:
            with self.around_aside or contextlib.nullcontext():
                h = module(h)
        return self.out(h)


def _compile(form: str, net: Net, backend) -> nn.Module:
    if form == "torch.compile(model)":
        return torch.compile(net, backend=backend)
    if form == "torch.compile(block)":
        net.block = torch.compile(net.block, backend=backend)
    elif form == "block.compile()":
        net.block.compile(backend=backend)
    elif form == "torch.compile(unregistered)":
        net.aside.append(torch.compile(nn.Linear(8, 8), backend=backend))
    return net


@pytest.mark.parametrize("form,name", [
    ("torch.compile(model)", "Net, compiled with torch.compile(module)"),
    ("torch.compile(block)", "Net.block, compiled with torch.compile(module)"),
    ("block.compile()", "Net.block, compiled with Module.compile()"),
    ("torch.compile(unregistered)", "Linear, compiled with torch.compile(module)"),
])
def test_dynamo_never_traces_the_learners_mode(form, name):
    """Whatever is compiled, dynamo starts no compile with the learner's mode on the stack (it would trace
    the learner's bookkeeping, or guard on the mode and recompile when learning ends)."""
    torch._dynamo.reset()
    graphs, modes_at_compile = [], []

    def backend(gm, _inputs):
        graphs.append(gm)
        return gm.forward

    def on_compile(_args):
        modes_at_compile.append([type(m).__name__ for m in torch.overrides._get_current_function_mode_stack()])

    torch.manual_seed(0)
    model = _compile(form, Net(), backend)
    learner = GateLearner(list(model.parameters()))
    torch._dynamo.callback_handler.register_start_callback(on_compile)
    try:
        counts = []
        for _ in range(LEARNING_ITERATIONS + 2):
            model(torch.randn(3, 4)).sum().backward()
            assert torch._C._len_torch_function_stack() == 0
            learner.end_iteration()
            counts.append(len(graphs))
    finally:
        torch._dynamo.callback_handler.remove_start_callback(on_compile)
        learner.close()
    assert modes_at_compile and all("_FirstUseMode" not in modes for modes in modes_at_compile), modes_at_compile
    assert counts[0] > 0 and counts == [counts[0]] * len(counts), counts  # learning recompiled nothing
    assert learner.learned and learner.compiled == name


class UserMode(TorchFunctionMode):
    """Counts ops; notes the mode stack (by type) as it exits."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0
        self.stack_at_exit: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        return func(*args, **(kwargs or {}))

    def __exit__(self, *exc):
        self.stack_at_exit = [type(m).__name__ for m in torch.overrides._get_current_function_mode_stack()]
        return super().__exit__(*exc)


def test_a_suspended_mode_returns_below_the_users_own():
    """The learner takes its mode off the stack around a compiled module met inside an eager forward and
    puts it back where it was: under a mode the user's forward entered before that call, which then exits."""
    torch._dynamo.reset()
    net = _compile("torch.compile(unregistered)", Net(), "eager")
    user = net.around_aside = UserMode()
    learner = GateLearner(list(net.parameters()))
    try:
        with UserMode() as outer:
            net(torch.randn(3, 4))
            assert torch.overrides._get_current_function_mode_stack() == [outer]
    finally:
        learner.close()
    assert user.stack_at_exit == ["UserMode", "_FirstUseMode", "UserMode"] and user.ops > 0, user.stack_at_exit
    assert learner.compiled == "Linear, compiled with torch.compile(module)"
    assert torch._C._len_torch_function_stack() == 0
