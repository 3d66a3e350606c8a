"""Huge-page arenas for gradient buffers and the polling mode choice."""

import mmap
import re
from pathlib import Path

import pytest
import torch

from imerge_hooks.core import memory, polling


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
    from imerge_hooks.core.config import Config

    with pytest.raises(ValueError, match="polling"):
        Config(polling="busy")


def test_pending_requests_window_full_poll_and_compaction():
    from mpirun import run_mpi

    run = run_mpi(Path(__file__).parent / "scripts" / "pending_requests.py", 1, timeout=60).check()
    assert run.lines(0, "PENDING-OK") == [""]


def test_ranks_that_mpi_treats_as_remote_still_count_as_sharing_the_machine():
    """MPIR_CVAR_NOLOCAL (as in the emulated cluster, one network namespace per rank) makes
    MPI's shared-memory split see one rank per node; the ranks still share these cores, so
    with more ranks than cores auto polling must not pick ``spin``."""
    from mpirun import run_mpi

    ranks = 3
    expected = "yield" if ranks > polling.usable_cores() else "spin"
    run = run_mpi(Path(__file__).parent / "scripts" / "ranks_on_node.py", ranks, timeout=60,
                  env={"MPIR_CVAR_NOLOCAL": "1"}).check()
    seen = sorted(re.findall(r"@(\d+) RANKS (\d+) (\w+)", run.stdout))  # ranks' lines may interleave
    assert seen == [(str(r), str(ranks), expected) for r in range(ranks)], run.stdout


def test_ranks_are_grouped_by_their_host_override_while_polling_counts_the_machine():
    """Two emulated hosts of two workers each plus a server host, on one machine: local ranks count the
    workers of each host (``IMERGE_HOST``), polling still counts every rank on these cores."""
    from mpirun import run_mpi

    hosts = ["gpu0", "gpu0", "gpu1", "gpu1", "cpu0"]
    run = run_mpi(Path(__file__).parent / "scripts" / "ranks_on_node.py", len(hosts), timeout=60,
                  env={"MPIR_CVAR_NOLOCAL": "1", "IMERGE_TEST_HOSTS": ",".join(hosts)}).check()
    expected_mode = "yield" if len(hosts) > polling.usable_cores() else "spin"
    local = {0: (0, 2, 0), 1: (1, 2, 0), 2: (0, 2, 1), 3: (1, 2, 1), 4: (0, 1, 0)}
    for r, host in enumerate(hosts):
        assert run.lines(r, "RANKS") == [f"{len(hosts)} {expected_mode}"], run.stdout
        name, lr, ls, node, worker_hosts = run.lines(r, "HOST")[0].split()
        assert (name, (int(lr), int(ls), int(node)), worker_hosts) == (host, local[r], "gpu0,gpu1"), run.stdout


def test_backoff_sleeps_grow_with_the_wait_but_stay_bounded():
    naps: list[float] = []
    short = polling.Backoff(spin_s=0.0, sleep=naps.append)
    for _ in range(12):
        short.idle(waited_s=0.0)
    assert naps and max(naps) == pytest.approx(polling.MAX_SLEEP_S)  # a fresh wait: MAX_SLEEP_S at most

    naps.clear()
    long = polling.Backoff(spin_s=0.0, sleep=naps.append)
    for _ in range(12):
        long.idle(waited_s=10.0)  # the oldest transfer has taken 10 s: 5% of it is over the cap
    assert max(naps) == pytest.approx(polling.MAX_SLEEP_LONG_S)
    assert naps == sorted(naps), "sleeps back off monotonically"

    naps.clear()
    mid = polling.Backoff(spin_s=0.0, sleep=naps.append)
    for _ in range(12):
        mid.idle(waited_s=0.02)  # 20 ms: sleeps up to 1 ms (5%)
    assert max(naps) == pytest.approx(0.001)
    long.reset()
    naps.clear()
    long.idle(waited_s=10.0)
    assert naps == [], "the first poll after progress does not sleep"
