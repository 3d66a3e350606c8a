"""What a simulation returns: its events (``Event``), keys (``KeyInfo``) and ``SimResult`` with its Chrome trace."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from ..core.timeline import dump_trace, lane_metadata, span_event, track_metadata
from ..plan.planner import Plan
from .specs import _EPS_T


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
    server_orbits: int | None = None  # servers folded into this many (``server_orbits``: approximate); None: all

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

        One process (pid) per track ("worker r", then "server s"), as ``imerge_hooks.core.timeline``
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
