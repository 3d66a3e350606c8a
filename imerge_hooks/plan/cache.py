"""Plans remembered on disk, so a restarted job (or another engine over the same model) does not search again.

A plan is kept under a digest of what it was chosen for: the tensor table (names, bytes, dtypes and
which are trainable, in registration order), W, S, the hosts of the ranks and whether they aggregate,
the cost model (its fitted numbers and table) and every setting the search reads, and IMerge's version.
The profile's ready times are not in it: they differ from run to run by noise, and a plan for the
same model on the same cluster is the plan. Files live beside the cost-model cache
(``<cost_model_path's folder>/plans/``); delete the folder to forget them, or pass
``plan_cache=False`` (``IMERGE_PLAN_CACHE=0``). A file is checked against what the planner can
produce for the job's tensors and settings before it is used; one that fails is set aside with one
warning and the plan is searched again (``plan/cache_files.py``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
from collections.abc import Sequence
from typing import Any

from ..core.config import Config
from .cache_files import integer, is_int, is_number, number, read_checked, record, require
from .planner import METHODS, Plan
from .search import MIN_PARTITION_BYTES, PARTITION_FACTORS, SEARCH_ROUNDS, SERVER_WINDOWS

log = logging.getLogger("imerge")

_SETTINGS = ("schedule", "partition_bytes", "credit_bytes", "tail_credit_bytes",
             "fusion_threshold_bytes", "plan_search", "overlap_forward")
_FILE_FIELDS = ("key", "order", "plan", "tail")
_PLAN_FIELDS = tuple(f.name for f in dataclasses.fields(Plan))


@dataclasses.dataclass(frozen=True)
class PlanFit:
    """What a kept plan must fit: the job's tensors (registration order) and the settings that bound
    what the planner returns for them."""

    dtypes: tuple[str, ...]
    trainable: tuple[bool, ...]
    planner: str  # the schedule's planner method, the Plan's ``method``
    partition_bytes: int  # the configured size, where the search starts
    partitioned: bool  # the search may choose a partition size
    staggered: bool  # the search may choose stagger
    tail: bool  # a plan has a tail group


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


def plan_fit(tensors: Sequence[tuple[str, int, str, bool]], cfg: Config) -> PlanFit:
    """What a kept plan for ``tensors`` (as :func:`plan_key` takes them) under ``cfg`` must fit."""
    traits = cfg.traits
    return PlanFit(dtypes=tuple(str(t[2]) for t in tensors), trainable=tuple(bool(t[3]) for t in tensors),
                   planner=traits.planner, partition_bytes=int(cfg.partition_bytes), partitioned=traits.partition,
                   staggered=traits.stagger, tail=traits.tail_credit and cfg.tail_credit_bytes is not None)


def plan_path(cost_model_path: str, key: str) -> str:
    return os.path.join(os.path.dirname(os.path.expanduser(cost_model_path)) or ".", "plans", f"plan-{key[:20]}.json")


def largest_partition(configured: int) -> int:
    """The largest partition size a search from ``configured`` can choose: each of its ``SEARCH_ROUNDS``
    may move to ``max(PARTITION_FACTORS)`` times the size, and a staggered search runs them twice (with
    and without stagger, ``search.searched_plan``)."""
    return int(max(configured, MIN_PARTITION_BYTES) * max(PARTITION_FACTORS) ** (2 * SEARCH_ROUNDS))


def load_plan(path: str, key: str, fit: PlanFit | None = None) -> tuple[list[int], Plan, int | None] | None:
    """``(order, plan, tail group)`` kept under ``key``, or None: no file, or one that fails
    :func:`check_plan_file` (then it is set aside with one warning)."""
    return read_checked(path, "plan cache file", lambda saved: check_plan_file(saved, key, fit),
                        "searching for a plan instead")


def check_plan_file(saved: Any, key: str, fit: PlanFit | None = None) -> tuple[list[int], Plan, int | None]:
    """A plan file's content as :func:`load_plan` returns it, if it is what :func:`store_plan` writes for
    a plan the planner can choose under ``key`` for the job ``fit`` describes; else
    :class:`~.cache_files.UnusableCacheFile` says why.

    The order lists the trainable parameter indices once each; the groups are consecutive runs of its
    positions 0..n-1 that never mix dtypes; times are finite and in FIFO order; method, partition size
    (``MIN_PARTITION_BYTES`` .. :func:`largest_partition`), stagger and tail group are what this
    schedule's planner returns. Without ``fit`` the parameter table is unknown and only the file's own
    consistency is checked.
    """
    record(saved, "the file", _FILE_FIELDS)
    require(saved["key"] == key, "it was kept under another key (another model, cluster or settings)")
    order = _order(saved["order"], fit)
    fields = record(saved["plan"], "plan", _PLAN_FIELDS)
    groups = _groups(fields["groups"], order, fit)
    _times(fields, len(groups))
    method = fields["method"]
    require(method in METHODS and (fit is None or method == fit.planner),
            f"plan.method is {method!r}, not {fit.planner if fit else 'a planner method'}")
    require(isinstance(fields["note"], str), "plan.note is not a string")
    partition = fields["partition_bytes"]
    if partition is not None:
        require(fit is None or fit.partitioned, "plan.partition_bytes is set but the schedule does not partition")
        integer(partition, "plan.partition_bytes", MIN_PARTITION_BYTES,
                largest_partition(fit.partition_bytes) if fit else None)
    stagger = fields["stagger"]
    require(stagger is None or isinstance(stagger, bool), f"plan.stagger is {stagger!r}, not true, false or null")
    require(stagger is None or fit is None or fit.staggered, "plan.stagger is set but the schedule does not stagger")
    waves = fields["waves"]
    require(waves is None or waves is True, f"plan.waves is {waves!r}, not true or null")
    require(waves is None or stagger is True, "plan.waves is set but the plan does not stagger")
    window = fields["server_credit_bytes"]
    if window is not None:
        require(partition is not None, "plan.server_credit_bytes is set without plan.partition_bytes")
        integer(window, "plan.server_credit_bytes", partition, partition * max(SERVER_WINDOWS))
    tail_credit = fields["tail_credit"]
    require(tail_credit is None or tail_credit is False, f"plan.tail_credit is {tail_credit!r}, not false or null")
    require(tail_credit is None or fit is None or fit.tail, "plan.tail_credit is set but this schedule has no tail")
    tail = saved["tail"]
    if (fit is not None and not (fit.tail and groups)) or tail_credit is False:
        require(tail is None, f"tail is {tail!r} but this {'plan' if tail_credit is False else 'schedule'}'s "
                              "plans have no tail group")
    elif fit is not None or tail is not None:
        integer(tail, "tail", 0, len(groups) - 1)
    return list(order), Plan(**fields), tail


def _order(order: Any, fit: PlanFit | None) -> list[int]:
    """The plan's ready order: every trainable parameter index once."""
    require(isinstance(order, list) and all(is_int(i) for i in order), "order is not a list of integers")
    if fit is None:
        require(all(i >= 0 for i in order) and len(set(order)) == len(order), "order repeats or has negative indices")
    else:
        trainable = [i for i, t in enumerate(fit.trainable) if t]
        require(sorted(order) == trainable,
                f"order does not list each of the {len(trainable)} trainable parameter indices once")
    return order


def _groups(groups: Any, order: list[int], fit: PlanFit | None) -> list[list[int]]:
    """The plan's groups: consecutive runs of the positions 0..n-1 of ``order``, one dtype each."""
    require(isinstance(groups, list), "plan.groups is not a list")
    expected = 0
    for g, members in enumerate(groups):
        require(isinstance(members, list) and members, f"plan.groups[{g}] is not a non-empty list")
        for position in members:
            require(is_int(position), f"plan.groups[{g}] holds {position!r}, not a position")
            require(0 <= position < len(order),
                    f"plan.groups[{g}] holds position {position}, outside 0..{len(order) - 1}")
            require(position == expected, f"plan.groups do not cover positions 0..{len(order) - 1} in order, once "
                                          f"each (group {g} holds {position} where {expected} is due)")
            expected += 1
        if fit is not None:
            dtypes = {fit.dtypes[order[position]] for position in members}
            require(len(dtypes) == 1, f"plan.groups[{g}] mixes dtypes {', '.join(sorted(dtypes))}")
    require(expected == len(order), f"plan.groups cover {expected} of the {len(order)} positions")
    return groups


def _times(fields: dict[str, Any], count: int) -> None:
    """The FIFO model's times: a start and an end per group, each group after the one before."""
    starts, ends = fields["group_start"], fields["group_end"]
    for name, values in (("group_start", starts), ("group_end", ends)):
        require(isinstance(values, list) and len(values) == count and all(is_number(v) for v in values),
                f"plan.{name} is not a list of {count} finite numbers")
    end = number(fields["predicted_end"], "plan.predicted_end")
    require(all(s <= e for s, e in zip(starts, ends)) and all(e <= s for e, s in zip(ends, starts[1:])),
            "plan.group_start and plan.group_end are not in FIFO order")
    require(end == (ends[-1] if ends else 0.0), "plan.predicted_end is not the last group's end")


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
