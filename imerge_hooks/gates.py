"""Where each parameter's deferred update must be applied: learned from what the forward does.

With ``overlap_forward`` a parameter's update from the last ``step()`` is applied just before
the forward first uses the parameter. Which module that is cannot be read off the module tree:
``nn.MultiheadAttention`` uses ``out_proj.weight`` without calling ``out_proj``, a parent may
call ``F.linear(x, self.proj.weight)``, tied weights belong to two modules, a block may run
twice. So during synchronous iterations (the profiled ones) a ``TorchFunctionMode`` sees the
first use of every parameter in any op, and the innermost module whose forward was running
then becomes that parameter's *gate*: its forward pre-hook applies the update from then on
(FSDP2 makes a unit's parameters ready the same way, in the unit's pre-hook). Steady state
costs one dict lookup per module call; the mode runs only while learning.

A parameter whose first use was outside every module forward, or in different modules on
different iterations, or that was never used while learning, has no gate: its update is
applied at ``step()`` (no overlap for it, always exact). While updates are pending,
``AccessGuard`` applies a parameter's update when it is fetched as a module attribute
(``module.weight``) or when ``parameters()`` is called, so a use the learning did not see is
still exact (one warning).
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

log = logging.getLogger("imerge")

LEARNING_ITERATIONS = 2  # synchronous iterations observed before updates may be deferred
_NO_GATE = -1  # first use outside every module forward, or in different modules across iterations


class _FirstUseMode(TorchFunctionMode):
    """Reports every tensor argument of every torch op to ``on_tensor`` (lists one level deep)."""

    def __init__(self, on_tensor: Callable[[torch.Tensor], None]) -> None:
        super().__init__()
        self.on_tensor = on_tensor

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        for value in (*args, *kwargs.values()):
            if isinstance(value, torch.Tensor):
                self.on_tensor(value)
            elif isinstance(value, (list, tuple)):
                for item in value:
                    if isinstance(item, torch.Tensor):
                        self.on_tensor(item)
        return func(*args, **kwargs)


class GateLearner:
    """Records, per synchronous iteration, the innermost running module at each parameter's first use."""

    def __init__(self, params: list[torch.Tensor]) -> None:
        self._index = {id(p): i for i, p in enumerate(params)}
        self._stack: list[torch.nn.Module] = []
        self._mode: _FirstUseMode | None = None
        self._seen: dict[int, torch.nn.Module | None] = {}  # this iteration: index -> module (None: outside)
        self._gates: dict[int, weakref.ref | int] = {}  # index -> module ref, or _NO_GATE
        self._thread = threading.get_ident()
        self.iterations = 0
        self._hooks = [torch.nn.modules.module.register_module_forward_pre_hook(self._enter),
                       torch.nn.modules.module.register_module_forward_hook(self._leave, always_call=True)]

    @property
    def learned(self) -> bool:
        return self.iterations >= LEARNING_ITERATIONS

    def _enter(self, module: torch.nn.Module, _args: Any) -> None:
        if threading.get_ident() != self._thread:
            return
        if not self._stack:
            self._mode = _FirstUseMode(self._record)
            self._mode.__enter__()
        self._stack.append(module)

    def _leave(self, module: torch.nn.Module, _args: Any, _out: Any) -> None:
        if threading.get_ident() != self._thread or not self._stack:
            return
        self._stack.pop()
        if not self._stack and self._mode is not None:
            mode, self._mode = self._mode, None
            mode.__exit__(None, None, None)

    def _record(self, tensor: torch.Tensor) -> None:
        i = self._index.get(id(tensor))
        if i is not None and i not in self._seen:
            self._seen[i] = self._stack[-1] if self._stack else None

    def observe_outside_forward(self, tensors: Iterable[torch.Tensor]) -> None:
        """Parameters the caller knows were used outside any module forward (no gate)."""
        for t in tensors:
            i = self._index.get(id(t))
            if i is not None and i not in self._seen:
                self._seen[i] = None

    def end_iteration(self) -> None:
        """A synchronous ``step()``: fold this iteration's first uses into the gates."""
        if not self._seen and self.iterations == 0:
            return  # no forward seen (step without forward): nothing learned
        for i, module in self._seen.items():
            gate = self._gates.get(i)
            if module is None:
                self._gates[i] = _NO_GATE
            elif gate is None:
                self._gates[i] = weakref.ref(module)
            elif gate is not _NO_GATE and gate() is not module:
                self._gates[i] = _NO_GATE
        self._seen = {}
        self.iterations += 1

    def gates(self) -> tuple[dict[int, list[int]], dict[int, torch.nn.Module], set[int]]:
        """(id(module) -> parameter indices gated there, id(module) -> module, indices without a gate)."""
        by_module: dict[int, list[int]] = {}
        modules: dict[int, torch.nn.Module] = {}
        ungated = set(self._index.values())
        for i, gate in self._gates.items():
            module = gate() if gate is not _NO_GATE else None
            if module is None:
                continue
            by_module.setdefault(id(module), []).append(i)
            modules[id(module)] = module
            ungated.discard(i)
        return by_module, modules, ungated

    def close(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        if self._mode is not None:
            mode, self._mode = self._mode, None
            mode.__exit__(None, None, None)
        self._stack = []


class AccessGuard:
    """While updates are pending, apply a parameter's update before user code fetches it.

    Patches ``nn.Module.__getattr__`` (through which every ``module.weight`` access goes: the
    parameters live in ``module._parameters``) and ``nn.Module.named_parameters`` (behind
    ``parameters()``) for as long as any engine has pending updates.
    """

    _lock = threading.Lock()
    _active: list[Callable[[torch.Tensor], None]] = []  # per pending engine: fn(tensor) applies if pending
    _flush_all: list[Callable[[], None]] = []
    _original_getattr = torch.nn.Module.__getattr__
    _original_named_parameters = torch.nn.Module.named_parameters

    @classmethod
    def activate(cls, on_fetch: Callable[[torch.Tensor], None], flush: Callable[[], None]) -> None:
        with cls._lock:
            if not cls._active:
                torch.nn.Module.__getattr__ = _guarded_getattr
                torch.nn.Module.named_parameters = _guarded_named_parameters
            cls._active.append(on_fetch)
            cls._flush_all.append(flush)

    @classmethod
    def deactivate(cls, on_fetch: Callable[[torch.Tensor], None], flush: Callable[[], None]) -> None:
        with cls._lock:
            if on_fetch in cls._active:
                cls._active.remove(on_fetch)
                cls._flush_all.remove(flush)
            if not cls._active:
                torch.nn.Module.__getattr__ = cls._original_getattr
                torch.nn.Module.named_parameters = cls._original_named_parameters


def _guarded_getattr(self: torch.nn.Module, name: str) -> Any:
    value = AccessGuard._original_getattr(self, name)
    if isinstance(value, torch.nn.Parameter):
        for on_fetch in list(AccessGuard._active):
            on_fetch(value)
    return value


def _guarded_named_parameters(self: torch.nn.Module, *args: Any, **kwargs: Any):
    for flush in list(AccessGuard._flush_all):
        flush()
    return AccessGuard._original_named_parameters(self, *args, **kwargs)
