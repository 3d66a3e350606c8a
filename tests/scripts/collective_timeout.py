"""collectives.collective: the object collectives with a deadline that every IMerge-internal
collective uses.

The workers run each collective once and print the results; then worker 0 broadcasts an
object that worker 1 never asks for, so worker 0 times out naming worker 1. That timeout is
fatal (worker 0's synchronous send is left pending), so worker 0's exit aborts the job.
"""

from __future__ import annotations

from common import say

import imerge_hooks
from imerge_hooks.cluster import collectives, session
from imerge_hooks.core.errors import IMergeTimeoutError

imerge_hooks.init(timeout_s=3.0)
topo = session.topology()
comm, me = topo.worker_comm, topo.worker_rank
say(me, "ALLGATHER", collectives.collective(comm, "allgather", me * 10, "test values"))
say(me, "BCAST", collectives.collective(comm, "bcast", f"from {me}", "a test value", root=1))
say(me, "GATHER", collectives.collective(comm, "gather", {"rank": me}, "test values"))
say(me, "MAX", collectives.collective(comm, "max", 5 - me, "test values"))
say(me, "BARRIER", collectives.collective(comm, "barrier", None, "a test barrier"))
if me == 0:
    try:
        imerge_hooks.broadcast_object({"big": list(range(10_000))})
        say(me, "NO TIMEOUT")
    except IMergeTimeoutError as exc:
        say(me, "TIMEOUT", exc)
