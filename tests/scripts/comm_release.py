"""A finished group is not kept alive by the comm thread once its owner drops it.

The worker pushes one group through the comm thread, checks the result, drops the group and
lets the thread go idle; a weak reference tells whether the group (and so its flat and result
buffers, the size of the model's gradients in a real engine) is still alive.
"""

from __future__ import annotations

import gc
import time
import weakref

import torch
from common import say

import imerge_hooks
from imerge_hooks.cluster import session
from imerge_hooks.core.wire import KeySpec
from imerge_hooks.worker import key_table
from imerge_hooks.worker.group import Group
from imerge_hooks.worker.schedule import SchedulePolicy


def run_all(out: str | None = None) -> None:
    """Push one group under two policies, drop it, and say whether it is still alive (``out``: unused)."""
    topo = session.topology()
    comm = session.comm_thread()
    client = session.new_client_id()
    numel = 1 << 16
    keys = [KeySpec(k, numel * 4, "float32", i % topo.num_servers, (f"t{i}",))
            for i, k in enumerate(key_table.allocate_keys(2))]
    key_table.register_keys(client, keys)
    group = Group(index=0, flat=torch.full((2 * numel,), float(topo.worker_rank + 1)), result=torch.empty(2 * numel),
                  keys=keys, key_ranges=[(0, numel), (numel, 2 * numel)], priority=0, names=("t0", "t1"))
    for policy in (SchedulePolicy(), SchedulePolicy(priority=True, credit_bytes=1 << 16)):
        comm.submit(group, policy)
        comm.wait(group, "in the release test ")
    expected = sum(range(1, topo.num_workers + 1)) / topo.num_workers
    ok = bool(torch.all(group.result == expected))
    alive = weakref.ref(group)
    del group
    time.sleep(1.5)  # the thread goes idle: it waits for the next group
    gc.collect()
    say(topo.worker_rank, "RESULT", ok, "ALIVE", alive() is not None)
    key_table.register_keys(client, [])


if __name__ == "__main__":
    imerge_hooks.init()
    run_all()
