"""The workers' torch.distributed rendezvous: init(), worker_group(), one all-reduce over it.

Usage: python rendezvous.py
Each worker says ADDR (address, port, GLOO_SOCKET_IFNAME) and SUM (the all-reduce of its rank + 1);
worker 0 says LISTEN: the local addresses listening on the store's port (from /proc/net/tcp).
"""

import os

import torch
import torch.distributed as dist
from common import say

import imerge_hooks as imh


def listening_on(port: int) -> list[str]:
    out = []
    with open("/proc/net/tcp") as f:
        for line in f.readlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            address, hex_port = local.split(":")
            if state == "0A" and int(hex_port, 16) == port:  # 0A: LISTEN
                out.append(".".join(str(int(address[i:i + 2], 16)) for i in (6, 4, 2, 0)))
    return out


imh.init()
rank = imh.rank()
address, port = imh.cluster.torch_world.master_address_port()
say(rank, "ADDR", address, port, os.environ.get("GLOO_SOCKET_IFNAME", "-"))
if rank == 0:
    say(rank, "LISTEN", *listening_on(port))
group = imh.worker_group()
total = torch.tensor([float(rank + 1)])
dist.all_reduce(total, group=group)
say(rank, "SUM", int(total.item()))
