"""Compute replay: a model with real parameters and gradients whose compute is a profiled sleep.

``ReplayModel(profile, time_scale=1.0)`` builds an ``nn.Module`` from a profile written by
``benchmarks/make_profiles.py`` (``benchmarks/profiles/<model>-<device>.json``):

* one child module per profiled layer, at the same dotted path as in the real model
  (``layer1.0.conv1``), holding ``nn.Parameter`` s of exactly the profiled shapes and local names,
  so ``named_parameters()`` yields the real model's names, shapes and order (tensor sizes and
  names that IMerge's engine, planner, servers and wire protocol see are the real ones);
* ``forward(x)`` runs the layers in profile order; each one goes through a custom autograd
  function that *sleeps* ``forward_s * time_scale`` in forward and ``backward_s * time_scale`` in
  backward, so compute takes the profiled time without using the CPU, and 8-16 worker processes
  fit on two cores while every gradient byte still goes through the real engine, transport and
  servers;
* backward produces, for every parameter of the layer, a gradient of the parameter's shape and
  dtype: the scalar ``(grad_output * input).mean()`` expanded to the parameter's shape (no
  compute: autograd's accumulation writes it into ``.grad``, O(numel), or adds it into IMerge's
  flat-buffer views in place). With the usual ``loss = model(x).sum()`` every gradient element
  of every parameter equals ``x.mean()``, so averaging over workers fed different ``x`` is checkable.
  Autograd runs each layer's gradient accumulation (and so ``register_post_accumulate_grad_hook``)
  right after that layer's backward sleep, before the previous layer's: gradients become ready
  last layer first, at the profiled times.

CPU: run replay processes with one intra-op thread (``OMP_NUM_THREADS=1`` or
``torch.set_num_threads(1)``, which ``main`` below does): with more, OpenMP's worker threads spin
for a while after every gradient accumulation, burning the CPU that the sleeps were meant to leave
free (measured: 21 ms of CPU per ResNet-18 iteration with one thread, ~170 ms with two). What is
left is O(gradient bytes): one pass to zero and one to accumulate the gradients.

Input: any float tensor whose first dimension is the batch, e.g. ``torch.randn(batch, 1)``
(``ReplayModel.example_input()``); output: a tensor of the same shape, so
``model(x).sum().backward()`` is one training iteration.

Timing: each sleep compensates the oversleep of the previous sleeps of the same pass (forward
or backward), so per-layer sleep overshoot (~0.1 ms on Linux) does not add up over ResNet-50's
107 layers, while any time spent outside the sleeps (IMerge waiting for a deferred update before
a layer, hooks, a descheduled process) adds to the iteration as it would on a GPU that waits.

Time scale: ``time_scale`` multiplies every compute time. To emulate a cluster whose GPUs are
k times faster than the profiled device (e.g. CPU profile, GPU-like compute) use ``1/k``; to
slow a GPU profile down so that the emulated network (``benchmarks/netlab``) and the
oversubscribed CPU keep up, use ``s > 1`` and divide the link bandwidth by ``s`` (and multiply
its latency by ``s``): the communication/computation ratio, which is what decides the
schedules, is then the GPU cluster's. ``model.time_scale`` can be changed between iterations.

    python benchmarks/replay.py resnet50 [--device cpu] [--time-scale 0.1] [--iters 3]

prints the expected and measured forward/backward times and the CPU time used.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

PROFILE_DIR = Path(__file__).resolve().parent / "profiles"


def load_profile(name_or_path: str | os.PathLike[str] | dict, device: str = "cpu") -> dict:
    """A profile dict from a path, or from ``benchmarks/profiles/<name>-<device>.json``.

    ``device`` is the file tag: ``cpu`` or ``cuda`` (``cuda:0`` is read as ``cuda``).
    """
    if isinstance(name_or_path, dict):
        return name_or_path
    path = Path(name_or_path)
    if not (path.suffix == ".json" or path.exists()):
        tag = str(device).split(":", 1)[0]
        path = PROFILE_DIR / f"{name_or_path}-{tag}.json"
        if not path.exists():
            have = sorted(p.stem for p in PROFILE_DIR.glob("*.json"))
            raise FileNotFoundError(f"no profile {path} (profiles available: {', '.join(have) or 'none'}); "
                                    f"make one with: python benchmarks/make_profiles.py --models {name_or_path} "
                                    f"--device {tag}")
    with open(path) as f:
        profile = json.load(f)
    for key in ("model", "layers"):
        if key not in profile:
            raise ValueError(f"{path}: not a profile (no {key!r})")
    return profile


class _SleepClock:
    """Sleeps that compensate earlier oversleep within one pass; shared by the layers of a model."""

    def __init__(self, time_scale: float) -> None:
        self.time_scale = float(time_scale)
        self.debt = 0.0  # seconds slept beyond what was asked, in this pass

    def reset(self) -> None:
        self.debt = 0.0

    def sleep(self, seconds: float) -> None:
        want = seconds * self.time_scale
        if want <= 0.0:
            return
        if self.debt >= want:
            self.debt -= want
            return
        t0 = time.perf_counter()
        time.sleep(want - self.debt)
        self.debt += time.perf_counter() - t0 - want


class _ReplayFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, layer, *params):
        if layer.index == 0:
            layer.clock.reset()
        layer.clock.sleep(layer.forward_s)
        ctx.layer = layer
        ctx.param_meta = [(p.shape, p.dtype) for p in params]
        ctx.save_for_backward(x)
        return x.clone()

    @staticmethod
    def backward(ctx, grad_out):
        layer = ctx.layer
        if layer.index == layer.num_layers - 1:
            layer.clock.reset()
        layer.clock.sleep(layer.backward_s)
        (x,) = ctx.saved_tensors
        value = (grad_out * x).mean()
        grads = [value.to(dtype).expand(shape) for shape, dtype in ctx.param_meta]
        grad_x = grad_out if ctx.needs_input_grad[0] else None
        return (grad_x, None, *grads)


class ReplayLayer(torch.nn.Module):
    """One profiled layer: its parameters, and a forward/backward that take the profiled times."""

    def __init__(self, name: str, index: int, num_layers: int, forward_s: float, backward_s: float,
                 params: list[tuple[str, list[int]]], clock: _SleepClock, dtype: torch.dtype,
                 device: torch.device | str | None) -> None:
        super().__init__()
        self.layer_name = name
        self.index = index
        self.num_layers = num_layers
        self.forward_s = float(forward_s)
        self.backward_s = float(backward_s)
        self.clock = clock
        for local, shape in params:
            self.register_parameter(local, torch.nn.Parameter(torch.zeros(shape, dtype=dtype, device=device)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _ReplayFunction.apply(x, self, *self._parameters.values())

    def extra_repr(self) -> str:
        return f"forward_s={self.forward_s:.3g}, backward_s={self.backward_s:.3g}"


class ReplayModel(torch.nn.Module):
    """``nn.Module`` with the profiled model's parameters whose compute is a profiled sleep.

    ``profile``: a profile dict, a path to one, or a name for :func:`load_profile` (``"resnet50"``).
    """

    def __init__(self, profile: dict | str | os.PathLike[str], time_scale: float = 1.0,
                 dtype: torch.dtype = torch.float32, device: torch.device | str | None = None) -> None:
        super().__init__()
        profile = load_profile(profile)
        self.profile = profile
        self.model_name = profile["model"]
        self.batch_size = int(profile.get("batch_size", 1))
        self._clock = _SleepClock(time_scale)
        specs = profile["layers"]
        self._replay_layers: list[ReplayLayer] = []
        for i, spec in enumerate(specs):
            name = spec["name"]
            if not name:
                raise ValueError(f"{self.model_name}: a layer without a name (parameters owned by the root module) "
                                 f"is not supported")
            params = []
            for p in spec["params"]:
                if not p["name"].startswith(name + "."):
                    raise ValueError(f"{self.model_name}: parameter {p['name']!r} is not under layer {name!r}")
                local = p["name"][len(name) + 1:]
                if "." in local:
                    raise ValueError(f"{self.model_name}: parameter {p['name']!r} is not owned by layer {name!r}")
                params.append((local, list(p["shape"])))
            layer = ReplayLayer(name, i, len(specs), spec["forward_s"], spec["backward_s"], params,
                                self._clock, dtype, device)
            self._attach(name, layer)
            self._replay_layers.append(layer)

    def _attach(self, path: str, layer: ReplayLayer) -> None:
        parent: torch.nn.Module = self
        *parents, leaf = path.split(".")
        for part in parents:
            child = parent._modules.get(part)
            if child is None:
                child = torch.nn.Module()
                parent.add_module(part, child)
            parent = child
        if leaf in parent._modules:
            raise ValueError(f"{self.model_name}: layer {path!r} appears twice in the profile")
        parent.add_module(leaf, layer)

    @property
    def time_scale(self) -> float:
        return self._clock.time_scale

    @time_scale.setter
    def time_scale(self, value: float) -> None:
        self._clock.time_scale = float(value)

    @property
    def replay_layers(self) -> list[ReplayLayer]:
        """The layers in forward order."""
        return list(self._replay_layers)

    def expected_times(self) -> tuple[float, float]:
        """(forward, backward) seconds one iteration should take at the current time scale."""
        fwd = sum(layer.forward_s for layer in self._replay_layers) * self.time_scale
        bwd = sum(layer.backward_s for layer in self._replay_layers) * self.time_scale
        return fwd, bwd

    def example_input(self, batch_size: int | None = None) -> torch.Tensor:
        p = next(self.parameters())
        return torch.randn(batch_size or self.batch_size, 1, dtype=p.dtype, device=p.device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self._replay_layers:
            x = layer(x)
        return x


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="time a ReplayModel against its profile")
    ap.add_argument("model", help="profile name (resnet18, vgg16, alexnet, resnet50) or path")
    ap.add_argument("--device", default="cpu", help="profile tag: cpu or cuda")
    ap.add_argument("--time-scale", type=float, default=0.1)
    ap.add_argument("--iters", type=int, default=3)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    model = ReplayModel(load_profile(args.model, args.device), time_scale=args.time_scale)
    n = sum(1 for _ in model.parameters())
    mb = sum(p.numel() * p.element_size() for p in model.parameters()) / 1e6
    exp_f, exp_b = model.expected_times()
    print(f"{model.model_name} ({model.profile.get('device')}): {len(model.replay_layers)} layers, {n} tensors, "
          f"{mb:.1f} MB; time scale {args.time_scale}: expected forward {exp_f * 1e3:.1f} ms, "
          f"backward {exp_b * 1e3:.1f} ms")
    x = model.example_input()
    model(x).sum().backward()  # allocates .grad; later iterations accumulate in place, as under IMerge
    for it in range(args.iters):
        model.zero_grad(set_to_none=False)
        c0, t0 = time.process_time(), time.perf_counter()
        out = model(x)
        t1 = time.perf_counter()
        out.sum().backward()
        t2, c1 = time.perf_counter(), time.process_time()
        print(f"  iter {it}: forward {(t1 - t0) * 1e3:.1f} ms, backward {(t2 - t1) * 1e3:.1f} ms, "
              f"cpu {(c1 - c0) * 1e3:.1f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
