"""MPI requests in flight, polled together: one ``MPI_Testsome`` per poll over the oldest, all of them now and then."""

from __future__ import annotations

import time

from ._mpi import MPI

FULL_POLL_S = 0.002  # PendingRequests tests every request at least this often (the oldest on every poll)


class PendingRequests:
    """Requests in flight, each with an owner, tested by ONE ``MPI_Testsome`` per poll.

    Testing N requests one by one makes N passes through MPICH's progress engine (a lock and an
    ``epoll_wait`` each); with hundreds of partitions in flight that cost the workers more CPU
    than moving the bytes. Even one Testsome over N requests costs O(N) in mpi4py, so a quick
    poll tests only the ``window`` oldest requests (the ones due first: a TCP connection
    delivers in order and servers answer keys roughly in push order) and a full poll, at least
    every ``FULL_POLL_S``, tests them all. MPI progress is global, so the
    bytes of every request keep moving either way; the window only delays noticing a request
    that finished out of order, by at most the full-poll period.

    Completed requests become ``REQUEST_NULL`` in place and are compacted away once they are
    the majority.
    """

    def __init__(self, window: int | None = None) -> None:
        self.window = window
        self._requests: list = []
        self._owners: list = []
        self._head = 0  # entries before it are completed
        self._retired = 0
        self._last_full_poll = 0.0

    def add(self, request, owner) -> None:
        self._requests.append(request)
        self._owners.append(owner)

    def __len__(self) -> int:
        return len(self._requests) - self._retired

    def completed(self, full: bool | None = None) -> list:
        """Owners of the requests found complete by this poll (one progress call).

        ``full``: test every request (True) or only the window (False); by default a poll is
        full when the last full one is ``FULL_POLL_S`` old."""
        if full is None:
            now = time.monotonic()
            full = now - self._last_full_poll > FULL_POLL_S
            if full:
                self._last_full_poll = now
        requests = self._requests
        while self._head < len(requests) and not requests[self._head]:
            self._head += 1
        if self._head == len(requests):
            self._requests, self._owners, self._head, self._retired = [], [], 0, 0
            return []
        if full or self.window is None:
            start, tested = 0, requests
        else:
            start, tested = self._head, requests[self._head:self._head + self.window]
        indices = MPI.Request.Testsome(tested)
        if not indices:
            return []
        owners = [self._owners[start + i] for i in indices]
        for i in indices:  # a completed request no longer keeps its owner (and its buffers) alive
            self._owners[start + i] = None
        self._retired += len(indices)
        if self._retired * 2 > len(requests) >= 32:
            live = [(r, o) for r, o in zip(requests, self._owners) if r]
            self._requests, self._owners = [r for r, _ in live], [o for _, o in live]
            self._head = self._retired = 0
        return owners
