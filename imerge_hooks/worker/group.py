"""A group in flight: the flat gradient buffer, its result and staging buffers and its keys.

Shared between the main thread (which fills and takes it) and the comm thread (which pushes
its keys and completes it); ``done`` is the hand-over. On CUDA the group reaches its device only
through ``device`` (``streams.DeviceStreams``, or a stand-in with the same methods), and the comm
thread only asks ``slot_ready``, which never waits.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

import torch

from ..core.wire import KeySpec, as_mpi_buffer
from . import streams


@dataclass
class Group:
    """One planned group: a flat buffer that travels as one or more keys.

    ``flat`` holds the gradients (parameters' ``.grad`` are views into it); ``result``
    receives the averaged keys from the servers; ``key_ranges`` are element ranges of ``flat``.
    With ``swap`` (host memory, no wire conversion) nothing is copied back: the owner swaps
    ``flat`` and ``result`` once the group is complete (``take_result``), so a round trip
    costs no extra pass over the gradients.
    """

    index: int
    flat: torch.Tensor
    result: torch.Tensor
    keys: list[KeySpec]
    key_ranges: list[tuple[int, int]]
    priority: int
    names: tuple[str, ...]
    staging: torch.Tensor | None = None  # host/wire-dtype copy of ``flat`` (GPU tensors, compression)
    done: threading.Event = field(default_factory=threading.Event)
    submitted: bool = False
    # CUDA (see ``streams``): the device's ordering (None: host memory), the streams that wrote this
    # round's gradients so far, the events after them, the events of the keys' copies out of ``flat``,
    # the copy stream's event after the results' uploads, and the one after the callbacks' copies out of ``flat``.
    device: Any = None
    producers: set = field(default_factory=set)
    ready_events: list = field(default_factory=list)
    staged: list = field(default_factory=list)
    uploaded: object | None = None
    consumed: object | None = None
    members: list[int] = field(default_factory=list)  # parameter indices (engine) or bucket index (DDP)
    callbacks: list = field(default_factory=list)  # one-shot fn(error_or_None), run by the comm thread
    swap: bool = False  # result becomes flat on completion (see take_result) instead of a copy
    result_pending: bool = False  # swap groups: submitted, result not taken yet
    # Tail credit (schedule): submitting a group with tail_keys > 0 starts the tail, which lasts
    # until that many keys of the urgent group (the plan's last, the next forward's first) are delivered.
    tail_keys: int = 0
    urgent: bool = False
    round: int = 0  # the step this submission belongs to (its keys' tags carry it, see wire.key_tag)
    rescaled: int = -1  # the last round rescaled to the workers that trained (join_divisor="active")
    # Elements [presence_at, presence_at + len(members)) of ``flat``: one flag per member, 1 when this
    # worker has a gradient for it; averaged with the gradients, so nonzero iff any worker had one.
    presence_at: int = 0
    # The element after the flags: 1 when the pushing worker trains, 0 when it shadows a round while it
    # waits in join() (``engine.shadow_round``); averaged, it counts the workers that trained.

    _buffers: dict = field(default_factory=dict, repr=False)
    _gathers: dict = field(default_factory=dict, repr=False)  # slot -> receive scratch (host aggregation)
    _ready_seen: bool = field(default=False, repr=False)  # this round's ready events have all completed

    def __post_init__(self) -> None:
        if self.device is None and self.flat.device.type == "cuda":
            self.device = streams.for_device(self.flat.device)

    def mpi_buffer(self, tensor: torch.Tensor, start: int, end: int) -> list:
        """``as_mpi_buffer(tensor[start:end])``, cached: building one costs ~10 us per message."""
        key = (tensor.data_ptr(), start, end)
        buf = self._buffers.get(key)
        if buf is None:
            if len(self._buffers) > 8 * max(1, len(self.keys)):
                self._buffers.clear()  # buffers were replaced (DDP rebuilt its buckets)
            buf = self._buffers[key] = as_mpi_buffer(tensor[start:end])
        return buf

    def release_buffers(self) -> None:
        """Drop the cached MPI views (they keep the group's buffers alive) and the gather scratch."""
        self._buffers.clear()
        self._gathers.clear()

    def gather_buffer(self, slot: int, parts: int) -> torch.Tensor:
        """Host aggregation, the key's owner: room for ``parts`` other workers' bytes of key ``slot``
        (wire dtype, host memory), kept across rounds."""
        buf = self._gathers.get(slot)
        if buf is None:
            start, end = self.key_ranges[slot]
            buf = self._gathers[slot] = torch.empty(parts * (end - start), dtype=self.result.dtype)
        return buf

    def add_contributions(self, slot: int, parts: int) -> list:
        """The key's owner: add the ``parts`` gathered contributions of key ``slot`` to this
        worker's own and return the MPI buffer of the host's sum, to push.

        In place where the gradient buffer is what travels (host memory, no wire conversion: it becomes
        the next result buffer anyway); else summed at full precision before the wire conversion.
        """
        start, end = self.key_ranges[slot]
        rows = self._gathers[slot].view(parts, end - start)
        if self.staging is None:
            target = self.flat[start:end]
            for row in rows:
                target.add_(row)
            return self.mpi_buffer(self.flat, start, end)
        wide = torch.float64 if self.flat.dtype == torch.float64 else torch.float32
        if self.on_device:  # slot_ready: its bytes are staged in host memory (wire dtype, as the others')
            total = self.staging[start:end].to(dtype=wide)
        else:
            total = self.flat[start:end].to(dtype=wide)
        total.add_(rows.to(wide).sum(0))
        self.staging[start:end].copy_(total)
        return self.mpi_buffer(self.staging, start, end)

    # ------------------------------------------------------------------ one round's data
    # Main thread: ``note_producer`` per gradient and ``mark_ready`` before submitting, ``before_write``
    # before writing ``flat`` itself, ``use_results`` after ``done``. Comm thread: ``slot_ready`` (never
    # waits) until a key may start, then ``send_buffer``/``recv_buffer``; ``unpack`` when its result is
    # in, ``results_queued`` before ``done``; a completion callback that reads ``flat``, ``copies_out_queued``. On
    # CUDA these order the copy stream (see ``streams``).
    @property
    def on_device(self) -> bool:
        return self.device is not None

    def note_producer(self) -> None:
        """A gradient of this group was just written (its hook runs): remember the stream it ran on."""
        if self.device is not None:
            self.producers.add(self.device.current_stream())

    def mark_ready(self) -> None:
        """Before a submission: on CUDA, record that this round's gradients and flags are what their
        streams have queued so far (the current one and every producer's); the keys wait for exactly that."""
        if self.device is not None:
            self.ready_events = self.device.record_ready(self.producers)
            self.producers = set()
            self._ready_seen = False
            self.staged = [None] * len(self.keys)

    def slot_ready(self, slot: int) -> bool:
        """Comm thread: whether key ``slot`` may start now (never waits). On CUDA: this round's gradients
        are written, the last round's uploads out of ``result`` have run (MPI writes it again), and,
        where the key travels from ``staging``, its copy there (queued here, once) has run."""
        device = self.device
        if device is None:
            return True
        if not self._ready_seen:
            if not device.done(self.ready_events):
                return False
            self._ready_seen = True
        if self.uploaded is not None and not device.done((self.uploaded,)):
            return False
        return self.staging is None or device.done((self._stage(slot),))

    def send_buffer(self, slot: int) -> list:
        """MPI buffer of the bytes to push for key ``slot``: wire dtype, in host memory unless MPI
        reads device memory. On CUDA only once ``slot_ready``: staged into ``staging`` by then where
        the gradient buffer cannot travel itself."""
        start, end = self.key_ranges[slot]
        if self.on_device:
            return self.mpi_buffer(self.flat if self.staging is None else self.staging, start, end)
        if self.staging is None:
            return self.mpi_buffer(self.flat, start, end)
        self.staging[start:end].copy_(self.flat[start:end])
        return self.mpi_buffer(self.staging, start, end)

    def _stage(self, slot: int) -> object:
        """CUDA: queue key ``slot``'s copy out of ``flat`` on the copy stream behind the ready events
        (once per round); the event of that copy. Key by key, never the whole group: with host
        aggregation the owner writes its keys' host sums into ``staging`` itself."""
        if self.staged[slot] is None:
            start, end = self.key_ranges[slot]
            self.staged[slot] = self.device.copy_after(self.staging[start:end], self.flat[start:end],
                                                       self.ready_events)
        return self.staged[slot]

    def recv_buffer(self, slot: int) -> list:
        """MPI buffer receiving key ``slot``'s result (on CUDA only once ``slot_ready``: the last
        round's upload out of it has run)."""
        start, end = self.key_ranges[slot]
        return self.mpi_buffer(self.result, start, end)

    def unpack(self, slot: int) -> None:
        """Copy key ``slot``'s averaged result into the gradient buffer (widening or uploading as needed)."""
        if self.swap:
            return
        start, end = self.key_ranges[slot]
        if self.on_device:
            self.device.copy_after(self.flat[start:end], self.result[start:end])
        else:
            self.flat[start:end].copy_(self.result[start:end])

    def results_queued(self) -> None:
        """Every key's result is in: on CUDA, the event after their uploads, for consumers to wait on."""
        if self.on_device:
            self.uploaded = self.device.record_copies_done()

    def copies_out_queued(self) -> None:
        """A completion callback queued its copies out of ``flat`` on the copy stream (the DDP hook's into
        its buckets), before it lets their consumers go: on CUDA, the event after them, for ``before_write``."""
        if self.on_device:
            self.consumed = self.device.record_copies_done()

    def before_write(self) -> None:
        """Before the caller's stream writes ``flat`` for the next round (the DDP hook's bucket copies):
        it waits for the last round's readers on the copy stream (``copies_out_queued``); the host does not."""
        if self.consumed is not None:
            self.device.wait_on_current(self.consumed)
            self.consumed = None

    def use_results(self) -> None:
        """After ``done``: make the caller's current stream wait for the uploads (CUDA); the host does not wait."""
        if self.on_device and self.uploaded is not None:
            self.device.wait_on_current(self.uploaded)

    def flag(self, index: int) -> float:
        """Element ``index`` of the averaged round (a presence or training flag) as a number, read
        from host memory where the result is there (no wait on the device)."""
        if not self.on_device:
            return float(self.flat[index])
        if self.result.device.type == "cpu":
            return float(self.result[index])
        return self.device.read_scalar(self.result, index)

    def take_result(self) -> bool:
        """Swap groups: make the completed result the gradient buffer. True if it swapped."""
        if not (self.swap and self.result_pending and self.done.is_set()):
            return False
        self.flat, self.result = self.result, self.flat
        self.result_pending = False
        return True

    @property
    def active_at(self) -> int:
        return self.presence_at + len(self.members)

    def trained(self, num_workers: int) -> int:
        """After a round: how many workers trained in it (the others shadowed it from join())."""
        return round(self.flag(self.active_at) * num_workers)

    @property
    def nbytes(self) -> int:
        return self.flat.numel() * self.flat.element_size()

    def describe(self) -> str:
        shown = ", ".join(self.names[:3]) + (", ..." if len(self.names) > 3 else "")
        return f"group {self.index} ({len(self.names)} tensors, {self.nbytes} bytes: {shown})"
