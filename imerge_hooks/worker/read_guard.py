"""Exact reads under the overlap: while deferred updates are pending, a parameter read outside the forward
(``module.weight``, ``parameters()``, ``state_dict()``, ``zero_grad()``, ``deepcopy``, pickling) first applies
its update (``AccessGuard``; ``gates`` says where updates are applied in the forward)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch


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
