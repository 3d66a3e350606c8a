"""Train, and SIGKILL one rank (worker or server) in the middle: nobody may hang.

Usage: python kill_rank.py VICTIM_WORLD_RANK KILL_AT_STEP
"""

import os
import signal
import sys
import time

import torch
from common import say

import imerge_hooks as imh

victim, kill_at = int(sys.argv[1]), int(sys.argv[2])
world_rank = int(os.environ.get("PMI_RANK", "-1"))
world_size = int(os.environ.get("PMI_SIZE", "1"))
if world_rank == victim and world_size - int(os.environ["IMERGE_NUM_SERVERS"]) <= victim:
    # The victim is a server: kill it from a timer while it serves.
    import threading

    threading.Timer(3.0, lambda: os.kill(os.getpid(), signal.SIGKILL)).start()
imh.init()
model = torch.nn.Linear(64, 64)
opt = imh.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01), named_parameters=model.named_parameters(),
                               schedule="wfbp")
for step in range(100000):
    if step == kill_at and imh.rank() == victim:
        os.kill(os.getpid(), signal.SIGKILL)
    opt.zero_grad()
    model(torch.randn(4, 64)).sum().backward()
    opt.step()
    time.sleep(0.01)
say(imh.rank(), "finished without noticing")
