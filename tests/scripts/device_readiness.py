"""The comm thread never waits on the device (run in the shared 2 worker + 1 server job, after
``comm_release``).

Group A's gradients sit behind a ready event that has not completed (a stand-in device,
``fake_device.py``: a GPU still running the backward); group B, submitted after it, is host memory.
B's keys must go out and its results come back while A waits, and none of A's bytes may be read for
sending before its event completes; then A completes with the right average. With host aggregation
(both workers on one host) A's keys take the paths of the key's owner (its own gradient is read when
the other's is in) and of the worker that contributes.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch
from common import say

sys.path.insert(0, str(Path(__file__).parent))
from fake_device import FakeDevice  # noqa: E402

from imerge_hooks.cluster import session
from imerge_hooks.core.wire import KeySpec  # noqa: E402
from imerge_hooks.worker import key_table
from imerge_hooks.worker.group import Group  # noqa: E402
from imerge_hooks.worker.schedule import SchedulePolicy  # noqa: E402


def _group(index: int, client: int, numel: int, value: float, device: FakeDevice | None, servers: int) -> Group:
    ids = key_table.allocate_keys(2)
    keys = [KeySpec(k, numel * 4, "float32", i % servers, (f"g{index}t{i}",)) for i, k in enumerate(ids)]
    staged = device is not None and session.topology().aggregate_in_host  # the engine stages where hosts sum
    return Group(index=index, flat=torch.full((2 * numel,), value), result=torch.empty(2 * numel), keys=keys,
                 key_ranges=[(0, numel), (numel, 2 * numel)], priority=index, names=(f"g{index}t0", f"g{index}t1"),
                 staging=torch.empty(2 * numel) if staged else None, device=device)


def run_all(out: str | None = None) -> None:
    """``out``: unused (the shared job's calling convention)."""
    topo = session.topology()
    comm = session.comm_thread()
    client = session.new_client_id()
    numel = 1 << 12
    device = FakeDevice(hold=True)
    a = _group(0, client, numel, float(topo.worker_rank + 1), device, topo.num_servers)
    b = _group(1, client, numel, float(10 * (topo.worker_rank + 1)), None, topo.num_servers)
    key_table.register_keys(client, a.keys + b.keys)
    early = []  # A's send buffers read before its gradients were ready
    send_buffer = a.send_buffer

    def watched(slot: int) -> list:
        if not device.done(a.ready_events):
            early.append(slot)
        return send_buffer(slot)

    a.send_buffer = watched
    policy = SchedulePolicy()
    a.mark_ready()
    comm.submit(a, policy)
    comm.submit(b, policy)
    comm.wait(b, "while group A's device event is pending ")
    time.sleep(0.2)  # the thread keeps polling A meanwhile
    b_ok = bool(torch.all(b.result == 10 * sum(range(1, topo.num_workers + 1)) / topo.num_workers))
    a_waited = not a.done.is_set()
    for event in a.ready_events:
        device.finish(event)
    comm.wait(a, "after its device event completed ")
    a_ok = bool(torch.all(a.flat == sum(range(1, topo.num_workers + 1)) / topo.num_workers))
    say(topo.worker_rank, "DEVICE", f"b_done_first={b_ok} a_waited={a_waited} a_ok={a_ok} early={early} "
        f"aggregated={topo.aggregate_in_host}")
    key_table.register_keys(client, [])
