"""Plans remembered on disk, so a restarted job (or another engine over the same model) does not search again.

A plan is kept under a digest of what it was chosen for: the tensor table (names, bytes, dtypes and
which are trainable, in registration order), W, S, the hosts of the ranks and whether they aggregate,
the cost model (its fitted numbers and table) and every setting the search reads, and IMerge's version.
The profile's ready times are not in it: they differ from run to run by noise, and a plan for the
same model on the same cluster is the plan. Files live beside the cost-model cache
(``<cost_model_path's folder>/plans/``); delete the folder to forget them, or pass
``plan_cache=False`` (``IMERGE_PLAN_CACHE=0``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
from collections.abc import Sequence
from typing import Any

from ..config import Config
from .planner import Plan

log = logging.getLogger("imerge")

_SETTINGS = ("schedule", "partition_bytes", "credit_bytes", "tail_credit_bytes",
             "fusion_threshold_bytes", "plan_search", "overlap_forward")


def plan_key(tensors: Sequence[tuple[str, int, str, bool]], cfg: Config, workers: int, servers: int,
             hosts: Sequence[int] | None, aggregate: bool, model: Any) -> str:
    """The digest a plan is kept under (see the module doc). ``tensors``: (name, bytes, dtype, trainable)."""
    from .. import __version__

    describe = getattr(model, "to_dict", None)
    what = {"version": __version__, "tensors": [list(t) for t in tensors], "workers": workers, "servers": servers,
            "hosts": list(hosts) if hosts is not None else None, "aggregate": bool(aggregate),
            "model": describe() if describe is not None else repr(model),
            "settings": {name: getattr(cfg, name) for name in _SETTINGS}}
    return hashlib.sha1(json.dumps(what, sort_keys=True, default=str).encode()).hexdigest()


def plan_path(cost_model_path: str, key: str) -> str:
    return os.path.join(os.path.dirname(os.path.expanduser(cost_model_path)) or ".", "plans", f"plan-{key[:20]}.json")


def load_plan(path: str, key: str) -> tuple[list[int], Plan, int | None] | None:
    """``(order, plan, tail group)`` kept under ``key``, or None (no file, another key, unreadable)."""
    try:
        with open(path) as f:
            saved = json.load(f)
        if saved.get("key") != key:
            return None
        return list(saved["order"]), Plan(**saved["plan"]), saved["tail"]
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        log.warning("IMerge: ignoring unreadable plan cache %s (%s)", path, exc)
        return None


def store_plan(path: str, key: str, order: Sequence[int], plan: Plan, tail: int | None) -> None:
    """Keep a plan (written to a temporary file and renamed, so a reader never sees half of one)."""
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        temporary = f"{path}.{os.getpid()}.tmp"
        with open(temporary, "w") as f:
            json.dump({"key": key, "order": list(order), "plan": dataclasses.asdict(plan), "tail": tail}, f)
        os.replace(temporary, path)
    except OSError as exc:
        log.warning("IMerge: could not keep the plan in %s (%s)", path, exc)
