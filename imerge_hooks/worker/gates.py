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


class AccessGuard:
    """While updates are pending, apply a parameter's update before anything outside the forward reads it.

    For as long as any engine has pending updates, patches the entry points through which user
    code and libraries reach parameters: ``nn.Module.__getattr__`` (every ``module.weight``; the
    parameters live in ``module._parameters``), ``named_parameters`` (behind ``parameters()``:
    each parameter is brought up to date as it is yielded, so ``next(model.parameters())``
    applies one update, not all), ``_save_to_state_dict`` / ``_load_from_state_dict`` (behind
    ``state_dict()``, ``load_state_dict()``, ``save_pretrained``, EMA helpers), ``zero_grad`` (the
    pending parameters' gradients are cleared right after their update, so Hugging Face's
    ``model.zero_grad()`` after ``step()`` keeps the overlap) and ``Parameter.__deepcopy__`` /
    ``__reduce_ex__`` (``copy.deepcopy(model)``, ``torch.save(model)``). The entry points stay
    patched while an engine that may defer exists (``retain``/``release``); with no update pending
    each costs one flag test (``benchmarks/guard_cost.py`` measures it).
    """

    _lock = threading.Lock()
    _active: list = []  # overlaps with a pending step (deferral.Overlap): .on_fetch(param, reason), .zero_pending(...)
    _users = 0  # engines that may defer: the entry points stay patched while there are any
    _originals = {
        (torch.nn.Module, "__getattr__"): torch.nn.Module.__getattr__,
        (torch.nn.Module, "named_parameters"): torch.nn.Module.named_parameters,
        (torch.nn.Module, "_save_to_state_dict"): torch.nn.Module._save_to_state_dict,
        (torch.nn.Module, "_load_from_state_dict"): torch.nn.Module._load_from_state_dict,
        (torch.nn.Module, "zero_grad"): torch.nn.Module.zero_grad,
        (torch.nn.Parameter, "__deepcopy__"): torch.nn.Parameter.__deepcopy__,
        (torch.nn.Parameter, "__reduce_ex__"): torch.nn.Parameter.__reduce_ex__,
    }

    @classmethod
    def retain(cls) -> None:
        """An engine that may defer exists: patch the entry points (once; patching a class that
        ``nn.Module`` has thousands of subclasses of costs ~0.1 ms, too much to do every step)."""
        with cls._lock:
            if cls._users == 0:
                for (owner, name), fn in _GUARDED.items():
                    setattr(owner, name, fn)
            cls._users += 1

    @classmethod
    def release(cls) -> None:
        """That engine closed: the last one restores torch's entry points."""
        with cls._lock:
            cls._users -= 1
            if cls._users == 0:
                cls._active.clear()
                for (owner, name), fn in cls._originals.items():
                    setattr(owner, name, fn)

    @classmethod
    def activate(cls, holder) -> None:
        """``holder`` (a ``deferral.Overlap``) has pending updates: reads go through it until ``deactivate``."""
        with cls._lock:
            if cls._users == 0:
                raise RuntimeError("IMerge internal: AccessGuard.activate() without retain()")
            if holder not in cls._active:
                cls._active.append(holder)

    @classmethod
    def deactivate(cls, holder) -> None:
        with cls._lock:
            if holder in cls._active:
                cls._active.remove(holder)

    @classmethod
    def original(cls, owner: type, name: str) -> Callable:
        return cls._originals[(owner, name)]


def _fetched(param: torch.Tensor, reason: str) -> None:
    for holder in list(AccessGuard._active):
        holder.on_fetch(param, reason)


_getattr = torch.nn.Module.__getattr__
_named_parameters = torch.nn.Module.named_parameters


def _guarded_getattr(self: torch.nn.Module, name: str) -> Any:
    value = _getattr(self, name)
    if AccessGuard._active and isinstance(value, torch.nn.Parameter):
        _fetched(value, f"a read of {type(self).__name__}.{name}")
    return value


def _guarded_named_parameters(self: torch.nn.Module, *args: Any, **kwargs: Any):
    if not AccessGuard._active:
        yield from _named_parameters(self, *args, **kwargs)
        return
    for name, param in _named_parameters(self, *args, **kwargs):
        _fetched(param, "Module.parameters()/named_parameters()")
        yield name, param


def _guarded_save(self: torch.nn.Module, *args: Any, **kwargs: Any) -> None:
    for param in self._parameters.values() if AccessGuard._active else ():
        if param is not None:
            _fetched(param, "Module.state_dict()")
    return AccessGuard.original(torch.nn.Module, "_save_to_state_dict")(self, *args, **kwargs)


def _guarded_load(self: torch.nn.Module, *args: Any, **kwargs: Any) -> None:
    for param in self._parameters.values() if AccessGuard._active else ():
        if param is not None:
            _fetched(param, "Module.load_state_dict()")
    return AccessGuard.original(torch.nn.Module, "_load_from_state_dict")(self, *args, **kwargs)


def _guarded_zero_grad(self: torch.nn.Module, set_to_none: bool = True) -> None:
    if not AccessGuard._active:
        return AccessGuard.original(torch.nn.Module, "zero_grad")(self, set_to_none)
    params = [p for _, p in _named_parameters(self)]
    handled: set[int] = set()
    for holder in list(AccessGuard._active):
        handled |= holder.zero_pending(params, set_to_none)
    for p in params:  # torch's Module.zero_grad for the others
        if id(p) in handled or p.grad is None:
            continue
        if set_to_none:
            p.grad = None
        else:
            if p.grad.grad_fn is not None:
                p.grad.detach_()
            else:
                p.grad.requires_grad_(False)
            p.grad.zero_()


def _guarded_deepcopy(self: torch.nn.Parameter, memo: dict) -> Any:
    if AccessGuard._active:
        _fetched(self, "copy.deepcopy()")
    return AccessGuard.original(torch.nn.Parameter, "__deepcopy__")(self, memo)


def _guarded_reduce_ex(self: torch.nn.Parameter, proto: int) -> Any:
    if AccessGuard._active:
        _fetched(self, "pickling a Parameter (torch.save of a module)")
    return AccessGuard.original(torch.nn.Parameter, "__reduce_ex__")(self, proto)


_GUARDED = {
    (torch.nn.Module, "__getattr__"): _guarded_getattr,
    (torch.nn.Module, "named_parameters"): _guarded_named_parameters,
    (torch.nn.Module, "_save_to_state_dict"): _guarded_save,
    (torch.nn.Module, "_load_from_state_dict"): _guarded_load,
    (torch.nn.Module, "zero_grad"): _guarded_zero_grad,
    (torch.nn.Parameter, "__deepcopy__"): _guarded_deepcopy,
    (torch.nn.Parameter, "__reduce_ex__"): _guarded_reduce_ex,
}
