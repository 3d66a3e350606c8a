"""A stand-in for ``imerge_hooks.worker.streams.DeviceStreams`` on the CPU: events the test completes, streams
it names, copies that run once the events they wait for have completed, and a log of every call, so
the CUDA path's ordering can be checked where no GPU is. An event's ``synchronize()`` fails the test:
nothing on the gradient path may wait on the device."""

from __future__ import annotations

import contextlib
import itertools
import threading
from collections.abc import Iterable, Iterator

import torch

_ids = itertools.count()


class FakeEvent:
    def __init__(self, name: str, complete: bool = False) -> None:
        self.name = f"{name}#{next(_ids)}"
        self.complete = complete

    def query(self) -> bool:
        return self.complete

    def synchronize(self) -> None:
        raise AssertionError(f"waited on the device for {self.name}")

    def __repr__(self) -> str:
        return f"FakeEvent({self.name}, {'done' if self.complete else 'pending'})"


class FakeDevice:
    """``hold``: ready events start pending (the test completes them with ``finish``); else complete."""

    def __init__(self, hold: bool = True) -> None:
        self.hold = hold
        self.stream = "compute"  # the calling thread's current stream, as the test sets it
        self.log: list[tuple] = []
        self.pending: list[tuple[torch.Tensor, torch.Tensor, list[FakeEvent], FakeEvent]] = []
        self.lock = threading.Lock()

    def current_stream(self) -> str:
        return self.stream

    def record_ready(self, producers: Iterable[str] = ()) -> list[FakeEvent]:
        streams = [self.stream] + sorted(p for p in set(producers) if p != self.stream)
        events = [FakeEvent(f"ready@{s}", complete=not self.hold) for s in streams]
        self.log.append(("record_ready", tuple(streams)))
        return events

    @staticmethod
    def done(events: Iterable[FakeEvent]) -> bool:
        return all(e.query() for e in events)

    def copy_after(self, dst: torch.Tensor, src: torch.Tensor, after: Iterable[FakeEvent] = ()) -> FakeEvent:
        after = list(after)
        done = FakeEvent("copy")
        with self.lock:
            self.log.append(("copy_after", tuple(e.name for e in after), done.name))
            self.pending.append((dst, src, after, done))
            self._run()
        return done

    def finish(self, event: FakeEvent) -> None:
        """The device got past ``event``: it completes, and so do the copies that waited only for it."""
        with self.lock:
            event.complete = True
            self._run()

    def _run(self) -> None:
        left = []
        for dst, src, after, done in self.pending:
            if all(e.complete for e in after):
                dst.copy_(src)
                done.complete = True
            else:
                left.append((dst, src, after, done))
        self.pending = left

    def record_copies_done(self) -> FakeEvent:
        with self.lock:
            event = FakeEvent("copies_done", complete=not self.pending)
            self.log.append(("record_copies_done", event.name))
        return event

    def wait_on_current(self, event: FakeEvent) -> None:
        self.log.append(("wait_on_current", self.stream, event.name))

    def read_scalar(self, tensor: torch.Tensor, index: int) -> float:
        self.log.append(("read_scalar", index))
        return 1.0

    @contextlib.contextmanager
    def on_copy_stream(self) -> Iterator[str]:
        previous, self.stream = self.stream, "copy"
        try:
            yield "copy"
        finally:
            self.stream = previous
