"""Names for parameters given without names, found in the modules that hold them.

Without names the servers could compare only sizes, so two workers whose optimizers list
equal-shaped tensors in different orders would average the wrong gradients into each other.
Every live ``nn.Module`` is scanned once (``gc``) and each parameter gets the smallest
qualified name under which a top-level module reaches it (``fc1.weight``; tied weights get
the same one on every worker). A tensor no module holds is named by its position.
"""

from __future__ import annotations

import gc
from collections.abc import Sequence

import torch


def module_names(params: Sequence[torch.Tensor]) -> list[str]:
    """One name per tensor of ``params``: its qualified name in a module, else ``param.<position>``."""
    wanted = {id(p) for p in params}
    modules = [obj for obj in gc.get_objects() if issubclass(type(obj), torch.nn.Module)]
    parents: dict[int, list[tuple[torch.nn.Module, str]]] = {}
    owners: dict[int, list[tuple[torch.nn.Module, str]]] = {}
    for module in modules:
        for name, child in module._modules.items():
            if child is not None:
                parents.setdefault(id(child), []).append((module, name))
        for name, p in module._parameters.items():
            if p is not None and id(p) in wanted:
                owners.setdefault(id(p), []).append((module, name))
    cache: dict[int, str] = {}

    def path(module: torch.nn.Module, depth: int = 0) -> str:
        key = id(module)
        if key not in cache:
            ups = parents.get(key, [])
            if not ups or depth > 64:
                cache[key] = ""
            else:
                cache[key] = min(_join(path(parent, depth + 1), name) for parent, name in ups)
        return cache[key]

    names = []
    for position, p in enumerate(params):
        found = owners.get(id(p))
        names.append(min(_join(path(m), n) for m, n in found) if found else f"param.{position}")
    return _unique(names)


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _unique(names: list[str]) -> list[str]:
    """The same tensor listed twice is refused later; two tensors may still share a found name."""
    seen: dict[str, int] = {}
    out = []
    for name in names:
        count = seen.get(name, 0)
        seen[name] = count + 1
        out.append(name if count == 0 else f"{name}#{count}")
    return out
