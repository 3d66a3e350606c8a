"""messages.from_worker0: the other workers wait without spinning, large values arrive whole,
and a worker whose value never comes times out naming what it waited for.

Worker 0 computes for ``HOLD_S`` (sleeping, so its core is free), then hands over a value far
above mpi4py's 32 KiB ``irecv`` limit. Each other worker reports the CPU seconds it used while
waiting. Then worker 1 waits for a second value that worker 0 never sends.
"""

from __future__ import annotations

import time

from common import say

import imerge_hooks
from imerge_hooks.cluster import messages, session
from imerge_hooks.core.errors import IMergeTimeoutError

HOLD_S = 2.0
imerge_hooks.init(timeout_s=3.0)
topo = session.topology()
me = topo.worker_rank
value = None
if me == 0:
    time.sleep(HOLD_S)
    value = {"plan": [[i, i + 1] for i in range(0, 100_000, 2)]}
cpu0, wall0 = time.process_time(), time.monotonic()
got = messages.from_worker0(value, "the test plan")
cpu, wall = time.process_time() - cpu0, time.monotonic() - wall0
say(me, "GOT", len(got["plan"]), got["plan"][-1], f"cpu {cpu:.3f}", f"wall {wall:.3f}")
topo.worker_comm.Barrier()
if me == 1:
    try:
        messages.from_worker0(None, "a value nobody sends")
        say(me, "NO TIMEOUT")
    except IMergeTimeoutError as exc:
        say(me, "TIMEOUT", exc)
topo.worker_comm.Barrier()
