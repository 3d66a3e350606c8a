"""Keys: how a group's flat buffer is cut into keys, in which dtype they travel, and on which server
each key lives. Pure rules: the engine and the simulator both lay out keys with these."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .wire import SUPPORTED_DTYPES

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
    """Each key goes to the server that keeps the busiest host link least loaded, then the server
    with the fewest bytes so far (ties: round-robin order).

    Why bytes, not a count of keys: models alternate big weights and tiny biases or BatchNorm
    parameters, and counting keys can put every weight on one server and every bias on the other.
    Why links: a server on a worker host (colocated) takes no link bytes for its own host's push and
    result, but carries every other host's, so where servers share hosts with workers, balanced
    server bytes are not balanced link bytes. ``server_hosts`` (per server) and ``pushers`` (host ->
    workers that push each key from it: 1 with host aggregation) describe that; without them every
    server stands on a host of its own. Every worker places the same keys in the same order, so all
    agree.
    """

    def __init__(self, num_servers: int, server_hosts: Sequence[str] | None = None,
                 pushers: dict[str, int] | None = None) -> None:
        self.num_servers = max(1, num_servers)
        self.next = 0
        self.load = [0] * self.num_servers
        self.server_hosts = list(server_hosts) if server_hosts and len(server_hosts) == self.num_servers else None
        self.pushers = dict(pushers or {})
        self.link: dict[str, int] = {}  # host -> bytes on its link (each direction) so far

    def _inbound(self, where: str, nbytes: int) -> int:
        """Bytes a server on host ``where`` takes in for a key of ``nbytes``: every other host's pushers
        send it there (results mirror pushes)."""
        return sum(count for host, count in self.pushers.items() if host != where) * nbytes

    def place(self, nbytes: int) -> int:
        order = [s % self.num_servers for s in range(self.next, self.next + self.num_servers)]
        if self.server_hosts is None or not self.pushers:
            least = min(self.load)
            server = next(s for s in order if self.load[s] == least)
        else:
            server = min(order, key=self._scorer(nbytes))
            where = self.server_hosts[server]
            for host, count in self.pushers.items():
                if host != where:
                    self.link[host] = self.link.get(host, 0) + count * nbytes
            self.link[where] = self.link.get(where, 0) + self._inbound(where, nbytes)
        self.next = (server + 1) % self.num_servers
        self.load[server] += nbytes
        return server

    def _scorer(self, nbytes: int):
        """``server -> (busiest link after, its host's link after, its bytes)`` if the key went there, in
        O(1) per server: each link's bytes after depend on the server only through its host ``where``
        (pusher hosts other than ``where`` add their pushes; ``where`` takes the others' in), so the
        busiest link is the larger of ``where``'s and the two largest of the rest."""
        total = sum(self.pushers.values()) * nbytes
        pushing = sorted(((self.link.get(h, 0) + c * nbytes, h) for h, c in self.pushers.items()), reverse=True)[:2]
        idle = sorted(((v, h) for h, v in self.link.items() if h not in self.pushers), reverse=True)[:2]

        def score(server: int) -> tuple[int, int, int]:
            where = self.server_hosts[server]
            mine = self.link.get(where, 0) + total - self.pushers.get(where, 0) * nbytes
            busiest = mine
            for top in (pushing, idle):
                value = next((v for v, h in top if h != where), None)
                if value is not None and value > busiest:
                    busiest = value
            return busiest, mine, self.load[server]

        return score

    def balance(self) -> float:
        """max/mean bytes per server (1.0 is perfect)."""
        mean = sum(self.load) / len(self.load)
        return max(self.load) / mean if mean else 1.0

    def link_balance(self) -> float:
        """max/mean bytes per host link (1.0 is perfect; 1.0 when links are not modelled)."""
        if not self.link:
            return 1.0
        mean = sum(self.link.values()) / len(self.link)
        return max(self.link.values()) / mean if mean else 1.0


def names_in_range(spans: list[tuple[str, int, int]], start: int, end: int) -> tuple[str, ...]:
    """Names of tensors whose [offset, offset+numel) overlaps [start, end)."""
    return tuple(name for name, off, n in spans if off < end and off + n > start)


CALIBRATION_GRID = tuple(1024 * 4 ** i for i in range(9))  # 1 KiB .. 64 MiB: the measured PS cost table


def calibration_keys(nbytes: int, num_servers: int) -> list[tuple[int, int, int]]:
    """How the cost model's calibration sends ``nbytes`` of float32: one equal key per server,
    as (start, end, server) element ranges. The real calibration and the simulated one use this."""
    numel = max(1, nbytes // 4)
    per = -(-numel // num_servers)
    placement = Placement(num_servers)
    return [(start, min(numel, start + per), placement.place((min(numel, start + per) - start) * 4))
            for start in range(0, numel, per)]


def key_owner(key: int, local_size: int) -> int:
    """With host aggregation: the local rank that gathers ``key`` from its host's workers, pushes the
    host's sum and hands the result back. Round-robin over key ids, which are consecutive within a
    group and cut into equal pieces (``cut_keys``), so every local worker owns an equal share."""
    return key % max(1, local_size)


def link_bytes(rank_hosts: Sequence[int | str], workers: int, nbytes: float, aggregate: bool) -> list[float]:
    """Bytes each host link carries each way (host order of first appearance) when every worker pushes
    ``nbytes`` spread evenly over the servers and gets the result back. ``rank_hosts``: the host of
    every rank, the first ``workers`` of them workers, the rest servers. A host pushes ``nbytes`` per
    pusher (one with ``aggregate``, host aggregation; each worker without) except its own servers'
    share, and its servers take every other host's pushes of their share; results mirror pushes."""
    hosts = list(dict.fromkeys(rank_hosts))
    servers = list(rank_hosts[workers:])
    pushers: dict = {}
    for h in rank_hosts[:workers]:
        pushers[h] = 1 if aggregate else pushers.get(h, 0) + 1
    total = sum(pushers.values())
    count = max(1, len(servers))
    return [nbytes * (pushers.get(h, 0) * (count - servers.count(h)) + servers.count(h) * (total - pushers.get(h, 0)))
            / count for h in hosts]
