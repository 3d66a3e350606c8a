"""Per-layer compute profiles of four torchvision models, for the replay model and the simulator.

    python benchmarks/make_profiles.py [--models resnet18,vgg16,alexnet,resnet50] [--device cpu|cuda]
                                       [--batch-size 8] [--image-size 224] [--warmup 2] [--iters 3]
                                       [--out-dir benchmarks/profiles] [--clock wall|cpu]

For each model (``torchvision.models.<name>(weights=None, num_classes=1000)``, fp32, train mode,
SGD-style step without the update: forward, cross-entropy loss, backward) it writes
``<out-dir>/<model>-<tag>.json`` with tag ``cpu`` or ``cuda``::

    {"model": "resnet18", "device": "cpu" | "cuda:<GPU name>", "batch_size": 8, "image_size": 224,
     "iteration_s": <median forward+backward time>,
     "layers": [{"name": "conv1", "forward_s": ..., "backward_s": ...,
                 "params": [{"name": "conv1.weight", "shape": [64, 3, 7, 7], "bytes": 37632}]}, ...],
     ... extra top-level keys: forward_s, backward_s, layer_sum_s, timed_iterations, warmup_iterations,
         method, clock, dtype, host, torch_version, torch_threads, total_bytes, num_tensors}

**Layers** are the modules that own parameters directly (conv, linear, batch norm), in registration
order (``named_modules()``); parameter names, shapes and bytes (numel * element size) are exact.
The script checks that the forward pass runs them in that same order and that backward makes their
gradients ready in the reverse order (true for these four models) and warns otherwise.

**Timing: gap attribution.** One iteration is timed as marks on one clock (``time.perf_counter`` on
CPU; CUDA events recorded on the current stream on GPU, so nothing synchronises mid-iteration):

* forward: a forward hook on every layer marks the end of its forward. ``forward_s`` of a layer is
  the time from the end of the previous layer's forward (the iteration start for the first layer)
  to the end of its own, so parameter-free modules and functional ops (ReLU, pooling, residual adds,
  flatten, dropout) fold into the *next* parameterised layer; the loss after the last layer is
  folded into the last layer.
* backward: a post-accumulate-grad hook on every parameter marks when its gradient is ready; a
  layer is ready when all its parameters are. ``backward_s`` of a layer is the time from the
  previous layer ready (in ready order; the start of ``loss.backward()`` for the first) to its own
  ready time, so the loss backward folds into the last layer and the backward of parameter-free
  ops between two layers folds into the earlier one; what is left after the last gradient (nothing
  much: the first layer needs no input gradient) is added to the layer that became ready last.

So replaying the layers with these times (benchmarks/replay.py) reproduces the measured end of each
layer's forward and, more importantly for the scheduler, each layer's gradient-ready time; the sum
of all layer times equals the iteration (``layer_sum_s``, a sum of per-layer medians, against
``iteration_s``, the median of whole iterations). Full backward module hooks were not used: they
clash with torchvision's in-place ReLUs and would only see the layer's own node, not the gaps.

Each layer time is the median over ``--iters`` timed iterations after ``--warmup`` untimed ones.
On CUDA the default batch is 32, with ``cudnn.benchmark`` on (the warm-up iterations absorb tuning).
On CPU the default batch is 8 at 224x224, and ``--clock`` picks the clock: ``wall`` (default:
``perf_counter`` with torch's default intra-op threads) or ``cpu`` (process CPU time with one torch
thread), which stays right when other processes load the machine; the JSON records it under
``clock`` and ``torch_threads``. The ``*-cpu.json`` files here were made with ``--clock cpu`` on a
shared 2-core machine: about 85 s of CPU for all four models (VGG-16 ~10 s per iteration).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F
import torchvision

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # run as a script
    sys.path.insert(0, str(REPO))

from benchmarks.machine import cpu_model  # noqa: E402

MODELS = ("resnet18", "vgg16", "alexnet", "resnet50")
PROFILE_DIR = Path(__file__).resolve().parent / "profiles"


def param_layers(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """(name, module) of every module that owns parameters directly, in registration order."""
    return [(name, m) for name, m in model.named_modules() if any(True for _ in m.parameters(recurse=False))]


def device_label(device: torch.device) -> tuple[str, str]:
    """(label written as "device", tag used in the file name)."""
    if device.type == "cuda":
        return f"cuda:{torch.cuda.get_device_name(device)}", "cuda"
    return device.type, device.type


def host_label() -> str:
    return f"{cpu_model() or platform.processor() or platform.machine()}, {os.cpu_count()} cpus"


class _Clock:
    """perf_counter (or process CPU time) marks on CPU; CUDA events (resolved after the iteration) on GPU."""

    def __init__(self, device: torch.device, kind: str = "wall") -> None:
        self.cuda = device.type == "cuda"
        self._now = time.process_time if kind == "cpu" else time.perf_counter

    def mark(self):
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return self._now()

    def since(self, start, mark) -> float:
        """Seconds from start to mark (call after sync())."""
        if self.cuda:
            return start.elapsed_time(mark) / 1000.0
        return mark - start

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()


def profile_model(name: str, device: torch.device, batch_size: int, image_size: int,
                  warmup: int = 2, iters: int = 3, clock_kind: str = "wall", verbose: bool = True) -> dict:
    torch.manual_seed(0)
    model = getattr(torchvision.models, name)(weights=None, num_classes=1000).to(device).train()
    layers = param_layers(model)
    layer_names = [n for n, _ in layers]
    clock = _Clock(device, clock_kind)

    fwd_marks: list[tuple[str, object]] = []
    ready_marks: dict[str, object] = {}
    handles = []
    for lname, module in layers:
        handles.append(module.register_forward_hook(
            lambda _m, _i, _o, lname=lname: fwd_marks.append((lname, clock.mark()))))
        for pname, p in module.named_parameters(recurse=False):
            full = f"{lname}.{pname}" if lname else pname
            handles.append(p.register_post_accumulate_grad_hook(
                lambda _p, full=full: ready_marks.__setitem__(full, clock.mark())))

    x = torch.randn(batch_size, 3, image_size, image_size, device=device)
    y = torch.randint(0, 1000, (batch_size,), device=device)
    samples = []  # per timed iteration: (fwd dict, bwd dict, forward total, backward total)
    order_warned = False
    for it in range(warmup + iters):
        fwd_marks.clear()
        ready_marks.clear()
        model.zero_grad(set_to_none=True)
        clock.sync()
        t_wall = time.perf_counter()
        start = clock.mark()
        out = model(x)
        loss = F.cross_entropy(out, y)
        fwd_end = clock.mark()
        loss.backward()
        bwd_end = clock.mark()
        clock.sync()
        wall = time.perf_counter() - t_wall

        exec_order = [n for n, _ in fwd_marks]
        if exec_order != layer_names:
            raise RuntimeError(f"{name}: forward did not run each parameterised layer once in registration order "
                               f"(got {len(exec_order)} calls for {len(layer_names)} layers)")
        fwd = {}
        prev = 0.0
        for lname, mark in fwd_marks:
            t = clock.since(start, mark)
            fwd[lname] = t - prev
            prev = t
        t_fwd = clock.since(start, fwd_end)
        fwd[layer_names[-1]] += t_fwd - prev

        ready = {}
        for lname, module in layers:
            ts = [clock.since(fwd_end, ready_marks[f"{lname}.{pn}" if lname else pn])
                  for pn, _ in module.named_parameters(recurse=False)]
            ready[lname] = max(ts)
        ready_order = sorted(layer_names, key=lambda n: ready[n])
        if ready_order != layer_names[::-1] and not order_warned:
            warnings.warn(f"{name}: gradients were not ready in reverse layer order; the replay model "
                          f"(which runs backward in reverse layer order) will not reproduce ready times exactly",
                          stacklevel=1)
            order_warned = True
        bwd = {}
        prev = 0.0
        for lname in ready_order:
            bwd[lname] = ready[lname] - prev
            prev = ready[lname]
        t_bwd = clock.since(fwd_end, bwd_end)
        bwd[ready_order[-1]] += t_bwd - prev

        if verbose:
            tag = "warm-up" if it < warmup else "timed"
            print(f"  {name} iter {it} ({tag}): forward {t_fwd * 1e3:.1f} ms, backward {t_bwd * 1e3:.1f} ms, "
                  f"wall {wall * 1e3:.1f} ms", flush=True)
        if it >= warmup:
            samples.append((fwd, bwd, t_fwd, t_bwd))

    for h in handles:
        h.remove()

    label, _ = device_label(device)
    out_layers = []
    for lname, module in layers:
        params = []
        for pname, p in module.named_parameters(recurse=False):
            params.append({"name": f"{lname}.{pname}" if lname else pname, "shape": list(p.shape),
                           "bytes": p.numel() * p.element_size()})
        out_layers.append({"name": lname,
                           "forward_s": statistics.median(s[0][lname] for s in samples),
                           "backward_s": statistics.median(s[1][lname] for s in samples),
                           "params": params})
    totals = [s[2] + s[3] for s in samples]
    return {
        "model": name,
        "device": label,
        "batch_size": batch_size,
        "image_size": image_size,
        "iteration_s": statistics.median(totals),
        "layers": out_layers,
        "forward_s": statistics.median(s[2] for s in samples),
        "backward_s": statistics.median(s[3] for s in samples),
        "layer_sum_s": sum(layer["forward_s"] + layer["backward_s"] for layer in out_layers),
        "num_tensors": sum(len(layer["params"]) for layer in out_layers),
        "total_bytes": sum(p["bytes"] for layer in out_layers for p in layer["params"]),
        "timed_iterations": iters,
        "warmup_iterations": warmup,
        "dtype": "float32",
        "clock": "cuda-events" if device.type == "cuda" else clock_kind,
        "method": "gap attribution: forward hooks mark each layer's end, post-accumulate-grad hooks mark "
                  "gradient-ready times; parameter-free ops fold into the adjacent parameterised layer",
        "host": host_label() if device.type == "cpu" else label,
        "torch_version": torch.__version__,
        "torch_threads": torch.get_num_threads(),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default=",".join(MODELS), help="comma-separated torchvision model names")
    ap.add_argument("--device", default="cpu", help="cpu or cuda (cuda:N)")
    ap.add_argument("--batch-size", type=int, default=None, help="default 8 on CPU, 32 on CUDA")
    ap.add_argument("--image-size", type=int, default=224)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--out-dir", default=str(PROFILE_DIR))
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                    help="CPU only: wall = perf_counter with torch's default threads; cpu = process CPU time "
                         "with one torch thread (robust when other processes load the machine)")
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads (CPU; default: torch's)")
    args = ap.parse_args(argv)
    if args.clock == "cpu":
        torch.set_num_threads(1)
    elif args.threads:
        torch.set_num_threads(args.threads)

    device = torch.device(args.device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            print("CUDA is not available", file=sys.stderr)
            return 2
        torch.backends.cudnn.benchmark = True
    batch = args.batch_size or (32 if device.type == "cuda" else 8)
    _, tag = device_label(device)
    os.makedirs(args.out_dir, exist_ok=True)
    print(f"{'model':10} {'tensors':>7} {'grad MB':>8} {'layers':>6} {'fwd ms':>9} {'bwd ms':>9} "
          f"{'iter ms':>9} {'sum ms':>9}  file")
    rows = []
    for name in [m.strip() for m in args.models.split(",") if m.strip()]:
        t0 = time.perf_counter()
        prof = profile_model(name, device, batch, args.image_size, args.warmup, args.iters, args.clock)
        path = Path(args.out_dir) / f"{name}-{tag}.json"
        with open(path, "w") as f:
            json.dump(prof, f, indent=1)
            f.write("\n")
        rows.append(f"{name:10} {prof['num_tensors']:7d} {prof['total_bytes'] / 1e6:8.2f} {len(prof['layers']):6d} "
                    f"{prof['forward_s'] * 1e3:9.1f} {prof['backward_s'] * 1e3:9.1f} "
                    f"{prof['iteration_s'] * 1e3:9.1f} {prof['layer_sum_s'] * 1e3:9.1f}  {path} "
                    f"({time.perf_counter() - t0:.0f} s)")
        print(rows[-1], flush=True)
    print(f"\ndevice {prof['device']}, batch {batch}, image {args.image_size}, clock {prof['clock']}, "
          f"torch threads {torch.get_num_threads()}")
    for r in rows:
        print(r)
    return 0


if __name__ == "__main__":
    sys.exit(main())
