"""A key's next round begins while its last results are still going out; the server must go on.

Worker 0 pushes key K again (round 2) before worker 1 has posted its receive for K's round-1
result, which is large enough to go by rendezvous, so that send cannot finish yet. Worker 1
first needs key J: both workers push J, and worker 1 waits for J's result before it receives K.
A server that waited for K's sends before receiving anything else would never get to J
(stuck until timeout_s); a server that holds K's new push answers J, then finishes K.
"""

from __future__ import annotations

import sys
import time

import torch
from common import say

import imerge_hooks
from imerge_hooks.cluster import session
from imerge_hooks.core.wire import KeySpec, as_mpi_buffer, key_tag
from imerge_hooks.worker import key_table

imerge_hooks.init()
topo = session.topology()
comm = topo.data_comm
me = topo.worker_rank
server = topo.server_world_rank(0)
numel = 1 << 20  # 4 MiB: far above any eager limit
k_key, j_key = key_table.allocate_keys(2)
client = session.new_client_id()
key_table.register_keys(client, [KeySpec(k_key, numel * 4, "float32", 0, ("k",)),
                                 KeySpec(j_key, 1024 * 4, "float32", 0, ("j",))])


def push(key: int, value: float, n: int, round_number: int = 1):
    data = torch.full((n,), value)
    return comm.Isend(as_mpi_buffer(data), dest=server, tag=key_tag(key, round_number)), data


def receive(key: int, n: int, round_number: int = 1):
    out = torch.empty(n)
    return comm.Irecv(as_mpi_buffer(out), source=server, tag=key_tag(key, round_number)), out


def wait(request, what: str, limit_s: float = 20.0) -> None:
    deadline = time.monotonic() + limit_s
    while not request.Test():
        if time.monotonic() > deadline:
            say(me, "STUCK", what)
            sys.exit(3)
        time.sleep(0.001)


keep = []
k_recv_0 = None
if me == 0:
    k_recv_0, k_out_0 = receive(k_key, numel)
send, data = push(k_key, 1.0 + me, numel)  # round 1 of K: average 1.5
keep.append(data)
wait(send, "K round 1 push")
topo.worker_comm.Barrier()
if me == 0:
    wait(k_recv_0, "K round 1 result")
    assert torch.all(k_out_0 == 1.5), k_out_0[:4]
    k_recv_2, k_out_2 = receive(k_key, numel, 2)
    send_k2, data = push(k_key, 10.0, numel, 2)  # round 2 of K, while worker 1 still owes K's round-1 receive
    keep.append(data)
    time.sleep(0.3)  # let the server match it first
topo.worker_comm.Barrier()
j_recv, j_out = receive(j_key, 1024)
send_j, data = push(j_key, 4.0 * (me + 1), 1024)  # average 6
keep.append(data)
wait(j_recv, "J result (the server held up by K's unfinished sends)")
assert torch.all(j_out == 6.0), j_out[:4]
if me == 1:
    k_recv_1, k_out_1 = receive(k_key, numel)  # only now: round 1's result of K
    wait(k_recv_1, "K round 1 result")
    assert torch.all(k_out_1 == 1.5), k_out_1[:4]
    k_recv_2, k_out_2 = receive(k_key, numel, 2)
    send_k2, data = push(k_key, 20.0, numel, 2)
    keep.append(data)
wait(send_j, "J push")
wait(send_k2, "K round 2 push")
wait(k_recv_2, "K round 2 result")
assert torch.all(k_out_2 == 15.0), k_out_2[:4]
say(me, "OK")
key_table.register_keys(client, [])
imerge_hooks.shutdown()
