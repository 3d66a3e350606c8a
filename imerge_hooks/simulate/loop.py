"""The event loop: workers' compute and send queues, servers, and the max-min fair network of host links (``_Sim``)."""

from __future__ import annotations

import heapq
import itertools
import math
import random
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..core.layout import key_owner
from ..plan.search import SearchBudgetSpent
from ..worker.schedule import Flow, SchedulePolicy, key_slots
from .results import Event
from .specs import _EPS_T

# Worker operations, and event codes of the heap
_FWD, _BWD, _GATE, _FLUSH, _MARK = range(5)
_EV_COMPUTE, _EV_NET, _EV_CPU, _EV_SHARE, _EV_POSTED, _EV_HANDLED, _EV_REDUCED = range(7)

@dataclass(eq=False, slots=True)
class _Msg:
    """A push (worker -> server) or a result (server -> worker) of one key; with host aggregation also a
    worker's gradient to its host's owner of the key (``contrib``) and the result back (``fwd``)."""

    push: bool
    worker: int
    server: int
    key: int
    nbytes: int
    links: tuple[int, ...]  # (sender's host egress, receiver's host ingress), or (their host's local link,)
    kind: str = ""  # "" (push or result), "contrib" or "fwd"
    pair: tuple[int, int] = (0, 0)  # (sender rank, receiver rank): one message at a time per pair
    start: float = 0.0
    fid: int = -1
    weight: float = 1.0  # share of a bottleneck relative to the other flows (uneven incast sharing)
    coefs: tuple[float, ...] = (1.0, 1.0)  # per link: the bytes it carries per byte of this flow (folding)
    table: _FlowTable | None = None  # the network's flows, while this one is in flight
    row: int = -1  # its row there (-1 until it has one)
    cls: int = -1  # its class there (the same links and coefficients)

    @property
    def rate(self) -> float:
        """Bytes/s while in flight (the max-min fair rate last computed; 0 before the first)."""
        return float(self.table.rate[self.row]) if self.table is not None and self.row >= 0 else 0.0

    @property
    def remaining(self) -> float:
        """Bytes still to send while in flight (as of the network's last advance)."""
        if self.table is not None and self.row >= 0:
            return float(self.table.remaining[self.row])
        return float(self.nbytes)


@dataclass(slots=True)
class _Worker:
    ptr: int = 0
    flow: Flow = field(default_factory=lambda: Flow(SchedulePolicy()))  # its ready keys and credit
    missing: set = field(default_factory=set)  # groups the current gate still waits for
    key_meta: dict = field(default_factory=dict)  # owned key -> (priority, urgent) until its host's sum is ready
    wait_start: float = 0.0
    op_start: float = 0.0


def max_min_levels(links: np.ndarray, coefs: np.ndarray, weight: np.ndarray, capacity: np.ndarray,
                   tie: float = 1e-12) -> np.ndarray:
    """Weighted max-min fair allocation by progressive filling, vectorised: flow i's rate is
    ``weight[i]`` x the level returned for it.

    Flow i crosses links ``links[i, j]``, each carrying ``coefs[i, j]`` bytes per byte of the flow; link id
    ``len(capacity)`` pads the row of a flow that crosses fewer links (its coefficient does not matter).
    Weights and the other coefficients must be positive. Each round finds the smallest share per unit of
    weight (capacity left / the weight x coefficient of its unfrozen flows) over the links that still
    carry unfrozen flows, freezes every unfrozen flow that crosses a link within ``tie`` (relative) of
    that level at this level, and takes their rates off every link they cross (never below 0).
    Symmetric workers make many links tie, so a handful of rounds suffice. With all weights and
    coefficients 1 this is plain max-min fairness. A flow whose link is already full gets level 0.
    """
    n = len(weight)
    level = np.zeros(n)
    if not n:
        return level
    pad = len(capacity)
    size = pad + 1
    cap = np.empty(size)
    cap[:pad] = capacity
    cap[pad] = np.inf  # limits nothing: never the smallest share
    # One row per link slot, one column per unfrozen flow: ravel() is then a view, and the slots of the
    # flows taken out of a round are whole columns.
    at = np.ascontiguousarray(links.T)
    load_of = np.ascontiguousarray((coefs * weight[:, None]).T)  # its weight on each link it crosses
    rows = np.arange(n)
    load = np.bincount(at.ravel(), load_of.ravel(), size)  # the unfrozen flows' weight on every link
    with np.errstate(divide="ignore", invalid="ignore"):  # links without unfrozen flows: x / 0, 0 / 0
        while True:
            share = cap / load
            fill = np.fmin.reduce(share)  # NaN (a full link without flows) is no share
            hit = np.logical_or.reduce((share <= fill * (1.0 + tie)).take(at))  # crosses a link at the level
            if np.count_nonzero(hit) == len(rows):
                level[rows] = fill
                return level
            level[rows[hit]] = fill
            keep = (~hit).nonzero()[0]
            rows, at, load_of = rows.take(keep), at.take(keep, axis=1), load_of.take(keep, axis=1)
            left = np.bincount(at.ravel(), load_of.ravel(), size)
            cap -= fill * (load - left)  # the rates just frozen (all at this level)
            np.maximum(cap, 0.0, out=cap)
            load = left


_GAP = np.array([0.0, math.inf, 0.0, 0.0])  # a finished flow's row in _FlowTable.vals


class _FlowTable:
    """The flows in flight as numpy rows, in the order they started (rows 0..n-1, row i is flow ``msgs[i]``;
    flows started since the last array operation wait in ``pending``), so that advancing them, finding
    the next to finish and their rates are whole-array operations. A finished flow leaves a gap (weight
    and rate 0, infinitely many bytes left: never due) until gaps are half the rows.

    Flows that cross the same links with the same coefficients form a class: they freeze together in the
    progressive filling, so the max-min levels are computed over classes with their flows' summed
    weights, and a flow's rate is its weight x its class's level. Workers repeat the same traffic
    pattern every iteration, so the levels are kept per pattern (the classes' summed weights): a
    pattern met again costs a lookup. Without a fabric, a host's local link carries only the transfers
    inside the host, which cross no other link: their level is the link's capacity / their weight on it
    (as progressive filling gives them), and they are left out of the pattern, which they would
    multiply."""

    _MEMO_BYTES = 128 << 20  # the kept levels are dropped past this size

    def __init__(self, capacity: np.ndarray, fabric: bool, local_from: int) -> None:
        self.capacity = capacity  # per link id; the last one is the fabric
        self.pad = len(capacity)
        self.fabric = len(capacity) - 1 if fabric else self.pad
        self.local_from = local_from if not fabric else self.pad  # local link ids (to the fabric's)
        self.n = 0
        self.gaps = 0
        self.msgs: list[_Msg | None] = []  # by row (None: a gap)
        self.pending: list[_Msg] = []
        self.class_of: dict[tuple, int] = {}  # (links, coefs) -> class
        self.class_rows: list[tuple[tuple[int, int, int], tuple[float, float, float]]] = []
        self.local: list[bool] = []  # per class: on a local link alone
        self.class_links = np.zeros((0, 3), dtype=np.intp)
        self.class_coefs = np.zeros((0, 3))
        self.class_net = np.zeros(0)  # per class: 1 if it is in the pattern, else 0
        self.local_link = np.zeros(0, dtype=np.intp)  # per class: its local link, or the padding id
        self.local_coef = np.zeros(0)  # per class: its coefficient there, or 0
        self.memo: dict[bytes, tuple[np.ndarray, bool]] = {}  # pattern -> levels by class, any of them 0
        self.memo_bytes = 0
        # Since the last rates: each class's weight in minus out (where it is not 0, the pattern or a local
        # link changed), all weights anew, and how many rows (at most) are new, at the end.
        self.delta: dict[int, float] = {}
        self.reweigh = True
        self.unrated = 0
        self.net_level = self.local_level = self.by_class = np.zeros(0)  # the last rates' levels per class
        self.net_zero = self.local_zero = False  # some level is 0 (a full link): the floor applies
        self.any_full = bool(np.count_nonzero(capacity <= 0.0))
        self._resize(256)

    def _resize(self, rows: int) -> None:
        vals = np.zeros((rows, 4))  # weight, bytes left, rate, bytes x 1e-12 (rounding: done when left below)
        cls = np.zeros(rows, dtype=np.intp)
        if self.n:
            vals[:self.n] = self.vals[:self.n]
            cls[:self.n] = self.cls[:self.n]
        self.vals, self.cls = vals, cls
        self.weight, self.remaining, self.rate, self.slack = vals.T

    def add(self, m: _Msg) -> None:
        key = (m.links, m.coefs)
        c = self.class_of.get(key)
        if c is None:
            c = self.class_of[key] = len(self.class_rows)
            two = len(m.links) > 1
            self.class_rows.append(((m.links[0], m.links[1] if two else self.pad, self.fabric),
                                    (m.coefs[0], m.coefs[1] if two else 0.0, 1.0)))
            self.local.append(not two and m.links[0] >= self.local_from)
        m.table, m.cls = self, c
        self.pending.append(m)
        self.delta[c] = self.delta.get(c, 0.0) + m.weight

    def flush(self) -> None:
        """Give the pending flows their rows (rate 0 until the next max-min)."""
        new = self.pending
        if not new:
            return
        if self.gaps and self.n + len(new) > len(self.vals):
            self._compact()
        n, k = self.n, len(new)
        if n + k > len(self.vals):
            self._resize(2 * (n + k))
        self.vals[n:n + k] = [(m.weight, m.nbytes, 0.0, m.nbytes * 1e-12) for m in new]
        self.cls[n:n + k] = [m.cls for m in new]
        for row, m in enumerate(new, n):
            m.row = row
        self.msgs += new
        self.n = n + k
        self.unrated += k
        self.pending = []

    def remove(self, rows: np.ndarray) -> list[_Msg]:
        """Take out the flows of these rows (ascending; flushed); returns them in the order they started."""
        msgs, delta = self.msgs, self.delta
        done = [msgs[row] for row in rows.tolist()]
        for m in done:
            msgs[m.row] = None
            m.table, m.row = None, -1
            delta[m.cls] = delta.get(m.cls, 0.0) - m.weight
        self.vals[rows] = _GAP
        self.gaps += len(done)
        if 2 * self.gaps > self.n:
            self._compact()
        return done

    def _compact(self) -> None:
        keep = [row for row, m in enumerate(self.msgs) if m is not None]
        n = len(keep)
        self.vals[:n] = self.vals[keep]
        self.cls[:n] = self.cls[keep]
        self.msgs = [self.msgs[row] for row in keep]
        for row, m in enumerate(self.msgs):
            m.row = row
        self.n, self.gaps = n, 0

    @property
    def flowing(self) -> int:
        """How many flows have rows."""
        return self.n - self.gaps

    def reweighted(self) -> None:
        """Flows' weights changed (in ``weight``)."""
        self.reweigh = True

    def _new_classes(self) -> None:
        k, have = len(self.class_rows), len(self.class_links)
        links, coefs = zip(*self.class_rows[have:])
        local = np.array(self.local[have:])
        links, coefs = np.array(links, dtype=np.intp), np.array(coefs)
        self.class_links = np.concatenate([self.class_links, links])
        self.class_coefs = np.concatenate([self.class_coefs, coefs])
        self.class_net = np.concatenate([self.class_net, np.where(local, 0.0, 1.0)])
        self.local_link = np.concatenate([self.local_link, np.where(local, links[:, 0], self.pad)])
        self.local_coef = np.concatenate([self.local_coef, np.where(local, coefs[:, 0], 0.0)])
        self.net_level = np.concatenate([self.net_level, np.zeros(k - have)])
        self.local_level = np.concatenate([self.local_level, np.zeros(k - have)])

    def set_rates(self, floor: float) -> None:
        """Every flushed flow's rate: its weight x its class's max-min level (``max_min_levels`` over the
        classes in flight); ``floor`` where that is 0."""
        n = self.n
        if len(self.class_links) < len(self.class_rows):
            self._new_classes()
        k = len(self.class_rows)
        cls = self.cls[:n]
        weight = self.weight[:n]
        changed = [self.reweigh or len(self.by_class) < k] * 2  # of the pattern, on local links
        for c, moved in self.delta.items():
            if moved:
                changed[self.local[c]] = True
        self.delta.clear()
        self.reweigh = False
        net_changed, local_changed = changed
        if not (net_changed or local_changed):  # the same levels: the rows added since need their rates
            new = slice(max(0, n - self.unrated), n)
            np.multiply(self.by_class.take(self.cls[new]), self.weight[new], out=self.rate[new])
        else:
            summed = np.bincount(cls, weight, k)
            if net_changed:
                pattern = summed * self.class_net
                live = pattern.nonzero()[0]
                pattern = pattern.take(live)
                key = live.tobytes() + pattern.tobytes()
                got = self.memo.get(key)
                if got is None:
                    level = max_min_levels(self.class_links.take(live, axis=0), self.class_coefs.take(live, axis=0),
                                           pattern, self.capacity)
                    by_class = np.zeros(k)
                    by_class[live] = level
                    got = by_class, bool(np.count_nonzero(level) < len(level))
                    if self.memo_bytes > self._MEMO_BYTES:
                        self.memo.clear()
                        self.memo_bytes = 0
                    self.memo[key] = got
                    self.memo_bytes += len(key) + by_class.nbytes
                by_class, self.net_zero = got
                if len(by_class) < k:  # kept before classes met since (not in its pattern)
                    by_class = np.concatenate((by_class, np.zeros(k - len(by_class))))
                self.net_level = by_class
            if local_changed:
                load = np.bincount(self.local_link, summed * self.local_coef, self.pad + 1)[:self.pad]
                share = np.zeros(self.pad + 1)
                np.divide(self.capacity, load, out=share[:self.pad], where=load > 0.0)
                self.local_level = share.take(self.local_link)
                self.local_zero = self.any_full and bool(np.count_nonzero((load > 0.0) & (self.capacity <= 0.0)))
            self.by_class = self.net_level + self.local_level
            np.multiply(self.by_class.take(cls), weight, out=self.rate[:n])
        self.unrated = 0
        if self.net_zero or self.local_zero:
            rate = self.rate[:n]
            rate[rate <= 0.0] = floor


class _Sim:
    """The event loop. Ranks: worker r is r, server s is W+s; rank x runs on host ``hosts[x]``. Links:
    host h's egress h, its ingress H+h, and 2H+h for the transfers between its own ranks."""

    def __init__(self, *, fwd: Sequence[float], bwd: Sequence[float], layer_names: Sequence[str],
                 layer_tensors: Sequence[Sequence[int]], groups: Sequence[Sequence[int]],
                 group_keys: Sequence[Sequence[int]], key_bytes: Sequence[int], key_server: Sequence[int],
                 workers: int, servers: int, bandwidth: float, startup: float, priority: bool, stagger: bool,
                 credit: int | None, push_after_backward: bool, overlap: bool, iterations: int,
                 record: bool = True, fabric: float | None = None, share_cv: float = 0.0,
                 share_period: float = 1.0, share_seed: int = 0, tail_group: int | None = None,
                 tail_credit: int | None = None, worker_message: float = 0.0, hosts: Sequence[int] | None = None,
                 aggregate: bool = False, local_bandwidth: float = 2e9, reduce_rate: float = 2e9,
                 fold: int = 1, server_orbits: int | None = None, server_credit: int | None = None,
                 host_fold: int = 1, server_map: Sequence[int] | None = None,
                 worker_rank: Sequence[int] | None = None, waves: bool = False) -> None:
        self._init_fold(workers, servers, server_orbits, fold, host_fold, hosts, bandwidth, startup)
        self._init_host_aggregation(aggregate, local_bandwidth, reduce_rate)
        self.worker_message = float(worker_message)
        self.thread_free = [0.0] * workers  # when each worker's comm thread is next free (worker_message > 0)
        self.fabric = None if fabric is None else float(fabric)
        self.share_cv = float(share_cv)
        self.share_period, self.share_seed = float(share_period), int(share_seed)
        self.share_epoch = 0
        self.share_weights: dict[tuple[int, int], float] = {}
        self.share_event_at = math.inf
        self._init_plan(fwd, bwd, layer_names, layer_tensors, groups, group_keys, key_bytes, key_server, server_map,
                        worker_rank)
        self.priority, self.stagger, self.waves = priority, stagger, waves
        self.push_after_backward, self.iterations = push_after_backward, iterations
        self.record = record
        self.ops = self._build_ops(overlap, push_after_backward, iterations)
        self._init_workers(SchedulePolicy(priority, stagger, credit, tail_credit, server_credit), tail_group,
                           tail_credit, iterations)
        self._init_key_classes()
        self._init_network()
        # Branch and bound (simulate's give_up_s): once every worker started iteration 1, past abort_at the
        # steady iteration time is known to exceed give_up_s; the run stops there (gave_up).
        self.give_up_s: float | None = None
        self.first_started = 0
        self.abort_at = math.inf
        self.gave_up = False
        self.cpu_deadline: float | None = None  # this thread's CPU time (time.thread_time) to stop at
        self.wtrack = [f"worker {r}" for r in range(self.W)]
        self.strack = [f"server {s}" if self.S == servers else f"server orbit {s}" for s in range(self.S)]

    def _init_fold(self, workers: int, servers: int, server_orbits: int | None, fold: int, host_fold: int,
                   hosts: Sequence[int] | None, bandwidth: float, startup: float) -> None:
        """The simulated ranks and their hosts under folding (run.fold_factor): W here are the simulated workers,
        each standing for ``fold``; with ``server_orbits``, the servers are folded too: key k's server is
        key_server[k] % server_orbits (its orbit), the push order still follows key_server (the real servers)
        and ``servers`` (S). ``host_fold`` > 1: alike hosts folded (run.host_fold): ``hosts`` are the simulated
        ranks' hosts, each standing for ``host_fold`` real ones, and a push or result between a host and its own
        server orbit crosses the NIC for all but one of the real hosts it stands for (``_pair_links``)."""
        orbits = servers if server_orbits is None else int(server_orbits)
        self.host_fold = int(host_fold)
        self.W, self.S, self.B, self.startup = workers, orbits, float(bandwidth), float(startup)
        self.real_S = servers
        # Each push and result stands for this many at its (simulated) server: on its link and its work.
        self.fold = float(fold) * orbits / servers
        self.host = list(hosts) if hosts is not None else list(range(workers + orbits))
        self.H = max(self.host) + 1

    def _init_host_aggregation(self, aggregate: bool, local_bandwidth: float, reduce_rate: float) -> None:
        """Host aggregation: each worker's host mates, who pushes each key for its host, and the sums in
        progress (without ``aggregate`` every worker pushes for itself)."""
        workers = self.W
        self.local_B, self.reduce_rate = float(local_bandwidth), float(reduce_rate)
        self.mates = [[m for m in range(workers) if m != r and self.host[m] == self.host[r]] if aggregate else []
                      for r in range(workers)]
        self.host_workers = [sorted([r] + mates) for r, mates in enumerate(self.mates)]  # owner() looks up keys
        self.got: dict[tuple[int, int], int] = {}  # (owner, key) -> its host's gradients in so far
        self.forwarding: dict[tuple[int, int], int] = {}  # (owner, key) -> results still to hand its host
        self.key_pushers: dict[int, list[tuple[int, int]]] = {}  # key class -> the (key, rank) pushes summed

    def _init_plan(self, fwd: Sequence[float], bwd: Sequence[float], layer_names: Sequence[str],
                   layer_tensors: Sequence[Sequence[int]], groups: Sequence[Sequence[int]],
                   group_keys: Sequence[Sequence[int]], key_bytes: Sequence[int], key_server: Sequence[int],
                   server_map: Sequence[int] | None, worker_rank: Sequence[int] | None) -> None:
        """The model, the plan and its keys, and the lookups between them. ``server_map`` gives each real
        server's simulated one (else s % server_orbits) and ``worker_rank`` each simulated worker's real rank
        (its start server with stagger; else its own index)."""
        self.fwd, self.bwd, self.layer_names = list(fwd), list(bwd), list(layer_names)
        self.layer_tensors = [list(t) for t in layer_tensors]
        self.groups = [list(g) for g in groups]
        self.group_keys = [list(k) for k in group_keys]
        self.key_bytes, self.slot_server = list(key_bytes), list(key_server)
        to_orbit = [s % self.S for s in range(self.real_S)] if server_map is None else list(server_map)
        self.key_server = [to_orbit[s] for s in key_server]
        self.worker_rank = list(range(self.W)) if worker_rank is None else list(worker_rank)
        self.key_group = [0] * len(key_bytes)
        for g, keys in enumerate(self.group_keys):
            for k in keys:
                self.key_group[k] = g
        n_tensors = sum(len(t) for t in self.layer_tensors)
        self.tensor_group = [0] * n_tensors
        for g, members in enumerate(self.groups):
            for i in members:
                self.tensor_group[i] = g
        self.group_prio = [min(g) if g else 0 for g in self.groups]

    def _build_ops(self, overlap: bool, push_after_backward: bool, iterations: int) -> list[tuple[int, int, int]]:
        """Every worker's op list (forward, backward, gates, flushes, marks) and the gates: before layer l's
        forward of iteration it > 0, ``gate[l]`` must have finished round it-1 (all groups without
        ``overlap``, before layer 0; with it, the groups holding layer l's tensors)."""
        G, L = len(self.groups), len(self.layer_tensors)
        if overlap:
            self.gate = [sorted({self.tensor_group[i] for i in self.layer_tensors[layer]}) for layer in range(L)]
        else:
            self.gate = [list(range(G))] + [[] for _ in range(L - 1)]
        ops: list[tuple[int, int, int]] = []
        for it in range(iterations):
            for layer in range(L):
                if it > 0 and self.gate[layer]:
                    ops.append((_GATE, layer, it))
                ops.append((_FWD, layer, it))
            for layer in reversed(range(L)):
                ops.append((_BWD, layer, it))
            if push_after_backward:
                ops.append((_FLUSH, 0, it))
        ops += [(_GATE, 0, iterations), (_MARK, 0, iterations)]
        return ops

    def _init_workers(self, policy: SchedulePolicy, tail_group: int | None, tail_credit: int | None,
                      iterations: int) -> None:
        """The workers' send queues and per-group round state, and the servers' threads."""
        W, G = self.W, len(self.groups)
        self.workers = [_Worker(flow=Flow(policy)) for _ in range(W)]
        # Tail credit (schedule): submitting tail_group starts the tail, the last group is urgent.
        self.tail_group = tail_group if tail_credit is not None else None
        self.urgent_group = G - 1 if self.tail_group is not None else -1
        self.arrived = [[0] * G for _ in range(W)]
        self.pending = [[0] * G for _ in range(W)]
        self.done_round = [[0] * G for _ in range(W)]
        self.starts = [[math.nan] * (iterations + 1) for _ in range(W)]
        self.cpu_free = [0.0] * self.S

    def _init_key_classes(self) -> None:
        """A key is summed when every pusher's push is in. With the servers folded, the like keys of a group on
        one orbit (the i-th of the group on each of its real servers) are a class: by the symmetry the fold
        rests on, those keys are summed when the simulated workers pushed all of them."""
        classes: dict[tuple[int, ...], int] = {}
        nth: dict[tuple[int, int], int] = {}  # (group, real server) -> its keys so far
        self.key_class = []
        for k in range(len(self.key_bytes)):
            g, real = self.key_group[k], self.slot_server[k]
            i = nth[(g, real)] = nth.get((g, real), -1) + 1
            self.key_class.append(classes.setdefault((g, self.key_server[k], i) if self.S < self.real_S else (k,),
                                                     len(classes)))
        self.class_count = [0] * len(classes)
        self.class_expected = [0] * len(classes)
        for k in range(len(self.key_bytes)):
            self.class_expected[self.key_class[k]] += len({self.owner(k, r) for r in range(self.W)})

    def _init_network(self) -> None:
        """The connections, the flow table over the links and the event heap."""
        self.channels: dict[tuple[int, int], deque[_Msg]] = {}
        # Active flows; link capacities by id: egress, ingress, local links, then the fabric.
        capacity = np.array([self.B] * (2 * self.H) + [self.local_B] * self.H
                            + [math.inf if self.fabric is None else self.fabric])
        self.net = _FlowTable(capacity, self.fabric is not None, 2 * self.H)
        self.net_t = 0.0
        self.net_dirty = False
        self.net_version = 0
        self.heap: list = []
        self.seq = itertools.count()
        self.fid = itertools.count()
        self.now = 0.0
        self.timeline: list[Event] = []

    # ------------------------------------------------------------------ main loop
    def run(self) -> None:
        for r in range(self.W):
            self._advance(r)
        heap = self.heap
        deadline = self.cpu_deadline
        events = 0
        while True:
            events += 1
            if deadline is not None and not events & 255 and time.thread_time() > deadline:
                raise SearchBudgetSpent("IMerge simulate: the plan search's CPU budget ran out")
            # Flow rates are recomputed once per batch of simultaneous events.
            if self.net_dirty and (not heap or heap[0][0] > self.now + _EPS_T):
                self._reschedule_net()
            if not heap:
                break
            t, _, code, payload = heapq.heappop(heap)
            if code == _EV_NET and payload != self.net_version:
                continue  # superseded by a later rate computation
            if t > self.abort_at and any(w.ptr < len(self.ops) for w in self.workers):
                self.gave_up = True  # the last iteration cannot start by abort_at: slower than give_up_s
                return
            if t < self.now - _EPS_T:  # an event scheduled in the past would run time backwards
                raise RuntimeError(f"IMerge simulate internal: event {code} at {t:.6f} s is before now "
                                   f"({self.now:.6f} s)")
            self.now = t
            if code == _EV_COMPUTE:
                self._compute_done(payload)
            elif code == _EV_NET:
                self._net_event()
            elif code == _EV_SHARE:
                self._new_shares()
            elif code == _EV_POSTED:
                self._send(payload)
            elif code == _EV_HANDLED:
                self._result_handled(payload)
            elif code == _EV_REDUCED:
                self._reduced(*payload)
            else:
                self._cpu_done(*payload)
        stuck = [r for r, w in enumerate(self.workers) if w.ptr < len(self.ops)]
        if stuck:  # cannot happen for a valid layout; a clear message beats a silent NaN
            raise RuntimeError(f"IMerge simulate internal: workers {stuck} did not finish "
                               f"(waiting for groups {sorted(self.workers[stuck[0]].missing)})")

    def owner(self, k: int, r: int) -> int:
        """The worker that pushes key k for worker r's host (r itself without host aggregation)."""
        if not self.mates[r]:
            return r
        host = self.host_workers[r]
        return host[key_owner(k, len(host))]

    def links(self, src: int, dst: int) -> tuple[int, ...]:
        """The links a message from rank ``src`` to rank ``dst`` crosses (module doc of _Sim)."""
        a, b = self.host[src], self.host[dst]
        return (2 * self.H + a,) if a == b else (a, self.H + b)

    def _pair_links(self, src: int, dst: int, coefs: tuple[float, float]) -> tuple[tuple[int, ...], tuple[float, ...]]:
        """Links and coefficients of a push or result between worker and server ranks ``src`` and ``dst``.
        With alike hosts folded, a simulated host and its own server orbit stand for ``host_fold`` hosts each
        with a server: of the real pairs, one in ``host_fold`` is inside a host (its local link, taken as
        free) and the others cross both NICs, so the message crosses this host's NIC with that share of its
        bytes; on average each real NIC then carries what it does unfolded."""
        a, b = self.host[src], self.host[dst]
        if a != b or self.host_fold <= 1:
            return self.links(src, dst), coefs
        share = (self.host_fold - 1) / self.host_fold
        return (a, self.H + b), (coefs[0] * share, coefs[1] * share)

    def _push_event(self, t: float, code: int, payload: Any) -> None:
        heapq.heappush(self.heap, (t, next(self.seq), code, payload))

    # ------------------------------------------------------------------ workers: compute
    def _advance(self, r: int) -> None:
        """Run worker r's ops until it computes (an event is scheduled), waits at a gate, or ends."""
        w = self.workers[r]
        ops = self.ops
        while w.ptr < len(ops):
            code, layer, it = ops[w.ptr]
            if code == _GATE:
                done = self.done_round[r]
                missing = {g for g in self.gate[layer] if done[g] < it}
                if missing:
                    w.missing = missing
                    w.wait_start = self.now
                    return
                w.ptr += 1
            elif code == _FLUSH:
                for g in range(len(self.groups)):
                    self._submit(r, g)
                w.ptr += 1
            elif code == _MARK:
                self.starts[r][it] = self.now
                w.ptr += 1
            else:
                if code == _FWD and layer == 0:
                    self.starts[r][it] = self.now
                    if it == 1 and self.give_up_s is not None:
                        self.first_started += 1
                        if self.first_started == self.W:
                            self.abort_at = (max(s[1] for s in self.starts)
                                             + (self.iterations - 1) * self.give_up_s * (1.0 + 1e-9))
                w.op_start = self.now
                dur = self.fwd[layer] if code == _FWD else self.bwd[layer]
                self._push_event(self.now + dur, _EV_COMPUTE, r)
                return

    def _compute_done(self, r: int) -> None:
        w = self.workers[r]
        code, layer, it = self.ops[w.ptr]
        if self.record:
            kind = "forward" if code == _FWD else "backward"
            self.timeline.append(Event(self.wtrack[r], f"{kind} {self.layer_names[layer]}", w.op_start,
                                       self.now, kind))
        w.ptr += 1
        if code == _BWD:
            arrived = self.arrived[r]
            for i in self.layer_tensors[layer]:
                g = self.tensor_group[i]
                arrived[g] += 1
                if not self.push_after_backward and arrived[g] == len(self.groups[g]):
                    self._submit(r, g)
        self._advance(r)

    def _group_done(self, r: int, g: int) -> None:
        self.done_round[r][g] += 1
        w = self.workers[r]
        if g in w.missing:
            w.missing.discard(g)
            if not w.missing:
                if self.record and self.now > w.wait_start:
                    self.timeline.append(Event(self.wtrack[r], "wait for gradients", w.wait_start, self.now, "wait"))
                w.ptr += 1
                self._advance(r)

    # ------------------------------------------------------------------ workers: send queue
    def _submit(self, r: int, g: int) -> None:
        self.arrived[r][g] = 0
        keys = self.group_keys[g]
        if not keys:
            self._group_done(r, g)
            return
        self.pending[r][g] = len(keys)
        slots = key_slots([self.slot_server[k] for k in keys], self.worker_rank[r], self.real_S, self.stagger,
                          self.waves)
        prio = self.group_prio[g] if self.priority else 0
        w = self.workers[r]
        if g == self.tail_group:
            w.flow.credit.begin_tail(len(self.group_keys[self.urgent_group]))
        urgent = g == self.urgent_group
        for slot in slots:
            k = keys[slot]
            owner = self.owner(k, r)
            if owner != r:  # host aggregation: the gradient goes to the key's owner on this host
                self._send(_Msg(False, r, 0, k, self.key_bytes[k], self.links(r, owner), "contrib", (r, owner)))
            elif self.mates[r]:
                w.key_meta[k] = (prio, urgent)
                self._contribution(r, k)
            else:
                w.flow.ready.add(k, self.key_bytes[k], prio, urgent, self.slot_server[k])
        self._pump(r)

    def _contribution(self, owner: int, k: int) -> None:
        """One more of the host's gradients of key k is at its owner (its own counts): once all are, the
        owner adds them up (``reduce_Bps``) and the sum waits for credit like any push."""
        n = self.got.get((owner, k), 0) + 1
        if n <= len(self.mates[owner]):
            self.got[(owner, k)] = n
            return
        del self.got[(owner, k)]
        self._push_event(self.now + len(self.mates[owner]) * self.key_bytes[k] / self.reduce_rate, _EV_REDUCED,
                         (owner, k))

    def _reduced(self, owner: int, k: int) -> None:
        w = self.workers[owner]
        prio, urgent = w.key_meta.pop(k)
        w.flow.ready.add(k, self.key_bytes[k], prio, urgent, self.slot_server[k])
        self._pump(owner)

    def _pump(self, r: int) -> None:
        w = self.workers[r]
        ready, credit = w.flow.ready, w.flow.credit
        while ready and (k := ready.take(credit)) is not None:
            nbytes = self.key_bytes[k]
            credit.started(nbytes, self.slot_server[k])
            s = self.key_server[k]
            links, coefs = self._pair_links(r, self.W + s, (1.0, self.fold))
            m = _Msg(True, r, s, k, nbytes, links, "", (r, self.W + self.slot_server[k]), coefs=coefs)
            if self.worker_message > 0.0:
                self._push_event(self._thread_slot(r), _EV_POSTED, m)
            else:
                self._send(m)

    def _thread_slot(self, r: int) -> float:
        """Book ``worker_message`` of worker r's comm thread; returns when that work ends."""
        end = max(self.now, self.thread_free[r]) + self.worker_message
        self.thread_free[r] = end
        return end

    # ------------------------------------------------------------------ servers
    def _cpu_done(self, s: int, k: int, r: int) -> None:
        c = self.key_class[k]
        self.class_count[c] += 1
        self.key_pushers.setdefault(c, []).append((k, r))
        if self.class_count[c] < self.class_expected[c]:
            return
        self.class_count[c] = 0
        for key, worker in self.key_pushers.pop(c):
            links, coefs = self._pair_links(self.W + s, worker, (self.fold, 1.0))
            self._send(_Msg(False, worker, s, key, self.key_bytes[key], links, "",
                            (self.W + self.slot_server[key], worker), coefs=coefs))

    def _delivered(self, m: _Msg) -> None:
        if m.kind:
            self._delivered_in_host(m)
            return
        if self.record:
            who = f"key {m.key} (group {self.key_group[m.key]})"
            if m.push:
                self.timeline.append(Event(self.wtrack[m.worker], f"push {who} to server {m.server}",
                                           m.start, self.now, "push", m.nbytes))
                self.timeline.append(Event(self.strack[m.server], f"push {who} from worker {m.worker}",
                                           m.start, self.now, "push", m.nbytes))
            else:
                self.timeline.append(Event(self.strack[m.server], f"result {who} to worker {m.worker}",
                                           m.start, self.now, "pull", m.nbytes))
                self.timeline.append(Event(self.wtrack[m.worker], f"result {who} from server {m.server}",
                                           m.start, self.now, "pull", m.nbytes))
        if m.push:
            self.workers[m.worker].flow.delivered(m.nbytes, self.slot_server[m.key],
                                                  self.key_group[m.key] == self.urgent_group)
            self._pump(m.worker)
            s = m.server
            start = max(self.now, self.cpu_free[s])
            end = start + self.startup * self.fold
            self.cpu_free[s] = end
            if self.record and end > start:
                self.timeline.append(Event(self.strack[s], f"sum key {m.key} from worker {m.worker}",
                                           start, end, "update"))
            self._push_event(end, _EV_CPU, (s, m.key, m.worker))
        elif self.worker_message > 0.0:
            self._push_event(self._thread_slot(m.worker), _EV_HANDLED, m)
        else:
            self._result_handled(m)

    def _delivered_in_host(self, m: _Msg) -> None:
        """A gradient reached its host's owner of the key, or the owner's result reached a worker."""
        src, dst = m.pair
        if self.record:
            what = "gradient to" if m.kind == "contrib" else "result to"
            self.timeline.append(Event(self.wtrack[src], f"{what} worker {dst}: key {m.key}", m.start, self.now,
                                       "push" if m.kind == "contrib" else "pull", m.nbytes))
        if m.kind == "contrib":
            self._contribution(dst, m.key)
            return
        self._key_done(dst, m.key)
        left = self.forwarding[(src, m.key)] - 1
        if left:
            self.forwarding[(src, m.key)] = left
        else:
            del self.forwarding[(src, m.key)]
            self._key_done(src, m.key)

    def _result_handled(self, m: _Msg) -> None:
        """Worker ``m.worker``'s comm thread has handled result ``m``."""
        self._pump(m.worker)
        mates = self.mates[m.worker]
        if mates:  # the owner hands its host the result; the key is done here when they have it
            self.forwarding[(m.worker, m.key)] = len(mates)
            for mate in mates:
                self._send(_Msg(False, mate, 0, m.key, m.nbytes, self.links(m.worker, mate), "fwd",
                                (m.worker, mate)))
            return
        self._key_done(m.worker, m.key)

    def _key_done(self, r: int, k: int) -> None:
        g = self.key_group[k]
        left = self.pending[r][g] - 1
        self.pending[r][g] = left
        if left == 0:
            self._group_done(r, g)

    # ------------------------------------------------------------------ network (fluid, max-min fair)
    def _net_advance(self) -> None:
        dt = self.now - self.net_t
        n = self.net.n
        if dt > 0 and n:
            self.net.remaining[:n] -= self.net.rate[:n] * dt
        self.net_t = self.now

    def _send(self, m: _Msg) -> None:
        queue = self.channels.get(m.pair)
        if queue is None:
            queue = self.channels[m.pair] = deque()
        queue.append(m)
        if len(queue) == 1:
            self._start_flow(m)

    def _start_flow(self, m: _Msg) -> None:
        self._net_advance()
        if m.push and self.share_cv > 0.0:
            if self.share_event_at == math.inf:  # no push was flowing: shares of the period we are in now
                self._enter_share_period()
                self._schedule_share_event()
            m.weight = self._share_weight(m.worker, m.server)
        m.start = self.now
        m.fid = next(self.fid)
        self.net.add(m)
        self.net_dirty = True

    def _net_event(self) -> None:
        self._net_advance()
        net = self.net
        net.flush()
        n = net.n
        remaining, rate = net.remaining[:n], net.rate[:n]
        rows = (remaining <= rate * 1e-10 + net.slack[:n]).nonzero()[0]
        if not rows.size:  # rounding: the flow this event was scheduled for is due now (the first started, on a tie)
            with np.errstate(divide="ignore"):  # a flow started at this instant has no rate yet
                rows = np.argmin(remaining / rate).reshape(1)
        done = net.remove(rows)
        self.net_dirty = True
        for f in done:
            queue = self.channels[f.pair]
            queue.popleft()
            if queue:
                self._start_flow(queue[0])
        for f in done:
            self._delivered(f)

    def _share_weight(self, worker: int, server: int) -> float:
        w = self.share_weights.get((worker, server))
        if w is None:
            w = self.share_weights[(worker, server)] = connection_weight(
                self.share_cv, self.share_seed, self.share_epoch, worker, server)
        return w

    def _enter_share_period(self) -> None:
        """Take the share period ``now`` is in; a new period draws new weights."""
        epoch = int(self.now / self.share_period + 1e-9)
        if epoch != self.share_epoch:
            self.share_epoch = epoch
            self.share_weights.clear()

    def _schedule_share_event(self) -> None:
        self.share_event_at = (self.share_epoch + 1) * self.share_period
        self._push_event(self.share_event_at, _EV_SHARE, None)

    def _new_shares(self) -> None:
        """A share period ended: active pushes get this period's weights (the next event only while pushes flow)."""
        self._net_advance()
        self._enter_share_period()
        pushes = False
        self.net.flush()
        for row, f in enumerate(self.net.msgs):
            if f is not None and f.push:
                f.weight = self.net.weight[row] = self._share_weight(f.worker, f.server)
                pushes = True
        self.net.reweighted()
        self.net_dirty = True
        self.share_event_at = math.inf
        if pushes:
            self._schedule_share_event()

    def _reschedule_net(self) -> None:
        self._net_advance()
        self.net.flush()
        self._max_min()
        self.net_dirty = False
        self.net_version += 1
        n = self.net.n
        if self.net.flowing:
            dt = float(np.fmin.reduce(self.net.remaining[:n] / self.net.rate[:n]))
            self._push_event(self.now + max(dt, 0.0), _EV_NET, self.net_version)

    def _max_min(self) -> None:
        """The flows' weighted max-min fair rates over every link (``_FlowTable.set_rates``): host links of
        capacity B, local links of ``local_B`` and the optional fabric every flow crosses. A flow squeezed
        to zero by rounding still progresses (B x 1e-9)."""
        if self.net.flowing:
            self.net.set_rates(self.B * 1e-9)


def connection_weight(cv: float, seed: int, epoch: int, worker: int, server: int) -> float:
    """The share weight of push connection (worker, server) in share period ``epoch``: log-normal
    with mean 1 and coefficient of variation ``cv``, the same for the same arguments."""
    if cv <= 0.0:
        return 1.0
    sigma2 = math.log1p(cv * cv)
    rng = random.Random(((seed * 1_000_003 + epoch) * 65_537 + worker) * 4099 + server)
    return math.exp(math.sqrt(sigma2) * rng.gauss(0.0, 1.0) - 0.5 * sigma2)


# ---------------------------------------------------------------------------------- layout
