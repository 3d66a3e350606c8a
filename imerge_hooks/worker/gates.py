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
``read_guard.AccessGuard`` applies a parameter's update when it is fetched as a module attribute
(``module.weight``) or when ``parameters()`` is called, so a use the learning did not see is
still exact (one warning).

A compiled module (``torch.compile(module)``, ``Module.compile()``) leaves nothing to learn: its
graph runs no per-module hooks, so updates are applied at ``step()``. Dynamo must never trace the
mode (it would trace ``_record``'s bookkeeping into the graph and guard on the mode), so the
learner does not enter it for a forward that holds a compiled module, and takes it off torch's
mode stack around a compiled module it meets inside an eager one.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import warnings
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

log = logging.getLogger("imerge")

LEARNING_ITERATIONS = 2  # synchronous iterations observed before updates may be deferred
_NO_GATE = -1  # first use outside every module forward, or in different modules across iterations


class _FirstUseMode(TorchFunctionMode):
    """Reports every tensor argument of every torch op to ``on_tensor`` (lists one level deep).

    Warnings the op raises are re-issued at the user's line: with the mode on the stack they
    would otherwise point at this file.
    """

    def __init__(self, on_tensor: Callable[[torch.Tensor], None]) -> None:
        super().__init__()
        self.on_tensor = on_tensor

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if torch.compiler.is_compiling():  # a compiled module the learner did not see coming: record nothing
            return func(*args, **kwargs)
        for value in (*args, *kwargs.values()):
            if isinstance(value, torch.Tensor):
                self.on_tensor(value)
            elif isinstance(value, (list, tuple)):
                for item in value:
                    if isinstance(item, torch.Tensor):
                        self.on_tensor(item)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            result = func(*args, **kwargs)
        if caught:
            _reissue(caught, func)
        return result


def _reissue(caught: list[warnings.WarningMessage], func: Callable) -> None:
    """Warn again, attributing to the caller of ``func`` what was attributed to this file."""
    frame = sys._getframe(2)  # above __torch_function__
    while frame is not None and frame.f_code.co_filename.endswith(_OVERRIDES_FILES):
        frame = frame.f_back
    if frame is not None and frame.f_code is getattr(func, "__code__", None):
        frame = frame.f_back  # a Python function that dispatched to the mode: its caller is the user
    for w in caught:
        if frame is not None and w.filename == __file__:
            filename, lineno, module_globals = frame.f_code.co_filename, frame.f_lineno, frame.f_globals
        else:
            filename, lineno, module_globals = w.filename, w.lineno, None
        registry = module_globals.setdefault("__warningregistry__", {}) if module_globals is not None else None
        warnings.warn_explicit(w.message, w.category, filename, lineno, registry=registry,
                               module_globals=module_globals)


_OVERRIDES_FILES = (os.path.join("torch", "overrides.py"), os.path.join("torch", "utils", "_device.py"))


def _optimized_module() -> type | None:
    """torch.compile's module wrapper class (None while dynamo is not loaded: then there is none)."""
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    return getattr(eval_frame, "OptimizedModule", None)


def _compiled_how(module: torch.nn.Module, wrapper: type | None) -> str | None:
    """How ``module`` is compiled, or None: ``wrapper`` is ``_optimized_module()``."""
    if wrapper is not None and isinstance(module, wrapper):
        return "torch.compile(module)"
    if getattr(module, "_compiled_call_impl", None) is not None:
        return "Module.compile()"
    return None


class GateLearner:
    """Records, per synchronous iteration, the innermost running module at each parameter's first use.

    The module forward hooks keep the mode on torch's mode stack exactly while an eager module
    forward runs on the learner's thread (``_stack``), except inside a compiled module
    (``_hidden``: the depth of module calls there), where it is off the stack (``_suspended``).
    """

    def __init__(self, params: list[torch.Tensor]) -> None:
        self._index = {id(p): i for i, p in enumerate(params)}
        self._stack: list[torch.nn.Module] = []  # eager module forwards the mode records for (innermost last)
        self._mode: _FirstUseMode | None = None
        self._hidden = 0  # module calls open at or inside a compiled module (the mode is off the stack)
        self._suspended: int | None = None  # where the mode sat on torch's mode stack while hidden
        self._looked: set[int] = set()  # modules this forward already searched for compiled ones
        self._seen: dict[int, torch.nn.Module | None] = {}  # this iteration: index -> module (None: outside)
        self._gates: dict[int, weakref.ref | int] = {}  # index -> module ref, or _NO_GATE
        self._thread = threading.get_ident()
        self.iterations = 0
        self._compiled: str | None = None  # the compiled module found in the forward, described
        self._traced = False  # the hooks ran under dynamo: some compiled graph calls modules
        self._hooks = [torch.nn.modules.module.register_module_forward_pre_hook(self._enter),
                       torch.nn.modules.module.register_module_forward_hook(self._leave, always_call=True)]

    @property
    def learned(self) -> bool:
        return self.iterations >= LEARNING_ITERATIONS

    @property
    def compiled(self) -> str | None:
        """The compiled module met in the forward, described for a log line (None: none met)."""
        if self._compiled is None and self._traced:
            return "a module compiled with torch.compile() or Module.compile()"
        return self._compiled

    def _enter(self, module: torch.nn.Module, _args: Any) -> None:
        if torch.compiler.is_compiling():
            # Traced into a compiled graph: record nothing there, and read no learner state, which
            # dynamo would guard on (learning's end would then recompile the graph).
            self._traced = True
            return
        if self.learned or threading.get_ident() != self._thread:
            return
        if self._hidden:
            self._hidden += 1
            return
        if not self._stack:  # a new forward
            self._looked = set()
        if self.compiled is None:
            self._compiled = self._find_compiled(module)
        if self.compiled is None:
            if not self._stack:
                self._mode = _FirstUseMode(self._record)
                self._mode.__enter__()
            self._stack.append(module)
            return
        # Updates will be applied at step(): nothing more to learn, and the mode must not be on
        # the stack when dynamo traces (this module, or a compiled one inside it).
        self._hidden = 1
        if self._stack:
            self._suspend()

    def _leave(self, module: torch.nn.Module, _args: Any, _out: Any) -> None:
        if torch.compiler.is_compiling() or threading.get_ident() != self._thread:
            return
        if self._hidden:
            self._hidden -= 1
            if not self._hidden and self._suspended is not None:
                self._resume()
            return
        if not self._stack:
            return
        self._stack.pop()
        if not self._stack and self._mode is not None:
            mode, self._mode = self._mode, None
            mode.__exit__(None, None, None)

    def _find_compiled(self, module: torch.nn.Module) -> str | None:
        """A compiled module at or under ``module`` that this forward has not searched yet, described.

        ``Module.compile()`` compiles the module's whole call, its hooks included, so only an eager
        parent's hook can see it before dynamo traces it."""
        wrapper = _optimized_module()
        top = module._orig_mod if wrapper is not None and isinstance(module, wrapper) else module
        todo = [(type(top).__name__, module)]
        while todo:
            where, m = todo.pop()
            if id(m) in self._looked:
                continue
            self._looked.add(id(m))
            how = _compiled_how(m, wrapper)
            if how is not None:
                return f"{where}, compiled with {how}"
            children = [(where if name == "_orig_mod" else f"{where}.{name}", child)
                        for name, child in m._modules.items() if child is not None]
            todo.extend(reversed(children))
        return None

    def _suspend(self) -> None:
        """Take the mode off torch's mode stack; modes the forward entered above it keep their order."""
        stack = torch.overrides._get_current_function_mode_stack()
        at = next((i for i, mode in enumerate(stack) if mode is self._mode), None)
        if at is None:
            return
        above = [torch.overrides._pop_mode() for _ in range(len(stack) - at - 1)]
        torch.overrides._pop_mode()
        self._suspended = at
        for mode in reversed(above):
            torch.overrides._push_mode(mode)

    def _resume(self) -> None:
        """Put the mode back where ``_suspend`` took it from."""
        above = [torch.overrides._pop_mode()
                 for _ in range(max(torch.overrides._len_torch_function_stack() - self._suspended, 0))]
        torch.overrides._push_mode(self._mode)
        for mode in reversed(above):
            torch.overrides._push_mode(mode)
        self._suspended = None

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
        if not self._seen and self.iterations == 0 and self.compiled is None:
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
        """Remove the hooks (a compiled graph traced them: removing them would recompile it, so an
        engine whose forward is compiled keeps them, inert, until it closes)."""
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        if self._mode is not None:
            mode, self._mode = self._mode, None
            if self._suspended is None:  # a suspended mode is already off the stack
                mode.__exit__(None, None, None)
        self._stack, self._hidden, self._suspended = [], 0, None


