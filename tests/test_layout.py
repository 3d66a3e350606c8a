"""Keys and placement: equal pieces, spread over servers, least-loaded placement."""

from __future__ import annotations

from imerge_hooks.core.layout import SPREAD_MIN_BYTES, Placement, cut_keys

MiB = 1 << 20


def sizes(ranges, esize=4):
    return [(e - s) * esize for s, e in ranges]


def test_cut_keys_equal_pieces_within_partition():
    numel = 6 * MiB // 4
    assert sizes(cut_keys(numel, 4, 4 * MiB, 1)) == [3 * MiB, 3 * MiB]  # not 4 + 2
    assert sizes(cut_keys(numel, 4, 4 * MiB, 4)) == [1.5 * MiB] * 4  # at least one key per server
    assert sizes(cut_keys(numel, 4, None, 2)) == [3 * MiB, 3 * MiB]
    assert sizes(cut_keys(numel, 4, MiB, 2)) == [MiB] * 6


def test_cut_keys_covers_every_element_once():
    for numel in (1, 7, 1000, 123457):
        for part in (None, 64, 4096):
            for servers in (1, 2, 3):
                ranges = cut_keys(numel, 4, part, servers)
                assert ranges[0][0] == 0 and ranges[-1][1] == numel
                assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
                if part is not None:
                    assert all((e - s) * 4 <= max(part, 4) for s, e in ranges)


def test_small_groups_stay_whole():
    assert cut_keys(SPREAD_MIN_BYTES // 4 - 1, 4, 4 * MiB, 4) == [(0, SPREAD_MIN_BYTES // 4 - 1)]
    assert cut_keys(0, 4, None, 2) == []


def test_placement_balances_bytes_not_key_counts():
    """Alternating big weights and tiny biases must not all land on one server."""
    placement = Placement(2)
    servers = [placement.place(n) for n in [4 * MiB, 1024] * 8]
    big = [s for s, n in zip(servers, [4 * MiB, 1024] * 8) if n > 1024]
    assert sorted(set(big)) == [0, 1]
    assert placement.balance() < 1.01


def test_placement_is_round_robin_for_equal_keys():
    placement = Placement(3)
    assert [placement.place(100) for _ in range(7)] == [0, 1, 2, 0, 1, 2, 0]
    assert Placement(0).place(5) == 0  # no servers: everything on "server 0" (local mode)
