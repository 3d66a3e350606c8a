"""The model zoo: model builders, per-step data, the cell matrices and the in-process reference trainer.

Shared by ``zoo_train.py`` / ``zoo_lightning.py`` (run under mpiexec) and ``tests/test_model_zoo.py``
(which trains every reference here, single-process on the full batch).

Every model is float64 (Adam and deep models amplify float32 summation noise), deterministic
(dropout 0 or eval mode) and seeded, so each worker builds the same model and a worker's
shard of a step's batch is a contiguous slice of the full batch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

DTYPE = torch.float64
Batch = tuple[tuple[Tensor, ...], Tensor]  # (model inputs, target)


# ---------------------------------------------------------------------- models
class Seq2Seq(nn.Module):
    """nn.Transformer encoder-decoder (1 layer each) that learns to reverse a token sequence."""

    def __init__(self, vocab: int = 12, d: int = 32) -> None:
        super().__init__()
        self.src_embed = nn.Embedding(vocab, d)
        self.tgt_embed = nn.Embedding(vocab, d)
        self.core = nn.Transformer(d, nhead=2, num_encoder_layers=1, num_decoder_layers=1, dim_feedforward=48,
                                   dropout=0.0, batch_first=True)
        self.out = nn.Linear(d, vocab)

    def forward(self, src: Tensor, tgt: Tensor) -> Tensor:
        mask = nn.Transformer.generate_square_subsequent_mask(tgt.shape[1], dtype=self.out.weight.dtype)
        h = self.core(self.src_embed(src), self.tgt_embed(tgt), tgt_mask=mask, tgt_is_causal=True)
        return self.out(h)


class TinyGPT(nn.Module):
    """Decoder-only LM with tied weights, the output head registered before the embedding."""

    def __init__(self, vocab: int = 16, d: int = 32, ctx: int = 8) -> None:
        super().__init__()
        self.head = nn.Linear(d, vocab, bias=False)
        self.embed = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.randn(ctx, d) * 0.1)  # owned by the root module
        self.block = nn.TransformerEncoderLayer(d, nhead=2, dim_feedforward=48, dropout=0.0, batch_first=True)
        self.norm = nn.LayerNorm(d)
        self.embed.weight = self.head.weight

    def forward(self, idx: Tensor) -> Tensor:
        length = idx.shape[1]
        mask = nn.Transformer.generate_square_subsequent_mask(length, dtype=self.pos.dtype)
        h = self.embed(idx) + self.pos[:length]
        h = self.block(h, src_mask=mask, is_causal=True)
        return self.head(self.norm(h))


class LSTMLM(nn.Module):
    """Two-layer LSTM language model."""

    def __init__(self, vocab: int = 16, d: int = 16, hidden: int = 24) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.lstm = nn.LSTM(d, hidden, num_layers=2, batch_first=True)
        self.out = nn.Linear(hidden, vocab)

    def forward(self, idx: Tensor) -> Tensor:
        h, _ = self.lstm(self.embed(idx))
        return self.out(h)


class Twice(nn.Module):
    """The same block applied twice in one forward."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.block = nn.Sequential(nn.Linear(16, 16), nn.Tanh())
        self.out = nn.Linear(16, 4)

    def forward(self, x: Tensor) -> Tensor:
        h = torch.tanh(self.inp(x))
        return self.out(self.block(self.block(h)))


class Checkpointed(nn.Module):
    """A block run through torch.utils.checkpoint (recomputed during backward)."""

    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.reentrant = reentrant
        self.inp = nn.Linear(8, 16)
        self.block = nn.Sequential(nn.Linear(16, 24), nn.Tanh(), nn.Linear(24, 16), nn.Tanh())
        self.out = nn.Linear(16, 4)

    def forward(self, x: Tensor) -> Tensor:
        h = torch.tanh(self.inp(x))  # requires grad: the reentrant variant needs a grad-requiring input
        h = checkpoint(self.block, h, use_reentrant=self.reentrant)
        return self.out(h)


class Functional(nn.Module):
    """The parent uses a child's weight through F.linear and never calls the child."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 16)
        self.out = nn.Linear(16, 4)

    def forward(self, x: Tensor) -> Tensor:
        h = torch.tanh(F.linear(x, self.proj.weight, self.proj.bias))
        return self.out(h)


class MoE(nn.Module):
    """Hard-routed mixture of experts: the route comes with the data; an expert with no sample is not called."""

    EXPERTS = 4

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.gate = nn.Linear(16, self.EXPERTS)
        self.experts = nn.ModuleList(nn.Linear(16, 16) for _ in range(self.EXPERTS))
        self.out = nn.Linear(16, 4)

    def forward(self, x: Tensor, route: Tensor) -> Tensor:
        h = torch.tanh(self.inp(x))
        weight = torch.softmax(self.gate(h), dim=1)
        mixed = torch.zeros_like(h)
        for e, expert in enumerate(self.experts):
            idx = (route == e).nonzero().squeeze(1)
            if idx.numel():
                mixed = mixed.index_add(0, idx, weight[idx, e:e + 1] * torch.tanh(expert(h[idx])))
        return self.out(h + mixed)


class FrozenBackbone(nn.Module):
    """A backbone frozen from the start (requires_grad=False) under a trainable head."""

    def __init__(self) -> None:
        super().__init__()
        self.backbone = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh())
        self.head = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))
        self.backbone.requires_grad_(False)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.backbone(x))


class MLP(nn.Module):
    """Three layers; ``mid`` is frozen and unfrozen during training."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(8, 16)
        self.mid = nn.Linear(16, 16)
        self.last = nn.Linear(16, 4)

    def forward(self, x: Tensor) -> Tensor:
        return self.last(torch.tanh(self.mid(torch.tanh(self.first(x)))))


def _vision(name: str) -> nn.Module:
    import torchvision

    model = getattr(torchvision.models, name)(num_classes=10)
    return model.eval()  # BatchNorm statistics frozen (gradients still flow), dropout off


# ---------------------------------------------------------------------- data
def _gen(seed: int, step: int) -> torch.Generator:
    return torch.Generator().manual_seed(1000 * seed + step)


def images(step: int, n: int = 6) -> Batch:
    g = _gen(1, step)
    return (torch.randn(n, 3, 32, 32, generator=g, dtype=DTYPE),), torch.randint(0, 10, (n,), generator=g)


def vectors(step: int, n: int = 12) -> Batch:
    g = _gen(2, step)
    return (torch.randn(n, 8, generator=g, dtype=DTYPE),), torch.randint(0, 4, (n,), generator=g)


def reverse_task(step: int, n: int = 12, length: int = 6, vocab: int = 12) -> Batch:
    """Source tokens 1..vocab-1; target: the source reversed; decoder input: BOS (0) + target[:-1]."""
    g = _gen(3, step)
    src = torch.randint(1, vocab, (n, length), generator=g)
    target = src.flip(1)
    tgt_in = torch.cat([torch.zeros(n, 1, dtype=torch.long), target[:, :-1]], dim=1)
    return (src, tgt_in), target


def next_token(step: int, n: int = 12, length: int = 8, vocab: int = 16) -> Batch:
    g = _gen(4, step)
    seq = torch.randint(0, vocab, (n, length + 1), generator=g)
    return (seq[:, :-1],), seq[:, 1:]


# 12 samples per step (W=2: 0-5 | 6-11; W=3: 0-3 | 4-7 | 8-11). Step 1: expert 3 only on the last
# worker; step 2: expert 2 unused by everyone; step 3: expert 0 unused on worker 0; step 4: experts
# 1 and 3 unused by everyone; then the table repeats.
ROUTES = (
    [0, 1, 2, 3] * 3,
    [0, 1, 2, 0, 1, 2, 0, 1, 3, 3, 2, 0],
    [0, 1, 3] * 4,
    [1, 2, 3, 1, 2, 3, 0, 0, 1, 2, 3, 0],
    [0, 2] * 6,
    [3, 2, 1, 0] * 3,
)


def routed(step: int) -> Batch:
    (x,), y = vectors(step)
    return (x, torch.tensor(ROUTES[step % len(ROUTES)])), y


def shard(batch: Batch, rank: int, world: int) -> Batch:
    """This worker's contiguous slice of every tensor of the batch."""
    inputs, target = batch
    per = target.shape[0] // world

    def cut(t: Tensor) -> Tensor:
        return t[rank * per:(rank + 1) * per]

    return tuple(cut(t) for t in inputs), cut(target)


def cross_entropy(logits: Tensor, target: Tensor) -> Tensor:
    """Mean over every sample (and token): the mean of equal shards' means is the full batch's."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


# ---------------------------------------------------------------------- specs
def _freeze_at(freeze: int, unfreeze: int) -> Callable[[nn.Module, int], None]:
    def on_step(model: nn.Module, step: int) -> None:
        if step == freeze:
            model.mid.requires_grad_(False)
        if step == unfreeze:
            model.mid.requires_grad_(True)

    return on_step


@dataclass(frozen=True)
class ModelSpec:
    """How to build, feed and train one zoo model."""

    build: Callable[[], nn.Module]
    batch: Callable[[int], Batch]
    steps: int = 6
    trainable_only: bool = False  # the optimizer gets only the parameters that require grad
    on_step: Callable[[nn.Module, int], None] | None = None  # called before each step's zero_grad


MODELS: dict[str, ModelSpec] = {
    "resnet18": ModelSpec(lambda: _vision("resnet18"), images, steps=5),
    "mobilenet": ModelSpec(lambda: _vision("mobilenet_v3_small"), images, steps=5),
    "transformer": ModelSpec(Seq2Seq, reverse_task),
    "gpt": ModelSpec(TinyGPT, next_token),
    "lstm": ModelSpec(LSTMLM, next_token),
    "twice": ModelSpec(Twice, vectors),
    "ckpt-reentrant": ModelSpec(lambda: Checkpointed(True), vectors),
    "ckpt-nonreentrant": ModelSpec(lambda: Checkpointed(False), vectors),
    "functional": ModelSpec(Functional, vectors),
    "moe": ModelSpec(MoE, routed),
    "frozen": ModelSpec(FrozenBackbone, vectors, trainable_only=True),
    # mid frozen at step 2 and unfrozen at 4: the profiling restarts after each change, so no plan
    # is reached. freeze-late: frozen at 4 while its deferred update of step 3 is pending, planned
    # again and deferring (steps 8, 9) while frozen, unfrozen at 10 while the update of step 9 is
    # pending, then planned and deferring again (steps 14, 15).
    "freeze": ModelSpec(MLP, vectors, on_step=_freeze_at(2, 4)),
    "freeze-late": ModelSpec(MLP, vectors, steps=16, on_step=_freeze_at(4, 10)),
}


def build(name: str) -> nn.Module:
    torch.manual_seed(1234)
    return MODELS[name].build().to(DTYPE)


def optimized_parameters(name: str, model: nn.Module) -> list[nn.Parameter]:
    params = list(model.parameters())
    return [p for p in params if p.requires_grad] if MODELS[name].trainable_only else params


OPTIMIZERS = ("sgd", "adam", "adamw-sched")


def make_optimizer(name: str, params: list[nn.Parameter]) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9, weight_decay=1e-3)
    if name == "adam":
        return torch.optim.Adam(params, lr=5e-3)
    if name == "adamw-sched":
        return torch.optim.AdamW(params, lr=1e-2, weight_decay=1e-2)
    raise ValueError(name)


def make_scheduler(name: str, opt: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler | None:
    """``adamw-sched``: the LR changes every iteration (scheduler stepped after each step)."""
    if name != "adamw-sched":
        return None
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1.0 + 0.5 * s))


def loss_of(model: nn.Module, batch: Batch) -> Tensor:
    inputs, target = batch
    return cross_entropy(model(*inputs), target)


def reference_train(name: str, opt_name: str, steps: int | None = None) -> dict[str, Tensor]:
    """Single-process training on the full (concatenated) batch: what every cell must reproduce."""
    spec = MODELS[name]
    model = build(name)
    opt = make_optimizer(opt_name, optimized_parameters(name, model))
    sched = make_scheduler(opt_name, opt)
    for step in range(spec.steps if steps is None else steps):
        if spec.on_step:
            spec.on_step(model, step)
        opt.zero_grad()
        loss_of(model, spec.batch(step)).backward()
        opt.step()
        if sched:
            sched.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


# ---------------------------------------------------------------------- the matrix
@dataclass(frozen=True)
class Cell:
    model: str
    schedule: str
    optimizer: str

    @property
    def id(self) -> str:
        return f"{self.model}-{self.schedule}-{self.optimizer}"


def _cells(rows: dict[str, list[tuple[str, str]]]) -> list[Cell]:
    return [Cell(model, schedule, opt) for model, pairs in rows.items() for schedule, opt in pairs]


# W=2 workers + 1 server: every model with default, imerge and a planned schedule.
MATRIX_W2 = _cells({
    "resnet18": [("imerge", "sgd"), ("default", "adam")],  # slow on CPU: two cells
    "mobilenet": [("imerge", "adam"), ("default", "sgd"), ("mgwfbp", "adamw-sched")],
    "transformer": [("imerge", "adam"), ("default", "sgd"), ("adaptive-ps", "adamw-sched"), ("priority", "sgd")],
    "gpt": [("imerge", "adamw-sched"), ("default", "adam"), ("threshold", "sgd"), ("wfbp", "adam")],
    "lstm": [("imerge", "sgd"), ("default", "adamw-sched"), ("mgwfbp", "adam"), ("priority", "adam")],
    "twice": [("imerge", "adam"), ("default", "sgd"), ("adaptive-ps", "sgd"), ("wfbp", "adamw-sched")],
    "ckpt-reentrant": [("imerge", "sgd"), ("default", "adam"), ("threshold", "adamw-sched")],
    "ckpt-nonreentrant": [("imerge", "adamw-sched"), ("default", "sgd"), ("mgwfbp", "adam")],
    "functional": [("imerge", "sgd"), ("default", "adam"), ("adaptive-ps", "sgd"), ("priority", "adamw-sched")],
    "moe": [("imerge", "adam"), ("imerge", "sgd"), ("default", "sgd"), ("threshold", "adam"), ("wfbp", "sgd")],
    "frozen": [("imerge", "adamw-sched"), ("default", "adam"), ("mgwfbp", "sgd")],
    "freeze": [("imerge", "sgd"), ("default", "adam"), ("adaptive-ps", "adamw-sched")],
    "freeze-late": [("imerge", "sgd"), ("imerge", "adam"), ("default", "sgd"), ("threshold", "adamw-sched")],
})

# W=3 workers + 2 servers: a few cells (five ranks on a small machine are slow).
MATRIX_W3 = _cells({
    "transformer": [("imerge", "adam"), ("default", "sgd")],
    "gpt": [("imerge", "sgd"), ("priority", "adamw-sched")],
    "lstm": [("threshold", "sgd")],
    "twice": [("imerge", "sgd")],
    "ckpt-reentrant": [("imerge", "adam")],
    "ckpt-nonreentrant": [("adaptive-ps", "adam")],
    "functional": [("imerge", "adam")],
    "moe": [("imerge", "sgd"), ("wfbp", "adam")],
    "frozen": [("imerge", "adamw-sched")],
    "freeze-late": [("imerge", "adam")],
})

MATRICES = {"w2": MATRIX_W2, "w3": MATRIX_W3}

# Lightning (W=2 + 1 server, tests/scripts/zoo_lightning.py): run id -> (model, optimizer, manual optimization)
LIGHTNING_RUNS: dict[str, tuple[str, str, bool]] = {
    "transformer-auto": ("transformer", "adam", False),
    "transformer-manual": ("transformer", "adamw-sched", True),
    "gpt-auto": ("gpt", "adamw-sched", False),
    "gpt-manual": ("gpt", "sgd", True),
}
