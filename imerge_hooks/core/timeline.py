"""Chrome-trace (Perfetto) timeline of compute and communication: ``IMERGE_TIMELINE=path.json``.

Each worker records forward and backward spans, one span per key from push to result, and
the waits of the optimizer (synchronize, per-module waits under overlap); each server records
one span per key from the first push to the result. At shutdown every rank sends its events
to worker 0, which writes one file with a track per worker and per server. Times come from
``time.monotonic()`` (one clock per host; across hosts the tracks are not aligned).
"""

from __future__ import annotations

import json
import os
import threading
import time
from typing import Any

import torch

_lock = threading.Lock()


class Timeline:
    """Events of one rank: (name, category, start, end, thread)."""

    def __init__(self, track: str, sort_index: int) -> None:
        self.track = track
        self.sort_index = sort_index
        self.events: list[tuple[str, str, float, float, str]] = []
        self._forward: dict[int, float] = {}
        self._handles: list = []

    def span(self, name: str, category: str, start: float, end: float, thread: str = "main") -> None:
        with _lock:
            self.events.append((name, category, start, end, thread))

    # ---------------------------------------------------------------- compute spans (workers)
    def watch_modules(self, owns) -> None:
        """Record the forward of every module for which ``owns(module)`` is true."""
        def pre(module, _args):
            if not torch.compiler.is_compiling() and owns(module):  # no Python time inside a compiled graph
                self._forward[id(module)] = time.monotonic()

        def post(module, _args, _out):
            if torch.compiler.is_compiling():
                return
            start = self._forward.pop(id(module), None)
            if start is not None:
                self.span(f"forward {type(module).__name__}", "forward", start, time.monotonic())

        self._handles = [torch.nn.modules.module.register_module_forward_pre_hook(pre),
                         torch.nn.modules.module.register_module_forward_hook(post)]

    def to_trace(self, pid: int) -> list[dict[str, Any]]:
        out = track_metadata(pid, self.track, self.sort_index)
        threads = sorted({e[4] for e in self.events})
        tids = {t: i for i, t in enumerate(threads)}
        for t, i in tids.items():
            out.append(lane_metadata(pid, i, t))
        for name, cat, start, end, thread in self.events:
            out.append(span_event(name, cat, pid, tids[thread], start, end))
        return out


# ---------------------------------------------------------------- Chrome-trace records (also the simulator's)
def track_metadata(pid: int, name: str, sort_index: int) -> list[dict[str, Any]]:
    """The records that name a track (a Chrome-trace process) and place it."""
    return [{"ph": "M", "name": "process_name", "pid": pid, "args": {"name": name}},
            {"ph": "M", "name": "process_sort_index", "pid": pid, "args": {"sort_index": sort_index}}]


def lane_metadata(pid: int, tid: int, name: str) -> dict[str, Any]:
    """The record that names a lane (a Chrome-trace thread) of a track."""
    return {"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": name}}


def span_event(name: str, category: str, pid: int, tid: int, start: float, end: float,
               args: dict[str, Any] | None = None) -> dict[str, Any]:
    """One span, times in seconds (written in microseconds)."""
    item: dict[str, Any] = {"ph": "X", "name": name, "cat": category, "pid": pid, "tid": tid,
                            "ts": start * 1e6, "dur": max(0.0, end - start) * 1e6}
    if args:
        item["args"] = args
    return item


def dump_trace(path: str | os.PathLike[str], records: list[dict[str, Any]], other: dict[str, Any]) -> None:
    """Write Chrome-trace JSON (open in https://ui.perfetto.dev)."""
    os.makedirs(os.path.dirname(os.path.abspath(os.fspath(path))), exist_ok=True)
    with open(path, "w") as f:
        json.dump({"traceEvents": records, "displayTimeUnit": "ms", "otherData": other}, f)


def write_trace(path: str, timelines: list[dict[str, Any]]) -> None:
    """``timelines``: dicts with keys track, sort_index, events (as produced by ``export``)."""
    trace: list[dict[str, Any]] = []
    origin = min((e[2] for t in timelines for e in t["events"]), default=0.0)
    for pid, t in enumerate(sorted(timelines, key=lambda t: t["sort_index"])):
        tl = Timeline(t["track"], t["sort_index"])
        tl.events = [(n, c, s - origin, e - origin, th) for n, c, s, e, th in t["events"]]
        trace += tl.to_trace(pid)
    # The origin lets other monotonic-clock records of the same host (e.g. the benchmark's link
    # monitor) be aligned with the trace.
    dump_trace(path, trace, {"monotonic_origin_s": origin})


def export(timeline: Timeline) -> dict[str, Any]:
    return {"track": timeline.track, "sort_index": timeline.sort_index, "events": list(timeline.events)}
