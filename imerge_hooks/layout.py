"""Groups and keys: how flat gradient buffers are cut into keys and placed on servers."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import torch

from .transport import SUPPORTED_DTYPES, KeySpec, as_mpi_buffer


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
    cuda_event: object | None = None  # recorded when the gradients are ready (GPU only)
    members: list[int] = field(default_factory=list)  # parameter indices (engine) or bucket index (DDP)
    callbacks: list = field(default_factory=list)  # one-shot fn(error_or_None), run by the comm thread
    swap: bool = False  # result becomes flat on completion (see take_result) instead of a copy
    result_pending: bool = False  # swap groups: submitted, result not taken yet
    # Tail credit (flowcontrol): submitting a group with tail_keys > 0 starts the tail, which lasts
    # until that many keys of the urgent group (the plan's last, the next forward's first) are delivered.
    tail_keys: int = 0
    urgent: bool = False
    round: int = 0  # the step this submission belongs to (its keys' tags carry it, see transport.key_tag)

    _buffers: dict = field(default_factory=dict, repr=False)

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
        """Drop the cached MPI views (they keep the group's buffers alive)."""
        self._buffers.clear()

    def send_buffer(self, start: int, end: int) -> list:
        """MPI buffer of the bytes to push for elements [start, end): host memory, wire dtype.

        GPU and compressed groups are staged into ``staging`` first.
        """
        if self.staging is None:
            return self.mpi_buffer(self.flat, start, end)
        if self.cuda_event is not None and self.flat.device.type == "cuda":
            self.cuda_event.synchronize()
        self.staging[start:end].copy_(self.flat[start:end])
        return self.mpi_buffer(self.staging, start, end)

    def unpack(self, start: int, end: int) -> None:
        """Copy the averaged result into the gradient buffer (widening or uploading as needed)."""
        if not self.swap:
            self.flat[start:end].copy_(self.result[start:end])

    def take_result(self) -> bool:
        """Swap groups: make the completed result the gradient buffer. True if it swapped."""
        if not (self.swap and self.result_pending and self.done.is_set()):
            return False
        self.flat, self.result = self.result, self.flat
        self.result_pending = False
        return True

    @property
    def nbytes(self) -> int:
        return self.flat.numel() * self.flat.element_size()

    def describe(self) -> str:
        shown = ", ".join(self.names[:3]) + (", ..." if len(self.names) > 3 else "")
        return f"group {self.index} ({len(self.names)} tensors, {self.nbytes} bytes: {shown})"


class Compression:
    """Wire formats: ``compression=Compression.fp16`` halves float32 bytes on the wire.

    Servers accumulate 16-bit pushes in float32; results travel back in the wire format.
    This changes numerics (gradients are rounded to 16 bits twice).
    """

    none = "none"
    fp16 = "fp16"
    bf16 = "bf16"


_WIRE = {"fp16": torch.float16, "bf16": torch.bfloat16}


def wire_dtype(dtype: torch.dtype, compression: str) -> torch.dtype:
    """The dtype a gradient of ``dtype`` travels in (16-bit types are never re-compressed)."""
    if compression in _WIRE and dtype in (torch.float32, torch.float64):
        return _WIRE[compression]
    return dtype


def dtype_name(dtype: torch.dtype, tensor_name: str, where: str) -> str:
    try:
        return SUPPORTED_DTYPES[dtype]
    except KeyError:
        raise TypeError(f"IMerge: {where}: tensor {tensor_name!r} has dtype {dtype}; IMerge sums only "
                        f"floating gradients ({', '.join(SUPPORTED_DTYPES.values())})") from None


SPREAD_MIN_BYTES = 64 * 1024


def cut_keys(numel: int, element_size: int, partition_bytes: int | None,
             servers: int = 1) -> list[tuple[int, int]]:
    """Element ranges of equal size (the last may be shorter): at most ``partition_bytes`` each
    (``None``: no limit) and, for groups of at least ``servers * SPREAD_MIN_BYTES``, at least
    one key per server.

    Why spread every group over the servers: the cost model is measured that way, and a group
    that travels as one key keeps one server busy while the others idle. Equal pieces (6 MiB
    with 4 MiB partitions: two keys of 3 MiB, not 4 + 2) keep the servers' loads even.
    """
    if numel == 0:
        return []
    nbytes = numel * element_size
    pieces = max(1, min(servers, nbytes // SPREAD_MIN_BYTES))
    if partition_bytes is not None:
        per_limit = max(1, partition_bytes // element_size)
        pieces = max(pieces, -(-numel // per_limit))
    per = -(-numel // pieces)
    return [(start, min(numel, start + per)) for start in range(0, numel, per)]


class Placement:
    """Each key goes to the server with the fewest bytes so far (ties: round-robin order).

    Why not plain round-robin by count: models alternate big weights and tiny biases or
    BatchNorm parameters, and counting keys can put every weight on one server and every
    bias on the other. Every worker places the same keys in the same order, so all agree.
    """

    def __init__(self, num_servers: int) -> None:
        self.num_servers = max(1, num_servers)
        self.next = 0
        self.load = [0] * self.num_servers

    def place(self, nbytes: int) -> int:
        least = min(self.load)
        server = next(s % self.num_servers for s in range(self.next, self.next + self.num_servers)
                      if self.load[s % self.num_servers] == least)
        self.next = (server + 1) % self.num_servers
        self.load[server] += nbytes
        return server

    def balance(self) -> float:
        """max/mean bytes per server (1.0 is perfect)."""
        mean = sum(self.load) / len(self.load)
        return max(self.load) / mean if mean else 1.0


def names_in_range(spans: list[tuple[str, int, int]], start: int, end: int) -> tuple[str, ...]:
    """Names of tensors whose [offset, offset+numel) overlaps [start, end)."""
    return tuple(name for name, off, n in spans if off < end and off + n > start)
