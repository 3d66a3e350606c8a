"""Huge-page arenas for gradient buffers and the polling mode choice."""

import mmap
from pathlib import Path

import pytest
import torch

from imerge_hooks import memory, polling


def test_arena_carves_aligned_zeroed_buffers_of_mixed_dtypes():
    sizes = [(3, torch.float64), (1 << 19, torch.float32), (5, torch.bfloat16), (0, torch.float16)]
    arena = memory.Arena(sizes)
    for (numel, dtype), t in zip(sizes, arena.tensors):
        assert t.dtype == dtype and t.numel() == numel and t.is_contiguous()
        assert t.data_ptr() % memory.ALIGN == 0
        assert not t.any()
    # Buffers do not overlap: writing one leaves the others zero.
    arena.tensors[1].fill_(1.0)
    assert not arena.tensors[0].any() and not arena.tensors[2].any()
    assert arena.tensors[1].sum().item() == 1 << 19


def test_large_host_buffer_is_huge_page_aligned_and_outlives_its_views():
    t = memory.host_buffer(1 << 20, torch.float32)  # 4 MiB
    if hasattr(mmap, "MADV_HUGEPAGE"):
        assert t.data_ptr() % memory.HUGE_PAGE == 0
    view = t[10:20]
    del t
    view.fill_(2.0)
    assert view.sum().item() == 20.0


def test_small_host_buffer_uses_the_torch_allocator():
    t = memory.host_buffer(16, torch.float32)
    assert t.numel() == 16 and not t.any()


@pytest.mark.parametrize("ranks, expected", [(1, "spin"), (10_000, "yield")])
def test_auto_polling_spins_only_when_every_rank_has_a_core(ranks, expected):
    try:
        assert polling.configure("auto", ranks) == expected
        assert polling.Backoff().spin_s == (polling.SPIN_S_DEDICATED if expected == "spin" else polling.SPIN_S_SHARED)
    finally:
        polling.configure("yield", 1)


def test_polling_mode_can_be_forced():
    try:
        assert polling.configure("spin", 10_000) == "spin"
    finally:
        polling.configure("yield", 1)


def test_bad_polling_mode_is_refused():
    from imerge_hooks.config import Config

    with pytest.raises(ValueError, match="polling"):
        Config(polling="busy")


def test_pending_requests_window_full_poll_and_compaction():
    from mpirun import run_mpi

    run = run_mpi(Path(__file__).parent / "scripts" / "pending_requests.py", 1, timeout=60).check()
    assert run.lines(0, "PENDING-OK") == [""]
