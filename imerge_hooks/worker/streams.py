"""The CUDA path's ordering: one copy stream per device, and the events that order it.

A group's gradients are ready when events recorded on the streams that produced them (the current
stream in each gradient's hook: autograd runs a backward op on its forward op's stream) complete.
The comm thread only queries those events: a key whose data is not ready waits in its queue while
the thread goes on with other keys, results and polling (``comm``). Copies to and from host memory
run on a dedicated copy stream that waits on those events only, so a push never waits for kernels
queued after the gradients (the next forward's), and the results' upload does not queue behind them
either. Whoever consumes a result (the parameter update, DDP's future) makes its own stream wait on
the copy stream's event, and the next round's writes into a buffer that callbacks read on the copy
stream wait for an event recorded after them (``Group.copies_out_queued``). Nothing on this path
synchronizes the device or a stream; the one host wait is ``DeviceStreams.read_scalar``, on the
event of its own one-element copy.

Every function here is called only for CUDA tensors; the CPU path never imports CUDA state.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterable, Iterator

import torch

_streams: dict[int, torch.cuda.Stream] = {}
_readers: dict[int, torch.cuda.Stream] = {}
_devices: dict[int, DeviceStreams] = {}
_lock = threading.Lock()


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def copy_stream(device: torch.device) -> torch.cuda.Stream:
    """The copy stream of ``device`` (created once, high priority: a result that the next forward
    waits for should not queue behind that forward's kernels)."""
    index = _index(device)
    with _lock:
        stream = _streams.get(index)
        if stream is None:
            stream = _streams[index] = torch.cuda.Stream(device=index, priority=-1)
        return stream


class DeviceStreams:
    """The ordering of one CUDA device's groups (module doc). ``Group`` and the comm thread reach the
    device only through these methods and only ever *query* an event from the comm thread, so a test
    can stand a fake with the same methods in for it (``tests/test_device_readiness.py``).

    Readiness is recorded on every stream that produced a group's gradients (``record_ready``), not
    only on the submitting thread's current one: custom streams, some AMP and activation
    checkpointing paths run a gradient's last kernel elsewhere."""

    def __init__(self, device: torch.device) -> None:
        self.device = torch.device("cuda", _index(device))

    def current_stream(self) -> torch.cuda.Stream:
        """The calling thread's current stream on this device (autograd sets it to a backward op's
        stream while the op's hooks run)."""
        return torch.cuda.current_stream(self.device)

    def record_ready(self, producers: Iterable[torch.cuda.Stream] = ()) -> list[torch.cuda.Event]:
        """Events complete once everything queued so far is, on the current stream and on each of
        ``producers`` (the streams that wrote the group's gradients)."""
        current = self.current_stream()
        events = []
        for stream in (current, *(p for p in producers if p != current)):
            event = torch.cuda.Event()
            event.record(stream)
            events.append(event)
        return events

    @staticmethod
    def done(events: Iterable[torch.cuda.Event]) -> bool:
        """Whether every event has completed; never waits."""
        return all(event.query() for event in events)

    def copy_after(self, dst: torch.Tensor, src: torch.Tensor,
                   after: Iterable[torch.cuda.Event] = ()) -> torch.cuda.Event:
        """Queue ``dst.copy_(src)`` on the copy stream, behind ``after`` (and what that stream already
        holds); return an event that completes with the copy. Host memory on either side must be
        pinned for the copy to be asynchronous (the engine allocates it so)."""
        stream = copy_stream(self.device)
        with torch.cuda.device(self.device), torch.cuda.stream(stream):
            for event in after:
                stream.wait_event(event)
            dst.copy_(src, non_blocking=True)
            done = torch.cuda.Event()
            done.record(stream)
        return done

    def record_copies_done(self) -> torch.cuda.Event:
        """An event on the copy stream: complete once every copy queued there so far is."""
        event = torch.cuda.Event()
        event.record(copy_stream(self.device))
        return event

    def wait_on_current(self, event: torch.cuda.Event) -> None:
        """Make the current stream (the caller's compute) wait for ``event``; the host does not wait."""
        self.current_stream().wait_event(event)

    def read_scalar(self, tensor: torch.Tensor, index: int) -> float:
        """``float(tensor[index])`` of a device tensor whose value is in place (MPI wrote it, its request
        complete): copied on a stream of its own into pinned memory and read once that copy's own event
        completes, so the caller waits for that one element, not for the copy or compute stream."""
        stream = _read_stream(self.device)
        with torch.cuda.device(self.device), torch.cuda.stream(stream):
            host = torch.empty(1, dtype=tensor.dtype, pin_memory=True)
            host.copy_(tensor[index:index + 1], non_blocking=True)
            done = torch.cuda.Event()
            done.record(stream)
        done.synchronize()
        return float(host[0])

    @contextlib.contextmanager
    def on_copy_stream(self) -> Iterator[torch.cuda.Stream]:
        """Make the copy stream current (e.g. to complete a ``torch.futures.Future`` whose consumers
        must wait for the copies queued there: it records its events on current streams)."""
        with on_copy_stream(self.device) as stream:
            yield stream


def for_device(device: torch.device) -> DeviceStreams:
    """The ``DeviceStreams`` of a CUDA device (one per device)."""
    index = _index(device)
    with _lock:
        ops = _devices.get(index)
        if ops is None:
            ops = _devices[index] = DeviceStreams(device)
        return ops


def _read_stream(device: torch.device) -> torch.cuda.Stream:
    """A stream for reading single values (``DeviceStreams.read_scalar``): nothing else is queued on it."""
    index = _index(device)
    with _lock:
        stream = _readers.get(index)
        if stream is None:
            stream = _readers[index] = torch.cuda.Stream(device=index)
        return stream


def keep_for_copies(tensor: torch.Tensor) -> None:
    """Tell the caching allocator that ``tensor`` is used on its device's copy stream, so its memory
    is not handed out again until the copies queued there when it is freed have run."""
    tensor.record_stream(copy_stream(tensor.device))


@contextlib.contextmanager
def on_copy_stream(device: torch.device) -> Iterator[torch.cuda.Stream]:
    """Make ``device``'s copy stream current."""
    stream = copy_stream(device)
    with torch.cuda.device(device), torch.cuda.stream(stream):
        yield stream


def timing_event(device: torch.device) -> torch.cuda.Event:
    """A timing event on the current stream of ``device`` (profiling: when the GPU gets there, not
    when the host queued it)."""
    event = torch.cuda.Event(enable_timing=True)
    event.record(torch.cuda.current_stream(device))
    return event


def seconds_between(start: torch.cuda.Event, end: torch.cuda.Event) -> float:
    """GPU time from ``start`` to ``end`` in seconds; waits for ``end`` (profiling iterations only)."""
    end.synchronize()
    return start.elapsed_time(end) / 1000.0
