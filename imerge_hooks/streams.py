"""The CUDA path's ordering: one copy stream per device, and the events that order it.

A group's gradients are ready when an event recorded on the stream that produced them (the
current stream in the gradient hook: autograd runs a backward op on its forward op's stream)
completes. Copies to and from host memory run on a dedicated copy stream that waits on that
event only, so a push never waits for kernels queued after the gradients (the next forward's),
and the results' upload does not queue behind them either. Whoever consumes a result (the
parameter update, DDP's future) makes its own stream wait on the copy stream's event; nothing on
this path synchronizes the device or a compute stream.

Every function here is called only for CUDA tensors; the CPU path never imports CUDA state.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch

_streams: dict[int, torch.cuda.Stream] = {}
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


def record_ready(device: torch.device) -> torch.cuda.Event:
    """An event on the current stream of ``device``: complete once everything queued there so far
    (the group's gradients, its flags) is."""
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return event


def copy_after(dst: torch.Tensor, src: torch.Tensor, device: torch.device,
               after: torch.cuda.Event | None = None) -> torch.cuda.Event:
    """Queue ``dst.copy_(src)`` on ``device``'s copy stream, behind ``after`` (and behind what that
    stream already holds); return an event that completes with the copy. Host memory on either
    side must be pinned for the copy to be asynchronous (the engine allocates it so)."""
    stream = copy_stream(device)
    with torch.cuda.device(device), torch.cuda.stream(stream):
        if after is not None:
            stream.wait_event(after)
        dst.copy_(src, non_blocking=True)
        done = torch.cuda.Event()
        done.record(stream)
    return done


def record_copies_done(device: torch.device) -> torch.cuda.Event:
    """An event on ``device``'s copy stream: complete once every copy queued there so far is."""
    event = torch.cuda.Event()
    event.record(copy_stream(device))
    return event


def wait_on_current(event: torch.cuda.Event, device: torch.device) -> None:
    """Make the current stream of ``device`` (the caller's compute) wait for ``event``; the host does not wait."""
    torch.cuda.current_stream(device).wait_event(event)


def keep_for_copies(tensor: torch.Tensor) -> None:
    """Tell the caching allocator that ``tensor`` is used on its device's copy stream, so its memory
    is not handed out again until the copies queued there when it is freed have run."""
    tensor.record_stream(copy_stream(tensor.device))


def read_scalar(tensor: torch.Tensor, index: int) -> float:
    """``float(tensor[index])`` of a device tensor through the copy stream: waits for that stream
    only (copies queued there, e.g. the result's upload), not for the compute stream."""
    stream = copy_stream(tensor.device)
    with torch.cuda.device(tensor.device), torch.cuda.stream(stream):
        return float(tensor[index].item())


def fetch(src: torch.Tensor, dtype: torch.dtype, after: torch.cuda.Event | None) -> torch.Tensor:
    """``src`` copied to host memory as ``dtype`` on the copy stream, behind ``after``; waits for
    that stream only."""
    stream = copy_stream(src.device)
    with torch.cuda.device(src.device), torch.cuda.stream(stream):
        if after is not None:
            stream.wait_event(after)
        return src.to(device="cpu", dtype=dtype)


@contextlib.contextmanager
def on_copy_stream(device: torch.device) -> Iterator[torch.cuda.Stream]:
    """Make ``device``'s copy stream current (e.g. to complete a ``torch.futures.Future`` whose
    consumers must wait for the copies queued there: it records its events on current streams)."""
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
