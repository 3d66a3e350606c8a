"""What keeping reads exact under the overlap costs per step: ``AccessGuard`` (imerge_hooks/worker/read_guard.py).

While a step's updates are pending, ``nn.Module.__getattr__``, ``named_parameters``,
``_save_to_state_dict``, ``_load_from_state_dict``, ``zero_grad`` and ``Parameter``'s copy and
pickle entry points are patched, so every read applies the update it needs first. The cost a step
pays when nothing reads parameters early is: patching and restoring them (once each per step) and
the patched ``__getattr__`` on every module attribute the forward touches. This measures both, in
one process, on the forward of a ResNet-50 replay (``benchmarks/replay.py``, compute time 0, so the
forward is pure Python module overhead) and of torchvision's ResNet-50 (a real forward on a 1x3x32x32
input), with the guard on and off, interleaved.

    python benchmarks/guard_cost.py [--repeats 30] [--json benchmarks/results/guard-cost.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.replay import ReplayModel  # noqa: E402
from imerge_hooks.internals import AccessGuard  # noqa: E402


class _PendingEngine:
    """The engine's side of the guard with every parameter of ``model`` pending but never applied
    (a dict lookup per fetch, as ``deferral.Overlap.on_fetch`` does before it applies anything)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.pending = {id(p) for p in model.parameters()}
        self.fetches = 0

    def on_fetch(self, param: torch.Tensor, reason: str) -> None:
        if id(param) in self.pending:
            self.fetches += 1

    def zero_pending(self, params: list[torch.Tensor], set_to_none: bool) -> set[int]:
        return set()


def _forward_time(model: torch.nn.Module, x: torch.Tensor, guard: _PendingEngine | None) -> float:
    if guard is not None:
        AccessGuard.activate(guard)
    try:
        start = time.perf_counter()
        with torch.no_grad():
            model(x)
        return time.perf_counter() - start
    finally:
        if guard is not None:
            AccessGuard.deactivate(guard)


def _toggle_time(guard: _PendingEngine, n: int = 1000) -> float:
    start = time.perf_counter()
    for _ in range(n):
        AccessGuard.activate(guard)
        AccessGuard.deactivate(guard)
    return (time.perf_counter() - start) / n


def measure(name: str, model: torch.nn.Module, x: torch.Tensor, repeats: int) -> dict:
    guard = _PendingEngine(model)
    plain_cls = _forward_time(model, x, None)  # noqa: F841 - warms torch before any patching
    AccessGuard.retain()
    try:
        return _measure(name, model, x, repeats, guard)
    finally:
        AccessGuard.release()


def _measure(name: str, model: torch.nn.Module, x: torch.Tensor, repeats: int, guard: _PendingEngine) -> dict:
    for _ in range(3):  # warm up
        _forward_time(model, x, None)
        _forward_time(model, x, guard)
    plain, guarded = [], []
    for _ in range(repeats):  # interleaved, so drift hits both alike
        plain.append(_forward_time(model, x, None))
        guarded.append(_forward_time(model, x, guard))
    toggle = _toggle_time(guard)
    p, g = min(plain), min(guarded)  # the least-disturbed run of each: robust to a loaded machine
    return {"model": name, "forward_plain_ms": p * 1e3, "forward_guarded_ms": g * 1e3,
            "guarded_getattr_us": (g - p) * 1e6, "patch_and_restore_us": toggle * 1e6,
            "per_step_us": (g - p + toggle) * 1e6, "parameter_fetches_per_forward": guard.fetches // (repeats + 3)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--json", default=None, help="write the rows here")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    import torchvision

    replay = ReplayModel("resnet50", time_scale=0.0)
    rows = [measure("resnet50 replay", replay, replay.example_input(1), args.repeats),
            measure("torchvision resnet50", torchvision.models.resnet50(), torch.randn(2, 3, 32, 32), args.repeats)]
    print(f"{'model':<22} {'forward ms':>11} {'guarded ms':>11} {'getattr us':>11} {'patch us':>9} {'per step us':>12}")
    for r in rows:
        print(f"{r['model']:<22} {r['forward_plain_ms']:>11.3f} {r['forward_guarded_ms']:>11.3f} "
              f"{r['guarded_getattr_us']:>11.1f} {r['patch_and_restore_us']:>9.1f} {r['per_step_us']:>12.1f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"command": "python benchmarks/guard_cost.py --json " + args.json,
                                               "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
