"""Fusion plans: which adjacent gradients travel together as one message.

Every method returns a :class:`Plan` whose groups are contiguous runs of tensor indices in
gradient-READY order (index 0 is ready first) and never mix dtypes. Predicted times come
from one model for all methods: a single FIFO channel where group g starts at
``max(ready time of its tensors, end of group g-1)`` and lasts ``T(bytes)``
(:func:`simulate_fifo`). Under that model ``optimal`` is exact, so comparing methods by
``predicted_end`` is fair.

Ready times need not be sorted: a group is ready when its latest tensor is, which is what
the engine does (it sends a group when every tensor in it is ready).
"""

from __future__ import annotations

import math
from collections.abc import Container, Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from ..core.config import FUSION_THRESHOLD_BYTES
from .costmodel import CostModel, LinearModel, PSModel, mgwfbp_model

METHODS = ("none", "threshold", "mgwfbp", "optimal")
_KiB, _MiB = 1 << 10, 1 << 20


@dataclass
class Plan:
    """Groups of tensor indices (ready order) and their predicted comm start/end times."""

    groups: list[list[int]]
    predicted_end: float
    method: str
    group_start: list[float]
    group_end: list[float]
    note: str = ""  # how the plan was chosen, when more than one method was tried
    partition_bytes: int | None = None  # key size limit the plan was chosen for (None: the configured one)
    stagger: bool | None = None  # whether workers stagger their first server (None: as the schedule says)
    server_credit_bytes: int | None = None  # a worker's window per server (None: one partition, schedule.windows)
    tail_credit: bool | None = None  # False: the search turned the tail credit off (None: as configured)
    waves: bool | None = None  # True: stagger each wave of a group (schedule.key_slots; None: the whole group)

    def describe(self, sizes: Sequence[float]) -> str:
        """Human-readable table: group, tensors, bytes, start, end (ms)."""
        lines = [(f"plan {self.method}: {len(self.groups)} groups, "
                  f"predicted end {self.predicted_end * 1e3:.3f} ms"),
                 f"{'group':>5} {'tensors':>11} {'bytes':>12} {'start ms':>10} {'end ms':>10}"]
        for g, (members, s, e) in enumerate(zip(self.groups, self.group_start, self.group_end)):
            span = f"{members[0]}" if len(members) == 1 else f"{members[0]}-{members[-1]}"
            nbytes = sum(sizes[i] for i in members)
            lines.append(f"{g:>5} {span:>11} {nbytes:>12.0f} {s * 1e3:>10.3f} {e * 1e3:>10.3f}")
        if self.note:
            lines.append(self.note)
        return "\n".join(lines)


def _times(model: CostModel, nbytes: np.ndarray) -> np.ndarray:
    """``model.time`` over an array; uses the model's ``time_array`` when it has one."""
    vec = getattr(model, "time_array", None)
    if vec is not None:
        return np.asarray(vec(nbytes), dtype=float)
    return np.fromiter((model.time(float(m)) for m in np.ravel(nbytes)), dtype=float,
                       count=np.size(nbytes)).reshape(np.shape(nbytes))


def simulate_fifo(groups: Sequence[Sequence[int]], sizes: Sequence[float],
                  ready_times: Sequence[float], cost_model: CostModel
                  ) -> tuple[list[float], list[float]]:
    """Predicted comm (starts, ends) of ``groups`` sent in order over one FIFO channel."""
    starts: list[float] = []
    ends: list[float] = []
    prev_end = -math.inf
    for members in groups:
        if not members:
            raise ValueError("IMerge: a plan group is empty")
        ready = max(float(ready_times[i]) for i in members)
        start = max(ready, prev_end)
        end = start + float(cost_model.time(float(sum(sizes[i] for i in members))))
        starts.append(start)
        ends.append(end)
        prev_end = end
    return starts, ends


def _run_starts(dtypes: Sequence[str] | None, n: int) -> list[int]:
    """For each index, the first index of its run of equal dtypes (groups must not cross)."""
    first = [0] * n
    for i in range(1, n):
        first[i] = first[i - 1] if dtypes is None or dtypes[i] == dtypes[i - 1] else i
    return first


def fill_buckets(items: Iterable[int], sizes: Sequence[float], cap: float, *, first_cap: float | None = None,
                 breaks: Container[int] = ()) -> list[list[int]]:
    """Greedy bucket fill, the rule of Horovod's fusion threshold and of DDP's buckets: ``items`` in order go
    into the open bucket, which closes once it holds at least its cap (``sizes[item]`` summed): ``first_cap``
    for the first bucket (None: ``cap``, DDP's first bucket is smaller), ``cap`` for the others. An item in
    ``breaks`` closes the open bucket before it joins (the planner: a new dtype run). Returns the buckets, in
    order, as lists of items."""
    buckets: list[list[int]] = []
    current: list[int] = []
    filled = 0  # int sizes stay exact; float sizes sum exactly as from 0.0
    for i in items:
        if current and i in breaks:
            buckets.append(current)
            current, filled = [], 0
        current.append(i)
        filled += sizes[i]
        if filled >= (first_cap if first_cap is not None and not buckets else cap):
            buckets.append(current)
            current, filled = [], 0
    if current:
        buckets.append(current)
    return buckets


def _linear_fit_of(model: CostModel) -> LinearModel:
    """The alpha-beta line MG-WFBP needs: the model itself, a PS table's :func:`mgwfbp_model`, or
    (any other model) a fit on 1 KiB..64 MiB."""
    if isinstance(model, LinearModel):
        return model
    if isinstance(model, PSModel):
        return mgwfbp_model(model)
    grid = np.geomspace(_KiB, 64 * _MiB, 17)
    return LinearModel.fit(grid.tolist(), _times(model, grid).tolist())


def _plan_mgwfbp(sizes: Sequence[float], ready: np.ndarray, run_start: list[int],
                 lin: LinearModel) -> list[list[int]]:
    """MG-WFBP greedy merge (Shi, Chu, Li, INFOCOM 2019; TPDS 2021 extension).

    Rule implemented (as in the authors' reference code, HKBU-HPML/MG-WFBP
    ``_generate_groups_mgwfbp``, translated to ready order): walk tensors from the one
    ready first. Keep the current open group (ending at tensor l), with
    ``tau_c`` = the time its message would start (``max(ready_l, end of the previous
    group)``) and ``t_c = alpha + beta*bytes(group)``. Let ``r`` be the ready time of tensor
    l+1. Merge tensor l+1 into the group iff (dtypes equal and)

        r < tau_c + t_c                        (the message would not be done when l+1 is ready)
        and (tau_c > r                         (it could not even start: merging is free)
             or r - tau_c < alpha)             (waiting for l+1 costs less than the alpha saved)

    Otherwise the group is closed, its message ends at ``tau_c + t_c``, and l+1 opens the
    next group. All decisions use the alpha-beta line only: on a PS table, the line of
    ``costmodel.mgwfbp_model`` (alpha = what one message more costs the servers working in
    parallel, beta = the per-byte time of one direction), not the isolated round trip's.

    The rule assumes one channel that carries one message at a time. A PS round trip is two
    stages (push, then result, in opposite directions of the links) and consecutive groups
    overlap the stages, so a merge the rule finds free (tensor l+1 ready before the channel is)
    still costs the overlap of the merged bytes; the rule is kept as published and does not see it.
    """
    n = len(sizes)
    groups: list[list[int]] = []
    cur = [0]
    cur_bytes = float(sizes[0])
    cur_ready = float(ready[0])
    prev_end = -math.inf
    for nxt in range(1, n):
        tau_c = max(cur_ready, prev_end)
        t_c = lin.time(cur_bytes)
        r = float(ready[nxt])
        merge = False
        if run_start[nxt] != nxt and r < tau_c + t_c:
            merge = tau_c > r or (r - tau_c) < lin.alpha
        if merge:
            cur.append(nxt)
            cur_bytes += float(sizes[nxt])
            cur_ready = max(cur_ready, r)
        else:
            groups.append(cur)
            prev_end = tau_c + t_c
            cur, cur_bytes, cur_ready = [nxt], float(sizes[nxt]), r
    groups.append(cur)
    return groups


def _plan_optimal(sizes: Sequence[float], ready: np.ndarray, run_start: list[int],
                  model: CostModel) -> list[list[int]]:
    """Exact DP for one FIFO channel and any monotone T (1-based, R'_i = max ready of 1..i):

        F(0) = -inf,  F(i) = min over j < i of  max(R'_i, F(j)) + T(bytes(j+1..i)),

    with j >= (first index of i's dtype run) so no group mixes dtypes. Using the running
    maximum R'_i is exact because F(j) >= R'_j. O(L^2), inner loop vectorised.
    """
    n = len(sizes)
    prefix = np.concatenate(([0.0], np.cumsum(np.asarray(sizes, dtype=float))))
    rmax = np.maximum.accumulate(ready)
    f = np.full(n + 1, math.inf)
    f[0] = -math.inf
    arg = np.zeros(n + 1, dtype=np.int64)
    for i in range(1, n + 1):
        lo = run_start[i - 1]  # j ranges over lo..i-1 (1-based group j+1..i)
        js = np.arange(lo, i)
        cost = np.maximum(rmax[i - 1], f[lo:i]) + _times(model, prefix[i] - prefix[lo:i])
        k = int(np.argmin(cost))
        f[i], arg[i] = cost[k], js[k]
    groups: list[list[int]] = []
    i = n
    while i > 0:
        j = int(arg[i])
        groups.append(list(range(j, i)))
        i = j
    groups.reverse()
    return groups


def plan(sizes: Sequence[float], ready_times: Sequence[float], cost_model: CostModel,
         method: str, *, fusion_threshold_bytes: float = FUSION_THRESHOLD_BYTES,
         dtypes: Sequence[str] | None = None) -> Plan:
    """Group tensors (given in gradient-ready order) into messages with ``method``.

    ``sizes`` in bytes, ``ready_times`` in seconds (same order), ``dtypes`` optional dtype
    names; a group never mixes dtypes. Methods: ``none`` (one message per tensor),
    ``threshold`` (buckets closed at ``fusion_threshold_bytes``), ``mgwfbp`` (greedy rule on
    an alpha-beta line), ``optimal`` (exact DP on ``cost_model``).
    """
    if method not in METHODS:
        raise ValueError(f"IMerge: unknown plan method {method!r}; choose one of {', '.join(METHODS)}")
    n = len(sizes)
    if len(ready_times) != n:
        raise ValueError(f"IMerge: plan got {n} sizes but {len(ready_times)} ready times")
    if dtypes is not None and len(dtypes) != n:
        raise ValueError(f"IMerge: plan got {n} sizes but {len(dtypes)} dtypes")
    bad = [i for i, s in enumerate(sizes) if not (math.isfinite(float(s)) and float(s) >= 0)]
    if bad:
        raise ValueError(f"IMerge: tensor sizes must be finite and >= 0; bad at indices {bad[:10]}")
    bad = [i for i, t in enumerate(ready_times) if not math.isfinite(float(t))]
    if bad:
        raise ValueError(f"IMerge: ready times must be finite; bad at indices {bad[:10]}")
    if method == "threshold" and not fusion_threshold_bytes > 0:
        raise ValueError(f"IMerge: fusion_threshold_bytes must be positive, got {fusion_threshold_bytes}")
    if n == 0:
        return Plan(groups=[], predicted_end=0.0, method=method, group_start=[], group_end=[])

    sizes_f = [float(s) for s in sizes]
    ready = np.asarray(ready_times, dtype=float)
    run_start = _run_starts(dtypes, n)
    if method == "none":
        groups = [[i] for i in range(n)]
    elif method == "threshold":
        run_heads = {i for i, first in enumerate(run_start) if first == i}
        groups = fill_buckets(range(n), sizes_f, float(fusion_threshold_bytes), breaks=run_heads)
    elif method == "mgwfbp":
        groups = _plan_mgwfbp(sizes_f, ready, run_start, _linear_fit_of(cost_model))
    else:
        groups = _plan_optimal(sizes_f, ready, run_start, cost_model)
    starts, ends = simulate_fifo(groups, sizes_f, ready.tolist(), cost_model)
    return Plan(groups=groups, predicted_end=ends[-1], method=method,
                group_start=starts, group_end=ends)
