"""Discrete-event simulator of IMerge training iterations (pure Python, no MPI): what-if at scale.

Given per-layer compute times (a :class:`ModelSpec`, e.g. from ``benchmarks/profiles/*.json``)
and a cluster (:class:`ClusterSpec`), :func:`simulate` replays ``iterations`` training
iterations of every worker under one schedule and returns the steady-state iteration time,
the throughput and a timeline (:meth:`SimResult.to_chrome_trace` writes it for Perfetto)::

    from imerge_hooks.simulate import ClusterSpec, ModelSpec, simulate
    model = ModelSpec.from_profile_json("benchmarks/profiles/resnet50-cpu.json")
    cluster = ClusterSpec(workers=16, servers=4, bandwidth_Bps=1.25e9, startup_s=50e-6)
    for schedule in ("wfbp", "adaptive-ps", "imerge"):
        print(schedule, simulate(model, cluster, schedule).throughput)

What is modelled (and how; each choice mirrors the runtime in ``engine``/``scheduler``/``server``):

* **Compute.** Each worker runs the forward of layers 0..L-1, then the backward of layers
  L-1..0, one after another; times are the spec's times times ``ClusterSpec.time_scale``.
  A tensor's gradient is ready when its layer's backward ends; the gradient-ready order is
  reverse registration order (ties inside a layer: later-registered first, as the profiler).
* **Plan.** Groups come from :func:`imerge_hooks.plan.planner.plan` on the tensors in ready order,
  with ready times measured from the start of backward (``none`` for default/wfbp/priority:
  one group per tensor). ``mgwfbp`` and ``optimal`` need a cost model: ``cost_model`` or, when
  None, :func:`calibrate_model` (what ``python -m imerge_hooks.plan.calibrate`` would measure on
  the simulated cluster); ``mgwfbp`` gets the alpha-beta line fitted to a PSModel's table,
  as ``replan`` does. ``optimal`` (adaptive-ps, imerge) also searches, as the engine does
  (:mod:`imerge_hooks.plan.search`): each candidate plan is simulated on this model and
  cluster and the fastest is kept (``plan_search=False``: the DP's plan alone).
* **Keys and placement.** ``priority``/``imerge`` cut each group into keys of at most
  ``partition_bytes`` (by bytes; the runtime cuts by elements, the same for 4-byte floats and
  a power-of-two partition size); every group of at least S x 64 KiB is also spread over
  the S servers in equal keys. Keys are placed in plan order, each on the server with the
  fewest bytes so far (``layout.Placement``).
* **Worker send queue** (``CommThread``). ``default`` submits every group, in plan order,
  after the whole backward; other schedules submit a group as soon as all its tensors are
  ready. A submitted group's keys enter a ready queue: FIFO, or lowest ``priority`` first
  (the group's smallest tensor index = its front-most layer) when the schedule has priority.
  With ``stagger`` worker r rotates each group's key sequence to start at server r % S.
  Partitioned schedules keep at most ``credit_bytes`` of pushes in flight (always at least
  one; head-of-line: the next key waits until it fits); credit returns when a push has been
  delivered to the server. Non-partitioned schedules have no credit limit. A started push is
  queued on its connection (below), so priority reorders only what waits for credit.
  With ``ClusterSpec.worker_message_s`` > 0 the worker's comm thread is a serial resource:
  posting a push and handling a result each take it that long, in the order they come (a push
  flows only once posted; a result counts only once handled). Keys wait in the runtime's own
  :class:`~imerge_hooks.schedule.ReadyQueue` under its :class:`~imerge_hooks.schedule.Credit`.
* **Network: fluid, max-min fair (processor sharing).** Every host has an egress and an
  ingress link of ``bandwidth_Bps`` (workers: push out / pull in; servers: push in / result
  out). A message in flight is a flow through its sender's egress and its receiver's
  ingress; the rates of all flows are the max-min fair allocation over all links,
  recomputed whenever a flow starts or ends (like TCP through netlab's shaped ports). Between
  one sender and one receiver messages go in order, one at a time (one MPI connection per
  pair: MPI's non-overtaking rule), so at most one flow per (sender, receiver) pair.
  No propagation latency (fold it into ``startup_s``).
  **Uneven incast sharing** (``ClusterSpec.share_cv > 0``): TCP flows from many senders into one
  shaped port do not get equal shares: the workers' push rates into a saturated server spread
  unevenly, and a share persists for up to about a second, while results (one sender, many
  receivers) share evenly (``benchmarks/netlab/linkmon.py`` measures both; ``benchmarks/run.py``
  feeds them to the validation). So every push connection (worker, server) gets a weight,
  log-normal with mean 1 and that CV, drawn afresh every ``share_period_s`` (deterministic per
  connection and period, from ``share_seed``), and rates are the *weighted* max-min fair
  allocation. It matters
  because a key completes only when its slowest push has arrived. With ``ClusterSpec.fabric_Bps`` every
  flow also crosses one shared link of that rate: what a cluster moves with every link busy both
  ways at once (``benchmarks/netlab/duplex_probe.py``), a little less than its links' goodput.
* **Server.** Each push, once delivered, costs ``startup_s`` of the server's single thread
  (the Python loop's per-message probe/receive/sum work), FIFO over all workers' pushes, so a
  W-way incast pays W startups in a row. When a key has all W pushes the server sends the sum
  to all W workers at once (W flows sharing its egress). Results cost no server time.
* **Completion and the next iteration.** A group is done at a worker when all its keys'
  results arrived there. Without overlap the worker's next forward starts when all its groups
  are done; with overlap (``imerge``) the forward of each layer waits only for the groups
  holding that layer's tensors (front layers first). Update and optimizer time are ignored.

``SimResult.iteration_s`` is the time between consecutive starts of layer 0's forward (the
latest worker), averaged over all iterations but the first (the first one starts with no
communication pending); with ``iterations=1`` it is that single iteration.
"""

from __future__ import annotations

import dataclasses
import functools
import heapq
import itertools
import json
import math
import numbers
import os
import random
import time
from collections import Counter, deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from .config import (
    CREDIT_BYTES,
    FUSION_THRESHOLD_BYTES,
    PARTITION_BYTES,
    SCHEDULE_TRAITS,
    SCHEDULES,
    TAIL_CREDIT_BYTES,
)
from .layout import CALIBRATION_GRID, Placement, calibration_keys, cut_keys, key_owner, link_bytes
from .plan.costmodel import CostModel, LinearModel, PSModel, planner_model
from .plan.planner import Plan, plan
from .plan.search import SearchBudgetSpent, candidate_plans, searched_plan
from .schedule import Credit, ReadyQueue, key_slots, tail_group
from .timeline import dump_trace, lane_metadata, span_event, track_metadata

# Sizes that calibrate_model "measures" (the grid of imerge_hooks.plan.calibrate: 1 KiB .. 64 MiB).
EVENT_KINDS = ("forward", "backward", "push", "pull", "wait", "update")

# Events closer than this (seconds) count as simultaneous: they are handled as one batch before
# flow rates are recomputed (symmetric workers make many events coincide).
_EPS_T = 1e-12
# A cluster of more than FOLD_ABOVE alike workers is simulated through at least FOLD_WORKERS that stand
# for all (fold_factor).
FOLD_WORKERS = 4
FOLD_ABOVE = 16


# ---------------------------------------------------------------------------------- specs
@dataclass
class LayerSpec:
    """One layer: its parameter tensors' sizes (bytes, registration order) and compute times (s)."""

    name: str
    param_bytes: list[int]
    forward_s: float
    backward_s: float


@dataclass
class ModelSpec:
    """A model as the simulator sees it: layers in forward (registration) order."""

    layers: list[LayerSpec]
    batch_size: int
    name: str = "model"

    @classmethod
    def from_profile_json(cls, path: str | os.PathLike[str]) -> ModelSpec:
        """Read a profile of ``benchmarks/make_profiles.py``::

            {"model": str, "device": str, "batch_size": int,
             "layers": [{"name": ..., "forward_s": ..., "backward_s": ...,
                         "params": [{"name": ..., "shape": [...], "bytes": int}]}]}

        Other top-level keys are ignored.
        """
        path = os.fspath(path)
        try:
            with open(path) as f:
                data = json.load(f)
        except json.JSONDecodeError as exc:
            raise ValueError(f"IMerge simulate: {path} is not valid JSON: {exc}") from None
        if not isinstance(data, dict) or not isinstance(data.get("layers"), list):
            raise ValueError(f"IMerge simulate: {path} is not a profile (no 'layers' list)")
        layers = []
        for i, layer in enumerate(data["layers"]):
            try:
                layers.append(LayerSpec(name=str(layer["name"]),
                                        param_bytes=[int(p["bytes"]) for p in layer.get("params", [])],
                                        forward_s=float(layer["forward_s"]),
                                        backward_s=float(layer["backward_s"])))
            except (KeyError, TypeError, ValueError, AttributeError) as exc:
                name = layer.get("name", "?") if isinstance(layer, dict) else layer
                raise ValueError(f"IMerge simulate: {path}: layer {i} ({name!r}) is malformed: "
                                 f"missing or bad {exc}") from None
        if "batch_size" not in data:
            raise ValueError(f"IMerge simulate: {path}: profile has no 'batch_size'")
        spec = cls(layers=layers, batch_size=int(data["batch_size"]),
                   name=str(data.get("model", os.path.splitext(os.path.basename(path))[0])))
        spec.check()
        return spec

    @property
    def tensor_bytes(self) -> list[int]:
        """Bytes of every tensor, in registration order (layer by layer)."""
        return [b for layer in self.layers for b in layer.param_bytes]

    @property
    def total_bytes(self) -> int:
        return sum(self.tensor_bytes)

    def check(self) -> None:
        """Raise ValueError (naming the layer) for an unusable spec."""
        if not self.layers:
            raise ValueError(f"IMerge simulate: model {self.name!r} has no layers")
        bs = self.batch_size
        if isinstance(bs, bool) or not isinstance(bs, numbers.Integral) or bs < 1:
            raise ValueError(f"IMerge simulate: batch_size must be an int >= 1, got {self.batch_size!r}")
        for i, layer in enumerate(self.layers):
            where = f"IMerge simulate: model {self.name!r} layer {i} ({layer.name!r})"
            for what in ("forward_s", "backward_s"):
                v = getattr(layer, what)
                if isinstance(v, bool) or not isinstance(v, numbers.Real) or not (math.isfinite(v) and v >= 0):
                    raise ValueError(f"{where}: {what} must be a finite number >= 0, got {v!r}")
            for b in layer.param_bytes:
                if isinstance(b, bool) or not isinstance(b, numbers.Integral) or b < 0:
                    raise ValueError(f"{where}: param_bytes must be ints >= 0, got {layer.param_bytes!r}")


@dataclass(frozen=True)
class ClusterSpec:
    """W workers and S servers, one NIC each.

    ``bandwidth_Bps``: bytes/s of every host's NIC, in each direction. ``startup_s``: the
    server's serial work per push message (see the module doc); a PSModel's startup ``a``
    measured with W workers is about ``W * startup_s``, so build the spec from a measured
    model with :meth:`from_psmodel`. ``time_scale``: factor on the model's compute times
    (replay a profile as a faster or slower device). ``fabric_Bps``: optional cap on the sum of
    all flows' rates, a link every flow crosses. None: the links alone; set it to what the
    cluster moves with every link busy both ways (``benchmarks/netlab/duplex_probe.py`` measures
    it, a little less than the links' TCP goodput; ``netlab/fabric_scaling.py`` at several link
    rates). ``share_cv``/``share_period_s``: how
    unevenly pushes into one server share its ingress, and for how long a share persists (0: max-min
    fair; the module doc has the model; ``benchmarks/netlab/linkmon.py`` measures both).
    ``worker_message_s``: wall time of a worker's comm thread per message (posting a push, or
    handling a result), one message at a time per worker; 0 (the default): free. A what-if knob:
    a serial per-message cost is hidden behind the network until it fills the thread, and then the
    iteration grows abruptly, so it cannot explain a gradual cost of many keys on an oversubscribed
    host (``tests/test_simulate.py``, ``test_worker_message_cost_*``, checks both by hand).
    """

    workers: int
    servers: int
    bandwidth_Bps: float
    startup_s: float
    time_scale: float = 1.0
    fabric_Bps: float | None = None
    share_cv: float = 0.0
    share_period_s: float = 1.0
    share_seed: int = 0
    worker_message_s: float = 0.0
    hosts: tuple[int, ...] | None = None
    host_aggregation: bool = True
    local_Bps: float = 2e9
    reduce_Bps: float = 2e9

    def __post_init__(self) -> None:
        for what in ("workers", "servers"):
            v = getattr(self, what)
            if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < 1:
                raise ValueError(f"IMerge simulate: ClusterSpec.{what} must be an int >= 1, got {v!r}")
            object.__setattr__(self, what, int(v))
        for what, positive in (("bandwidth_Bps", True), ("startup_s", False), ("time_scale", True),
                               ("share_cv", False), ("share_period_s", True), ("worker_message_s", False)):
            v = getattr(self, what)
            ok = (not isinstance(v, bool) and isinstance(v, numbers.Real) and math.isfinite(v)
                  and (v > 0 if positive else v >= 0))
            if not ok:
                raise ValueError(f"IMerge simulate: ClusterSpec.{what} must be a finite number "
                                 f"{'> 0' if positive else '>= 0'}, got {v!r}")
        v = self.fabric_Bps
        if v is not None and (isinstance(v, bool) or not isinstance(v, numbers.Real) or not math.isfinite(v)
                              or v <= 0):
            raise ValueError(f"IMerge simulate: ClusterSpec.fabric_Bps must be None or a finite number > 0, got {v!r}")
        for what in ("local_Bps", "reduce_Bps"):
            v = getattr(self, what)
            if isinstance(v, bool) or not isinstance(v, numbers.Real) or not math.isfinite(v) or v <= 0:
                raise ValueError(f"IMerge simulate: ClusterSpec.{what} must be a finite number > 0, got {v!r}")
        if self.hosts is not None:
            hosts = tuple(self.hosts)
            if len(hosts) != self.workers + self.servers or any(
                    isinstance(h, bool) or not isinstance(h, numbers.Integral) or h < 0 for h in hosts):
                raise ValueError(f"IMerge simulate: ClusterSpec.hosts must give a host index >= 0 to each of the "
                                 f"{self.workers + self.servers} ranks (workers, then servers), got {self.hosts!r}")
            object.__setattr__(self, "hosts", tuple(int(h) for h in hosts))

    @property
    def rank_hosts(self) -> tuple[int, ...]:
        """The host of every rank (workers, then servers): ``hosts``, or one host per rank."""
        return self.hosts if self.hosts is not None else tuple(range(self.workers + self.servers))

    @property
    def aggregates(self) -> bool:
        """Whether the workers of a host sum each key before one of them pushes it (as the runtime)."""
        hosts = self.rank_hosts[:self.workers]
        return self.host_aggregation and len(set(hosts)) < len(hosts)

    def busiest_link_share(self) -> float:
        """Bytes on the busiest host link, each way, when every worker pushes m bytes spread evenly over
        the servers, per byte of m (``layout.link_bytes``): what the calibration's transfers are bound by."""
        return max(link_bytes(self.rank_hosts, self.workers, 1.0, self.aggregates))

    @classmethod
    def from_psmodel(cls, model: PSModel, time_scale: float = 1.0, workers: int | None = None,
                     servers: int | None = None, hosts: Sequence[int] | None = None,
                     host_aggregation: bool = True) -> ClusterSpec:
        """The cluster whose :func:`calibrate_model` gives ``model``'s fit (``a``, ``bandwidth``);
        ``workers``/``servers``: the same links and startup for another job size (default: the model's).

        In the simulator the calibration pattern costs ``T(m) = W*startup + 2*max(W/S, 1)*m/B``
        (W serial startups; push then result, each limited by the busier side), so
        ``startup_s = a / W`` and ``bandwidth_Bps = 2 * bandwidth * max(1, S/W)``. For a table
        measured on a real cluster this is the simulator's best reading of it. ``hosts`` (a host index
        per rank): the model was measured on that layout, where the busiest host link carries
        ``busiest_link_share`` of each worker's bytes rather than ``max(W/S, 1)``; the link rate is
        read accordingly.
        """
        w = model.workers if workers is None else workers
        s = model.servers if servers is None else servers
        flat = cls(workers=w, servers=s, bandwidth_Bps=2.0 * model.bandwidth * max(1.0, s / w),
                   startup_s=model.a / w, time_scale=time_scale)
        if hosts is None:
            return flat
        placed = dataclasses.replace(flat, hosts=tuple(hosts), host_aggregation=host_aggregation)
        if placed.busiest_link_share() == 0:  # one host: no link; the flat reading of the model stands
            return flat
        pushers = len(set(placed.rank_hosts[:w])) if placed.aggregates else w
        return dataclasses.replace(placed, bandwidth_Bps=flat.bandwidth_Bps * placed.busiest_link_share()
                                   / max(w / s, 1.0), startup_s=model.a / pushers)


@dataclass(slots=True)
class Event:
    """One span of the timeline. ``track``: "worker r" or "server s"; ``kind``: see EVENT_KINDS.

    ``nbytes``: bytes moved (push/pull spans). Worker push/pull spans and server push/pull
    spans are the transfer itself (from the first to the last byte); server ``update`` spans
    are the per-message work (``startup_s``).
    """

    track: str
    name: str
    start: float
    end: float
    kind: str
    nbytes: int = 0


@dataclass
class KeyInfo:
    """One key of the layout: its group, bytes and server."""

    group: int
    nbytes: int
    server: int


@dataclass
class SimResult:
    """What :func:`simulate` found. Times in seconds, throughput in samples/s."""

    schedule: str
    iteration_s: float
    throughput: float
    iteration_times: list[float]  # start-to-start of layer 0's forward, every iteration
    timeline: list[Event]
    groups: list[list[int]]  # tensor indices (registration order), in send order
    keys: list[KeyInfo]
    workers: int
    servers: int
    plan: Plan | None = None  # the planner's output (ready-order indices), planned schedules only
    cost_model: Any = None  # the model the plan was made with
    fold: int = 1  # each simulated worker stood for this many (``fold_factor``)

    @property
    def server_push_bytes(self) -> list[int]:
        """Bytes each server receives per iteration (all workers' pushes)."""
        load = [0] * self.servers
        for k in self.keys:
            load[k.server] += k.nbytes * self.workers
        return load

    def events(self, kind: str | None = None, track: str | None = None) -> list[Event]:
        """Timeline events, optionally only one kind and/or one track."""
        return [e for e in self.timeline if (kind is None or e.kind == kind) and (track is None or e.track == track)]

    def to_chrome_trace(self, path: str | os.PathLike[str]) -> None:
        """Write the timeline as Chrome-trace JSON (open in https://ui.perfetto.dev).

        One process (pid) per track ("worker r", then "server s"), as ``imerge_hooks.timeline``
        does; inside it one thread per lane: "compute" (forward, backward, wait), "push",
        "update", "pull", with extra lanes ("push 1", ...) for spans that overlap in time.
        ``cat`` is the event kind, ``ts``/``dur`` in microseconds, ``args.bytes`` for transfers.
        """
        tracks = [f"worker {r}" for r in range(self.workers)] + [f"server {s}" for s in range(self.servers)]
        pid_of = {t: i for i, t in enumerate(tracks)}
        lane_kind = {"forward": "compute", "backward": "compute", "wait": "compute",
                     "push": "push", "update": "update", "pull": "pull"}
        lane_order = ["compute", "push", "update", "pull"]
        trace: list[dict[str, Any]] = []
        for track, pid in pid_of.items():
            trace += track_metadata(pid, track, pid)
        by_lane: dict[tuple[str, str], list[Event]] = {}
        for e in self.timeline:
            by_lane.setdefault((e.track, lane_kind.get(e.kind, e.kind)), []).append(e)
        for track in tracks:
            tid = 0
            for kind in lane_order + sorted({k for t, k in by_lane if t == track} - set(lane_order)):
                events = sorted(by_lane.get((track, kind), []), key=lambda e: (e.start, e.end))
                ends: list[float] = []  # greedy interval colouring: spans in one lane never overlap
                lanes: list[int] = []
                for e in events:
                    lane = next((i for i, end in enumerate(ends) if end <= e.start + _EPS_T), None)
                    if lane is None:
                        lane = len(ends)
                        ends.append(e.end)
                    ends[lane] = e.end
                    lanes.append(lane)
                for i in range(len(ends)):
                    trace.append(lane_metadata(pid_of[track], tid + i, kind if i == 0 else f"{kind} {i}"))
                for e, lane in zip(events, lanes):
                    trace.append(span_event(e.name, e.kind, pid_of[track], tid + lane, e.start, e.end,
                                            {"bytes": e.nbytes} if e.nbytes else None))
                tid += len(ends)
        dump_trace(path, trace, {"schedule": self.schedule, "iteration_s": self.iteration_s,
                                 "throughput": self.throughput})


# ---------------------------------------------------------------------------------- engine
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
    remaining: float = 0.0
    rate: float = 0.0
    start: float = 0.0
    stamp: int = -1
    fid: int = -1
    weight: float = 1.0  # share of a bottleneck relative to the other flows (uneven incast sharing)
    coefs: tuple[float, ...] = (1.0, 1.0)  # per link: the bytes it carries per byte of this flow (folding)


@dataclass(slots=True)
class _Worker:
    ptr: int = 0
    ready: ReadyQueue = field(default_factory=ReadyQueue)
    credit: Credit = field(default_factory=lambda: Credit(None))
    missing: set = field(default_factory=set)  # groups the current gate still waits for
    key_meta: dict = field(default_factory=dict)  # owned key -> (priority, urgent) until its host's sum is ready
    wait_start: float = 0.0
    op_start: float = 0.0


_FABRIC = -1  # the shared fabric link's id (host links are >= 0)


def _coef(f: _Msg, link: int) -> float:
    """Bytes ``link`` carries per byte of flow ``f`` (1 on the fabric)."""
    return f.coefs[f.links.index(link)] if link in f.links else 1.0


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
                 fold: int = 1) -> None:
        self.W, self.S, self.B, self.startup = workers, servers, float(bandwidth), float(startup)
        # Folding (fold_factor): each push and result stands for this many at its server (link and work).
        self.fold = float(fold)
        self.host = list(hosts) if hosts is not None else list(range(workers + servers))
        self.H = max(self.host) + 1
        self.local_B, self.reduce_rate = float(local_bandwidth), float(reduce_rate)
        # Host aggregation: each worker's host mates, and who pushes each key for its host.
        self.mates = [[m for m in range(workers) if m != r and self.host[m] == self.host[r]] if aggregate else []
                      for r in range(workers)]
        self.host_workers = [sorted([r] + mates) for r, mates in enumerate(self.mates)]  # owner() looks up keys
        self.got: dict[tuple[int, int], int] = {}  # (owner, key) -> its host's gradients in so far
        self.forwarding: dict[tuple[int, int], int] = {}  # (owner, key) -> results still to hand its host
        self.key_pushers: dict[int, list[int]] = {}  # key -> the ranks whose push a server has summed
        self.worker_message = float(worker_message)
        self.thread_free = [0.0] * workers  # when each worker's comm thread is next free (worker_message > 0)
        self.fabric = None if fabric is None else float(fabric)
        self.share_cv = float(share_cv)
        self.share_period, self.share_seed = float(share_period), int(share_seed)
        self.share_epoch = 0
        self.share_weights: dict[tuple[int, int], float] = {}
        self.share_event_at = math.inf
        self.fwd, self.bwd, self.layer_names = list(fwd), list(bwd), list(layer_names)
        self.layer_tensors = [list(t) for t in layer_tensors]
        self.groups = [list(g) for g in groups]
        self.group_keys = [list(k) for k in group_keys]
        self.key_bytes, self.key_server = list(key_bytes), list(key_server)
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
        self.priority, self.stagger = priority, stagger
        self.push_after_backward, self.iterations = push_after_backward, iterations
        self.record = record
        G, L = len(self.groups), len(self.layer_tensors)
        # Gates: before layer l's forward of iteration it > 0, these groups must have finished round it-1.
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
        self.ops = ops
        W = workers
        self.workers = [_Worker(credit=Credit(credit, tail_credit)) for _ in range(W)]
        # Tail credit (schedule): submitting tail_group starts the tail, the last group is urgent.
        self.tail_group = tail_group if tail_credit is not None else None
        self.urgent_group = G - 1 if self.tail_group is not None else -1
        self.arrived = [[0] * G for _ in range(W)]
        self.pending = [[0] * G for _ in range(W)]
        self.done_round = [[0] * G for _ in range(W)]
        self.starts = [[math.nan] * (iterations + 1) for _ in range(W)]
        self.cpu_free = [0.0] * servers
        self.key_count = [0] * len(key_bytes)
        self.key_expected = [len({self.owner(k, r) for r in range(workers)}) for k in range(len(key_bytes))]
        self.channels: dict[tuple[int, int], deque[_Msg]] = {}
        self.flows: dict[int, _Msg] = {}  # active flows by id (insertion order: deterministic)
        self.net_t = 0.0
        self.net_dirty = False
        self.net_version = 0
        self.stamp = 0
        self.heap: list = []
        self.seq = itertools.count()
        self.fid = itertools.count()
        self.now = 0.0
        self.timeline: list[Event] = []
        # Branch and bound (simulate's give_up_s): once every worker started iteration 1, past abort_at the
        # steady iteration time is known to exceed give_up_s; the run stops there (gave_up).
        self.give_up_s: float | None = None
        self.first_started = 0
        self.abort_at = math.inf
        self.gave_up = False
        self.cpu_deadline: float | None = None  # this thread's CPU time (time.thread_time) to stop at
        self.wtrack = [f"worker {r}" for r in range(W)]
        self.strack = [f"server {s}" for s in range(servers)]

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
        slots = key_slots([self.key_server[k] for k in keys], r, self.S, self.stagger)
        prio = self.group_prio[g] if self.priority else 0
        w = self.workers[r]
        if g == self.tail_group:
            w.credit.begin_tail(len(self.group_keys[self.urgent_group]))
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
                w.ready.add(k, self.key_bytes[k], prio, urgent)
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
        w.ready.add(k, self.key_bytes[k], prio, urgent)
        self._pump(owner)

    def _pump(self, r: int) -> None:
        w = self.workers[r]
        ready, credit = w.ready, w.credit
        while ready and (k := ready.take(credit)) is not None:
            nbytes = self.key_bytes[k]
            credit.started(nbytes)
            s = self.key_server[k]
            m = _Msg(True, r, s, k, nbytes, self.links(r, self.W + s), "", (r, self.W + s),
                     coefs=(1.0, self.fold))
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
        self.key_count[k] += 1
        self.key_pushers.setdefault(k, []).append(r)
        if self.key_count[k] < self.key_expected[k]:
            return
        self.key_count[k] = 0
        nbytes = self.key_bytes[k]
        for worker in self.key_pushers.pop(k):
            self._send(_Msg(False, worker, s, k, nbytes, self.links(self.W + s, worker), "", (self.W + s, worker),
                            coefs=(self.fold, 1.0)))

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
            credit = self.workers[m.worker].credit
            credit.delivered(m.nbytes)
            if self.key_group[m.key] == self.urgent_group:
                credit.urgent_delivered()
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
        if dt > 0:
            for f in self.flows.values():
                f.remaining -= f.rate * dt
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
        m.remaining = float(m.nbytes)
        m.rate = 0.0
        m.start = self.now
        m.fid = next(self.fid)
        self.flows[m.fid] = m
        self.net_dirty = True

    def _net_event(self) -> None:
        self._net_advance()
        done = [f for f in self.flows.values() if f.remaining <= f.rate * 1e-10 + f.nbytes * 1e-12]
        if not done:  # rounding: the flow this event was scheduled for is due now
            done = [min(self.flows.values(), key=lambda f: f.remaining / f.rate)]
        self.net_dirty = True
        for f in done:
            del self.flows[f.fid]
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
        pushes = [f for f in self.flows.values() if f.push]
        for f in pushes:
            f.weight = self._share_weight(f.worker, f.server)
        self.net_dirty = True
        self.share_event_at = math.inf
        if pushes:
            self._schedule_share_event()

    def _reschedule_net(self) -> None:
        self._net_advance()
        self._max_min()
        self.net_dirty = False
        self.net_version += 1
        if self.flows:
            dt = min(f.remaining / f.rate for f in self.flows.values())
            self._push_event(self.now + max(dt, 0.0), _EV_NET, self.net_version)

    def _max_min(self) -> None:
        """Weighted max-min fair rates by progressive filling (every link has capacity B; the
        optional fabric link, crossed by every flow, has capacity ``fabric``).

        Each round finds the smallest share per unit of weight (remaining capacity / unfrozen
        flows' weight) over the links and freezes every flow of every link at that level
        (rate = weight x level); symmetric workers make many links tie, so a handful of rounds
        suffice. With all weights 1 this is plain max-min fairness.
        """
        flows = self.flows
        if not flows:
            return
        self.stamp += 1
        stamp = self.stamp
        members: dict[int, list[_Msg]] = {}
        weight: dict[int, float] = {}
        for f in flows.values():
            for link, coef in zip(f.links, f.coefs):
                lst = members.get(link)
                if lst is None:
                    members[link] = [f]
                    weight[link] = f.weight * coef
                else:
                    lst.append(f)
                    weight[link] += f.weight * coef
        local = 2 * self.H
        cap = {link: self.local_B if link >= local else self.B for link in members}
        if self.fabric is not None:
            members[_FABRIC] = list(flows.values())
            cap[_FABRIC] = self.fabric
            weight[_FABRIC] = sum(f.weight for f in flows.values())
        count = {link: len(lst) for link, lst in members.items()}
        live = list(members)
        while live:
            level = min(cap[link] / weight[link] for link in live)
            limit = level * (1.0 + 1e-12)
            for link in [link for link in live if cap[link] / weight[link] <= limit]:
                if count[link] == 0:
                    continue
                for f in members[link]:
                    if f.stamp == stamp:
                        continue
                    f.stamp = stamp
                    f.rate = rate = level * f.weight
                    for other, coef in zip(f.links, f.coefs):
                        left = cap[other] - rate * coef
                        cap[other] = left if left > 0.0 else 0.0
                        count[other] -= 1
                        weight[other] -= f.weight * coef
                    if self.fabric is not None:
                        left = cap[_FABRIC] - rate
                        cap[_FABRIC] = left if left > 0.0 else 0.0
                        count[_FABRIC] -= 1
                        weight[_FABRIC] -= f.weight
            live = [link for link in live if count[link] > 0]
            for link in live:  # rounding must not leave a live link with no weight
                if weight[link] <= 0.0:
                    weight[link] = sum(f.weight * _coef(f, link) for f in members[link] if f.stamp != stamp)
        for f in flows.values():  # a flow squeezed to zero by rounding must still progress
            if f.rate <= 0.0:
                f.rate = self.B * 1e-9


def connection_weight(cv: float, seed: int, epoch: int, worker: int, server: int) -> float:
    """The share weight of push connection (worker, server) in share period ``epoch``: log-normal
    with mean 1 and coefficient of variation ``cv``, the same for the same arguments."""
    if cv <= 0.0:
        return 1.0
    sigma2 = math.log1p(cv * cv)
    rng = random.Random(((seed * 1_000_003 + epoch) * 65_537 + worker) * 4099 + server)
    return math.exp(math.sqrt(sigma2) * rng.gauss(0.0, 1.0) - 0.5 * sigma2)


# ---------------------------------------------------------------------------------- layout
def _cut(nbytes: int, partition_bytes: int | None, servers: int = 1) -> list[int]:
    """Key sizes as ``layout.cut_keys`` makes them (bytes; 4-byte elements assumed)."""
    if nbytes <= 0:
        return []
    ranges = cut_keys(max(1, nbytes // 4), 4, partition_bytes, servers)
    sizes = [(end - start) * 4 for start, end in ranges]
    sizes[-1] += nbytes - sum(sizes)
    return sizes


def _layout(groups: Sequence[Sequence[int]], sizes: Sequence[int], partition_bytes: int | None,
            cluster: ClusterSpec, cpu_deadline: float | None = None) -> tuple[list[list[int]], list[KeyInfo]]:
    """Keys of every group (``layout.cut_keys``, at least one per server and, with host aggregation, one
    per worker of the fullest host), placed by ``layout.Placement`` on the cluster's hosts, as the engine.
    ``cpu_deadline``: as :func:`simulate`'s (placing thousands of keys on hundreds of servers takes seconds)."""
    hosts = cluster.rank_hosts
    per_host = Counter(hosts[:cluster.workers])
    spread = max(cluster.servers, max(per_host.values()) if cluster.aggregates else 1)
    pushers = {h: 1 if cluster.aggregates else n for h, n in per_host.items()}
    placement = Placement(cluster.servers, list(hosts[cluster.workers:]), pushers)
    group_keys: list[list[int]] = []
    keys: list[KeyInfo] = []
    for g, members in enumerate(groups):
        ids = []
        for nbytes in _cut(sum(sizes[i] for i in members), partition_bytes, spread):
            if cpu_deadline is not None and not len(keys) & 63 and time.thread_time() > cpu_deadline:
                raise SearchBudgetSpent("IMerge simulate: the plan search's CPU budget ran out")
            ids.append(len(keys))
            keys.append(KeyInfo(g, nbytes, placement.place(nbytes)))
        group_keys.append(ids)
    return group_keys, keys


def fold_factor(cluster: ClusterSpec) -> int:
    """How many workers one simulated worker stands for: 1 up to ``FOLD_ABOVE`` workers, else the
    largest ``m`` dividing W that leaves at least ``FOLD_WORKERS`` workers, where every rank has a
    host of its own (hosts=None).

    Workers are alike (one model, one plan, one key layout), so W/m simulated workers can stand for
    W: each simulated push is ``m`` pushes at its server (its bytes weigh ``m``-fold on the server's
    link, and the server works ``m`` startups for it), each result ``m`` results. Servers are all
    simulated. Exact where every worker pushes the same key at the same point (no stagger, or a
    model whose timing stagger does not change); with stagger the ``m`` workers a simulated one stands
    for would start their groups at ``m`` different servers, and the fold has them all push where it
    pushes: no stagger benefit, an upper bound. ``benchmarks/results/RESULTS.md`` ("Simulating
    hundreds of workers") measures the difference against simulating every worker. The cost of an
    iteration then grows with W/m and S, not W x S.
    """
    if cluster.hosts is not None or cluster.workers <= FOLD_ABOVE:
        return 1
    for m in range(cluster.workers // FOLD_WORKERS, 1, -1):
        if cluster.workers % m == 0:
            return m
    return 1


def _make_sim(*, fwd, bwd, layer_names, layer_tensors, groups, keys: list[KeyInfo], group_keys, cluster: ClusterSpec,
              priority: bool, stagger: bool, credit: int | None, push_after_backward: bool, overlap: bool,
              tail_group: int | None = None, tail_credit: int | None = None,
              iterations: int, record: bool, fold: int = 1) -> _Sim:
    """The event loop for ``cluster``, its workers folded by ``fold`` (``fold_factor``): W/fold workers,
    every push and result standing for ``fold`` at its server, the fabric carrying 1/fold of the traffic."""
    fabric = None if cluster.fabric_Bps is None else cluster.fabric_Bps / fold
    return _Sim(fwd=fwd, bwd=bwd, layer_names=layer_names, layer_tensors=layer_tensors, groups=groups,
                group_keys=group_keys, key_bytes=[k.nbytes for k in keys],
                key_server=[k.server for k in keys],
                workers=cluster.workers // fold, servers=cluster.servers, bandwidth=cluster.bandwidth_Bps,
                startup=cluster.startup_s, priority=priority, stagger=stagger, credit=credit,
                push_after_backward=push_after_backward, overlap=overlap, iterations=iterations, record=record,
                fabric=fabric, share_cv=cluster.share_cv, share_period=cluster.share_period_s,
                share_seed=cluster.share_seed, tail_group=tail_group, tail_credit=tail_credit,
                worker_message=cluster.worker_message_s, hosts=None if fold > 1 else cluster.rank_hosts,
                aggregate=cluster.aggregates, local_bandwidth=cluster.local_Bps, reduce_rate=cluster.reduce_Bps,
                fold=fold)


# ---------------------------------------------------------------------------------- public API
def calibrate_model(cluster: ClusterSpec, sizes: Sequence[int] | None = None) -> PSModel:
    """The PSModel ``imerge_hooks.plan.calibrate`` would measure on the simulated cluster.

    Every worker pushes and pulls m bytes at once, cut into one key per server (as the real
    calibration), for m on ``sizes`` (default :data:`CALIBRATION_GRID`); T(m) is the time until
    every worker has every result; the table is fitted with :meth:`PSModel.fit`.
    """
    grid = tuple(int(m) for m in (sizes if sizes is not None else CALIBRATION_GRID))
    if not grid or any(m <= 0 for m in grid) or any(b <= a for a, b in zip(grid, grid[1:])):
        raise ValueError(f"IMerge simulate: calibration sizes must be positive and increasing, got {list(grid)}")
    return _calibrate_cached(cluster, grid)


@functools.lru_cache(maxsize=64)
def _calibrate_cached(cluster: ClusterSpec, grid: tuple[int, ...]) -> PSModel:
    times = []
    for m in grid:
        keys = [KeyInfo(0, (end - start) * 4, server) for start, end, server in calibration_keys(m, cluster.servers)]
        sim = _make_sim(fwd=[0.0], bwd=[0.0], layer_names=["calibration"], layer_tensors=[[0]], groups=[[0]],
                        keys=keys, group_keys=[list(range(len(keys)))], cluster=cluster, priority=False,
                        stagger=False, credit=None, push_after_backward=False, overlap=False, iterations=1,
                        record=False, fold=fold_factor(cluster))
        sim.run()
        times.append(max(s[1] - s[0] for s in sim.starts))
    return PSModel.fit(cluster.workers, cluster.servers, list(grid), times)


def search_by_simulation(model: ModelSpec, cluster: ClusterSpec, schedule: str, order: Sequence[int],
                         sizes: Sequence[int], ready: Sequence[float], cost_model: CostModel, *, partition_bytes: int,
                         credit_bytes: int, tail_credit_bytes: int | None, overlap_forward: bool | None,
                         iterations: int = 3, dtypes: Sequence[str] | None = None, cpu_deadline: float | None = None,
                         on_scored: Any = None) -> tuple[Plan, list]:
    """The plan search (``plan.search``): every candidate plan simulated on ``model`` and ``cluster``
    with ``schedule``'s own traits, the fastest kept; returns it and every candidate's score. The one
    rule the engine (``plan.choice.search_plan``, on its profile) and the simulator's own planned
    schedules (on the real model) share.

    ``sizes``/``ready`` (``dtypes``): the tensors in ready order; ``order[j]`` is the model's tensor at
    ready-order position ``j``. ``cpu_deadline``: as :func:`simulate` (``SearchBudgetSpent``).
    ``on_scored(seconds, groups, partition, stagger)`` sees every finished simulation.
    """
    def score(cand: list[list[int]], partition: int, stagger: bool | None = None,
              bound: float | None = None) -> float:
        if cpu_deadline is not None and time.thread_time() > cpu_deadline:
            raise SearchBudgetSpent("IMerge simulate: the plan search's CPU budget ran out")
        seconds = simulate(model, cluster, schedule, timeline=False, groups=[[order[j] for j in g] for g in cand],
                           partition_bytes=partition, credit_bytes=credit_bytes, tail_credit_bytes=tail_credit_bytes,
                           cost_model=cost_model, overlap_forward=overlap_forward, iterations=iterations,
                           stagger=stagger, give_up_s=bound, cpu_deadline=cpu_deadline).iteration_s
        if on_scored is not None:
            on_scored(seconds, cand, partition, stagger)
        return seconds

    traits = SCHEDULE_TRAITS[schedule]
    return searched_plan(candidate_plans(sizes, ready, cost_model, dtypes), score, sizes, ready, cost_model,
                         partition_bytes, traits.partition, staggered=traits.stagger and cluster.servers > 1)


def _check_groups(groups: Sequence[Sequence[int]], n: int) -> list[list[int]]:
    """An explicit plan as lists of ints, or ValueError if it is not a partition of 0..n-1."""
    out = [[int(i) for i in g] for g in groups]
    flat = sorted(i for g in out for i in g)
    if any(not g for g in out) or flat != list(range(n)):
        raise ValueError(f"IMerge simulate: groups must cover each of the model's {n} tensors exactly once, "
                         f"in non-empty groups; got {len(flat)} entries over {len(out)} groups")
    return out


def _positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value <= 0:
        raise ValueError(f"IMerge simulate: {name} must be a positive int, got {value!r}")
    return value


def simulate(model: ModelSpec, cluster: ClusterSpec, schedule: str, *, partition_bytes: int = PARTITION_BYTES,
             credit_bytes: int = CREDIT_BYTES,
             tail_credit_bytes: int | None = TAIL_CREDIT_BYTES,
             fusion_threshold_bytes: int = FUSION_THRESHOLD_BYTES,
             cost_model: CostModel | None = None, iterations: int = 3, overlap_forward: bool | None = None,
             timeline: bool = True, groups: Sequence[Sequence[int]] | None = None,
             plan_search: bool = True, stagger: bool | None = None, fold_workers: bool = True,
             give_up_s: float | None = None, cpu_deadline: float | None = None) -> SimResult:
    """Simulate ``iterations`` iterations of ``model`` on ``cluster`` under ``schedule``.

    ``schedule`` is one of :data:`imerge_hooks.config.SCHEDULES`; its traits
    (``SCHEDULE_TRAITS``) decide planner, partitions, priority, stagger, credit and overlap.
    ``partition_bytes``/``credit_bytes`` matter for partitioned schedules (priority, imerge),
    ``tail_credit_bytes`` (None: off) for imerge (``schedule``, tail credit),
    ``fusion_threshold_bytes`` for ``threshold``. ``cost_model``: what the planner of
    mgwfbp/adaptive-ps/imerge uses (anything with ``.time(nbytes)``); None: the
    :func:`calibrate_model` of ``cluster``. ``overlap_forward``: as ``Config.overlap_forward``
    (None: as the schedule says). ``timeline=False`` skips recording events (faster for
    sweeps; ``SimResult.timeline`` is then empty). ``groups``: an explicit plan instead of
    the schedule's planner (lists of tensor indices in registration order, in send order,
    every tensor exactly once); the schedule's other traits still apply. ``plan_search``: as
    ``Config.plan_search``, the ``optimal`` planner (adaptive-ps, imerge) simulates its
    candidate plans (:mod:`imerge_hooks.plan.search`) and keeps the fastest, as the engine
    does; False: the DP's plan alone (the search may also choose ``stagger``, as the engine's does).
    ``stagger``: as ``SchedulePolicy.stagger`` (None: as the schedule, or its searched plan, says).
    ``give_up_s``: stop as soon as the steady iteration time is known to exceed this (a plan search's
    bound: a candidate that cannot win need not finish); ``iteration_s`` is then ``inf``.
    ``cpu_deadline``: raise :class:`imerge_hooks.plan.search.SearchBudgetSpent` once the calling
    thread's CPU time (``time.thread_time()``) passes this (a plan search's budget).
    ``fold_workers``: simulate the alike workers of a large cluster through a few that stand for
    them (``fold_factor``; ``SimResult.fold`` says how many each stands for, and the timeline then
    has tracks for those only); False: every worker and server.
    See the module doc for the model.
    """
    if schedule not in SCHEDULE_TRAITS:
        raise ValueError(f"IMerge simulate: unknown schedule {schedule!r}; choose one of {', '.join(SCHEDULES)}")
    if not isinstance(model, ModelSpec):
        raise ValueError(f"IMerge simulate: model must be a ModelSpec, got {type(model).__name__}")
    if not isinstance(cluster, ClusterSpec):
        raise ValueError(f"IMerge simulate: cluster must be a ClusterSpec, got {type(cluster).__name__}")
    model.check()
    for name, value in (("partition_bytes", partition_bytes), ("credit_bytes", credit_bytes),
                        ("fusion_threshold_bytes", fusion_threshold_bytes), ("iterations", iterations)):
        _positive_int(name, value)
    if cost_model is not None and not callable(getattr(cost_model, "time", None)):
        raise ValueError("IMerge simulate: cost_model needs a time(nbytes) method")
    traits = SCHEDULE_TRAITS[schedule]
    scale = cluster.time_scale
    fwd = [layer.forward_s * scale for layer in model.layers]
    bwd = [layer.backward_s * scale for layer in model.layers]
    sizes = [int(b) for b in model.tensor_bytes]
    layer_tensors: list[list[int]] = []
    ready_at: list[float] = []  # from the start of backward: layer l is ready after layers L-1..l
    suffix = list(itertools.accumulate(reversed(bwd)))[::-1]
    start = 0
    for index, layer in enumerate(model.layers):
        n = len(layer.param_bytes)
        layer_tensors.append(list(range(start, start + n)))
        ready_at += [suffix[index]] * n
        start += n
    order = list(reversed(range(len(sizes))))  # ready order (ties inside a layer: later-registered first)
    plan_result: Plan | None = None
    used_model: Any = None
    if groups is not None:
        groups = _check_groups(groups, len(sizes))
    elif traits.planner == "none" or not sizes:
        groups = [[i] for i in order]
    else:
        if traits.planner == "threshold":
            used_model = cost_model if cost_model is not None else LinearModel(0.0, 0.0)
        else:
            used_model = cost_model if cost_model is not None else calibrate_model(cluster)
        judged_on = planner_model(traits.planner, used_model)
        if traits.planner == "optimal" and plan_search and len(sizes) > 1:
            plan_result = search_by_simulation(model, cluster, schedule, order, [sizes[i] for i in order],
                                               [ready_at[i] for i in order], judged_on,
                                               partition_bytes=partition_bytes, credit_bytes=credit_bytes,
                                               tail_credit_bytes=tail_credit_bytes,
                                               overlap_forward=overlap_forward, iterations=iterations)[0]
        else:
            plan_result = plan([sizes[i] for i in order], [ready_at[i] for i in order], judged_on,
                               traits.planner, fusion_threshold_bytes=fusion_threshold_bytes)
        groups = [[order[j] for j in g] for g in plan_result.groups]
        if plan_result.partition_bytes is not None:
            partition_bytes = plan_result.partition_bytes
        if stagger is None and plan_result.stagger is not None:
            stagger = plan_result.stagger
    group_keys, keys = _layout(groups, sizes, partition_bytes if traits.partition else None, cluster, cpu_deadline)
    fold = fold_factor(cluster) if fold_workers else 1
    tail = None
    if tail_credit_bytes is not None and traits.tail_credit:
        tail_model = cost_model if cost_model is not None else used_model
        if tail_model is None:
            tail_model = calibrate_model(cluster)
        tail = tail_group(groups, ready_at, tail_model, credit_bytes)
    sim = _make_sim(fwd=fwd, bwd=bwd, layer_names=[layer.name for layer in model.layers],
                    layer_tensors=layer_tensors, groups=groups, keys=keys, group_keys=group_keys, cluster=cluster,
                    priority=traits.priority, stagger=traits.stagger if stagger is None else bool(stagger),
                    credit=credit_bytes if traits.partition else None,
                    tail_group=tail, tail_credit=tail_credit_bytes,
                    push_after_backward=traits.push_after_backward,
                    overlap=traits.overlap_forward if overlap_forward is None else bool(overlap_forward),
                    iterations=iterations, record=timeline, fold=fold)
    if give_up_s is not None and iterations > 1:
        sim.give_up_s = float(give_up_s)
    sim.cpu_deadline = cpu_deadline
    if cpu_deadline is not None and time.thread_time() > cpu_deadline:  # the key layout above took it
        raise SearchBudgetSpent("IMerge simulate: the plan search's CPU budget ran out")
    sim.run()
    if sim.gave_up:
        return SimResult(schedule=schedule, iteration_s=math.inf, throughput=0.0, iteration_times=[], timeline=[],
                         groups=groups, keys=keys, workers=cluster.workers, servers=cluster.servers, plan=plan_result,
                         cost_model=used_model, fold=fold)
    starts = [max(s[it] for s in sim.starts) for it in range(iterations + 1)]
    per_iteration = [b - a for a, b in zip(starts, starts[1:])]
    steady = per_iteration[1:] if len(per_iteration) > 1 else per_iteration
    iteration_s = sum(steady) / len(steady)
    throughput = cluster.workers * model.batch_size / iteration_s if iteration_s > 0 else math.inf
    events = sorted(sim.timeline, key=lambda e: (e.start, e.end))
    return SimResult(schedule=schedule, iteration_s=iteration_s, throughput=throughput,
                     iteration_times=per_iteration, timeline=events, groups=groups, keys=keys,
                     workers=cluster.workers, servers=cluster.servers, plan=plan_result, cost_model=used_model,
                     fold=fold)
