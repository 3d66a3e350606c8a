"""``torch_store=False``: worker 0 opens no listening socket and sets no torchrun variable; training through
``DistributedOptimizer`` runs; ``worker_group()`` says how to initialise torch.distributed instead.

Usage: IMERGE_TORCH_STORE=0 python no_store.py   (W workers + 1 server). Each worker prints
``@<rank> LISTENING <ports>`` (MPI's own listen too), ``@<rank> PROBE <port> <ports>`` (the ports again
while it listens on ``port`` itself: the check sees a listener), ``@<rank> ENV <name=value ...>``,
``@<rank> GRAD <value>`` and ``@<rank> GROUP <error>``.
"""

import os
import socket

import torch
from common import say

import imerge_hooks as imh
from imerge_hooks.cluster.torch_world import TORCH_ENV


def listening_ports() -> list[int]:
    """TCP ports this process listens on (its socket inodes in /proc/net/tcp, state LISTEN)."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    ports = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                if fields[3] == "0A" and fields[9] in inodes:
                    ports.append(int(fields[1].rsplit(":", 1)[1], 16))
    return sorted(set(ports))


imh.init()
rank = imh.rank()
model = torch.nn.Linear(4, 2)
opt = imh.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters())
opt.zero_grad()
model(torch.ones(2, 4) * (rank + 1)).sum().backward()
opt.step()
say(rank, "LISTENING", " ".join(map(str, listening_ports())) or "none")
with socket.create_server(("127.0.0.1", 0)) as probe:  # the check sees a listening socket of this process
    say(rank, "PROBE", probe.getsockname()[1], " ".join(map(str, listening_ports())))
say(rank, "ENV", " ".join(f"{name}={os.environ[name]}" for name in TORCH_ENV if name in os.environ) or "none")
say(rank, "GRAD", float(model.weight.grad[0, 0]))
try:
    imh.worker_group()
    say(rank, "GROUP", "no error")
except Exception as exc:  # noqa: BLE001
    say(rank, "GROUP", f"{type(exc).__name__}: {exc}")
