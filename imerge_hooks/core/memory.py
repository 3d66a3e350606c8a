"""Host buffers for gradient traffic, backed by transparent huge pages where the OS allows.

Intranode MPI copies (CMA single-copy, shared-memory cells) of MiB-sized buffers run faster
from huge pages: fewer page faults and page-table walks per byte (``benchmarks/transport.py``
measures the push-pull round trip against raw MPI). torch's
CPU allocator gives 4 KiB pages unless ``THP_MEM_ALLOC_ENABLE`` was set before torch
started, so IMerge maps its own buffers (private anonymous memory, 2 MiB aligned) and asks
for huge pages with ``madvise``. Workers carve all group buffers out of one such arena, so
small groups share huge pages instead of wasting them.
"""

from __future__ import annotations

import ctypes
import mmap

import torch

HUGE_PAGE = 2 << 20
HUGE_MIN_BYTES = 1 << 20  # smaller standalone buffers stay with torch's allocator
ALIGN = 64  # cache line: every carved buffer starts on one


def host_buffer(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A zeroed 1-D CPU tensor; huge-page backed when at least ``HUGE_MIN_BYTES``.

    The mapping is rounded up to whole huge pages (at most 2x for a 1 MiB buffer).
    """
    nbytes = numel * dtype.itemsize
    if nbytes < HUGE_MIN_BYTES or not hasattr(mmap, "MADV_HUGEPAGE"):
        return torch.zeros(numel, dtype=dtype)
    return _huge_bytes(nbytes)[:nbytes].view(dtype)


class Arena:
    """Carves aligned 1-D tensors of mixed dtypes out of one huge-page backed buffer."""

    def __init__(self, sizes: list[tuple[int, torch.dtype]]) -> None:
        offsets, total = [], 0
        for numel, dtype in sizes:
            offsets.append(total)
            total += -(-numel * dtype.itemsize // ALIGN) * ALIGN
        self._bytes = host_buffer(max(total, 1), torch.uint8)
        self.tensors = [self._bytes[off:off + numel * dtype.itemsize].view(dtype)
                        for off, (numel, dtype) in zip(offsets, sizes)]


def _huge_bytes(nbytes: int) -> torch.Tensor:
    span = -(-nbytes // HUGE_PAGE) * HUGE_PAGE
    region = mmap.mmap(-1, span + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    address = ctypes.addressof(ctypes.c_char.from_buffer(region))
    offset = -address % HUGE_PAGE
    try:
        region.madvise(mmap.MADV_HUGEPAGE, offset, span)
    except OSError:
        pass  # THP unavailable: ordinary pages still work
    # frombuffer keeps ``region`` alive for as long as the tensor (and its views) live.
    return torch.frombuffer(region, dtype=torch.uint8, count=span, offset=offset)
