"""One rank talking to itself: PendingRequests reports each completed request once, tests only
the oldest ``window`` requests on a quick poll and all of them on a full poll."""

import time

import numpy as np
from common import say
from mpi4py import MPI

from imerge_hooks.core.requests import PendingRequests

comm = MPI.COMM_SELF


def wait_for(pool, full, expect, timeout=10.0):
    got = []
    deadline = time.monotonic() + timeout
    while len(got) < expect and time.monotonic() < deadline:
        got += pool.completed(full)
    return got


bufs = [np.zeros(4) for _ in range(40)]
pool = PendingRequests(window=2)
for tag in range(40):
    pool.add(comm.Irecv(bufs[tag], source=0, tag=tag), f"recv{tag}")
assert len(pool) == 40 and pool.completed(full=True) == []

# Tag 5 arrives first: it is outside the window of the two oldest, so only a full poll sees it.
comm.Send(np.full(4, 5.0), dest=0, tag=5)
time.sleep(0.05)
assert pool.completed(full=False) == [], "a quick poll tested beyond its window"
assert wait_for(pool, True, 1) == ["recv5"]
assert pool.completed(full=True) == [], "a completed request was reported twice"

# The oldest ones are seen by quick polls; the window slides past completed entries.
for tag in (0, 1, 2):
    comm.Send(np.full(4, float(tag)), dest=0, tag=tag)
got = wait_for(pool, False, 3)
assert got == ["recv0", "recv1", "recv2"], got

# The rest, in reverse order: everything is reported once, then the pool is empty.
for tag in reversed(range(3, 40)):
    if tag != 5:
        comm.Send(np.full(4, float(tag)), dest=0, tag=tag)
rest = wait_for(pool, True, 36)
assert sorted(rest) == sorted(f"recv{t}" for t in range(3, 40) if t != 5), rest
assert len(pool) == 0 and pool.completed(full=True) == [] and pool.completed(full=False) == []
assert all(b[0] == t for t, b in enumerate(bufs)), "a receive landed in the wrong buffer"
say(0, "PENDING-OK")
