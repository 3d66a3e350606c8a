"""A :class:`ModelSpec` measured on this machine: per-layer forward and backward times of a PyTorch model.

The method is ``benchmarks/make_profiles.py``'s gap attribution, on this process's CPU (wall clock):
layers are the modules that own parameters directly, in registration order; a forward hook marks the
end of each layer's forward, so parameter-free work between two layers (activations, pooling, adds)
counts to the next one; post-accumulate-grad hooks mark when each layer's gradients are ready, so the
backward between two ready times counts to the later one. Each time is the median over the timed
iterations. ``profile_torchvision`` does it for a torchvision classifier on random images.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

from .specs import LayerSpec, ModelSpec


def _param_layers(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    return [(name, m) for name, m in model.named_modules() if any(True for _ in m.parameters(recurse=False))]


def profile_module(model: torch.nn.Module, inputs: torch.Tensor, targets: torch.Tensor,
                   loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None, *, warmup: int = 1,
                   iters: int = 2, name: str = "model") -> ModelSpec:
    """Time ``iters`` training iterations (forward, loss, backward; no update) of ``model`` on ``inputs``
    after ``warmup`` untimed ones; the batch size is ``inputs``' first dimension.

    ValueError if the forward does not run every parameterised layer once, in registration order (the
    simulator replays layers in that order)."""
    if iters < 1 or warmup < 0:
        raise ValueError(f"IMerge profile_module: iters must be >= 1 and warmup >= 0, got {iters}, {warmup}")
    loss_fn = loss_fn or torch.nn.functional.cross_entropy
    layers = _param_layers(model)
    if not layers:
        raise ValueError(f"IMerge profile_module: {name} has no parameters")
    names = [n for n, _ in layers]
    fwd_marks: list[tuple[str, float]] = []
    ready: dict[str, float] = {}
    handles = []
    for lname, module in layers:
        handles.append(module.register_forward_hook(
            lambda _m, _i, _o, lname=lname: fwd_marks.append((lname, time.perf_counter()))))
        for p in module.parameters(recurse=False):
            handles.append(p.register_post_accumulate_grad_hook(
                lambda _p, lname=lname: ready.__setitem__(lname, time.perf_counter())))  # the layer's last
    forward: dict[str, list[float]] = {n: [] for n in names}
    backward: dict[str, list[float]] = {n: [] for n in names}
    model.train()
    try:
        for it in range(warmup + iters):
            fwd_marks.clear()
            ready.clear()
            model.zero_grad(set_to_none=True)
            start = time.perf_counter()
            loss = loss_fn(model(inputs), targets)
            fwd_end = time.perf_counter()
            loss.backward()
            bwd_end = time.perf_counter()
            if [n for n, _ in fwd_marks] != names:
                raise ValueError(f"IMerge profile_module: the forward of {name} does not run each parameterised "
                                 f"layer once in registration order")
            if it < warmup:
                continue
            previous = start
            for lname, mark in fwd_marks:
                forward[lname].append(mark - previous)
                previous = mark
            forward[names[-1]][-1] += fwd_end - previous  # the loss
            previous = fwd_end
            order = sorted(names, key=ready.__getitem__)
            for lname in order:
                backward[lname].append(ready[lname] - previous)
                previous = ready[lname]
            backward[order[-1]][-1] += bwd_end - previous
    finally:
        for h in handles:
            h.remove()
    specs = [LayerSpec(name=lname, param_bytes=[p.numel() * p.element_size() for p in module.parameters(recurse=False)],
                       forward_s=statistics.median(forward[lname]), backward_s=statistics.median(backward[lname]))
             for lname, module in layers]
    return ModelSpec(layers=specs, batch_size=int(inputs.shape[0]), name=name)


def torchvision_models() -> list[str]:
    """The classification models torchvision can build here."""
    import torchvision

    return sorted(torchvision.models.list_models(module=torchvision.models))


def profile_torchvision(name: str, batch_size: int, image_size: int = 224, *, warmup: int = 1,
                        iters: int = 2) -> ModelSpec:
    """Profile ``torchvision.models.<name>`` (random weights, 1000 classes, fp32) on random images on this CPU."""
    import torchvision

    if name not in torchvision_models():
        raise ValueError(f"IMerge profile_torchvision: unknown torchvision model {name!r}")
    torch.manual_seed(0)
    model = torchvision.models.get_model(name, weights=None, num_classes=1000)
    inputs = torch.randn(batch_size, 3, image_size, image_size)
    targets = torch.randint(0, 1000, (batch_size,))
    return profile_module(model, inputs, targets, warmup=warmup, iters=iters, name=name)
