"""Per-tensor gradient-ready times, sizes and per-module forward times from warm-up iterations."""

from __future__ import annotations

import json
import os
import statistics
import time
from dataclasses import asdict, dataclass, field

import torch

from ..worker import streams


@dataclass
class Profile:
    """Medians over the profiled iterations. Lists are indexed by parameter (registration order)."""

    names: list[str]
    sizes: list[int]  # bytes
    dtypes: list[str]
    ready_times: list[float]  # seconds after the first gradient of backward is ready
    forward_times: dict[str, float] = field(default_factory=dict)  # module name -> seconds
    iterations: int = 0

    def ready_order(self) -> list[int]:
        """Parameter indices sorted by ready time (ties: later-registered first, as backward runs)."""
        return sorted(range(len(self.names)), key=lambda i: (self.ready_times[i], -i))

    def to_json(self, path: str | os.PathLike[str]) -> None:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as f:
            json.dump(asdict(self), f, indent=1)

    @classmethod
    def from_json(cls, path: str | os.PathLike[str]) -> Profile:
        with open(path) as f:
            return cls(**json.load(f))


class Profiler:
    """Collects ready times (from the engine) and forward times (from global module hooks)."""

    def __init__(self, names: list[str], params: list[torch.Tensor], steps: int, discard: int = 2) -> None:
        self.names = names
        self.sizes = [p.numel() * p.element_size() for p in params]
        self.dtypes = [str(p.dtype).replace("torch.", "") for p in params]
        self.steps = steps
        self.discard = min(discard, max(0, steps - 1))
        self.samples: list[list[float]] = []
        self.forward: dict[str, list[float]] = {}
        self.seen = 0
        self._by_param = {id(p): n for n, p in zip(names, params)}
        self._module_names: dict[int, str | None] = {}  # id(module) -> name, None if it owns no profiled param
        self._starts: dict[int, object] = {}
        # CUDA: kernels run after the host queued them, so times come from timing events on the
        # module's stream, read once the step is over (``_gpu_spans``, resolved by ``record_iteration``).
        self.on_device = any(p.is_cuda for p in params)
        self._gpu_spans: list[tuple[str, object, object]] = []
        self._handles = []
        if steps > 0:
            self._handles = [torch.nn.modules.module.register_module_forward_pre_hook(self._pre),
                             torch.nn.modules.module.register_module_forward_hook(self._post)]

    @property
    def done(self) -> bool:
        return self.seen >= self.steps

    def record_iteration(self, ready_at: list[float]) -> None:
        for name, start, end in self._gpu_spans:
            self.forward.setdefault(name, []).append(streams.seconds_between(start, end))
        self._gpu_spans = []
        self.seen += 1
        if self.seen > self.discard:
            self.samples.append(list(ready_at))
        if self.done:
            self.close()

    def _owner_name(self, module: torch.nn.Module) -> str | None:
        """Name of a module that directly owns a profiled parameter (cached per module)."""
        key = id(module)
        if key not in self._module_names:
            name = None
            for pname, p in module._parameters.items():
                full = self._by_param.get(id(p)) if p is not None else None
                if full is not None:
                    name = full[: -len(pname) - 1] if full.endswith("." + pname) else full
                    break
            self._module_names[key] = name
        return self._module_names[key]

    def _pre(self, module: torch.nn.Module, _args) -> None:
        if torch.compiler.is_compiling():  # inside a compiled graph: no per-module time to take
            return
        if self._owner_name(module) is not None:
            self._starts[id(module)] = self._now(module)

    def _post(self, module: torch.nn.Module, _args, _out) -> None:
        if torch.compiler.is_compiling():
            return
        start = self._starts.pop(id(module), None)
        if start is None:
            return
        name = self._module_names[id(module)]
        if isinstance(start, float):
            self.forward.setdefault(name, []).append(time.perf_counter() - start)
        else:
            self._gpu_spans.append((name, start, self._now(module)))

    def _now(self, module: torch.nn.Module) -> object:
        """Host time, or a timing event on the stream of a module whose parameters are on a GPU."""
        if self.on_device:
            device = next((p.device for p in module._parameters.values() if p is not None), None)
            if device is not None and device.type == "cuda":
                return streams.timing_event(device)
        return time.perf_counter()

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def profile(self) -> Profile:
        if not self.samples:
            ready = [0.0] * len(self.names)
        else:
            ready = [statistics.median(s[i] for s in self.samples) for i in range(len(self.names))]
        forward = {name: statistics.median(v) for name, v in self.forward.items()}
        return Profile(self.names, self.sizes, self.dtypes, ready, forward, len(self.samples))
