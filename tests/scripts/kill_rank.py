"""Train, and make one rank (worker or server) fail in the middle: nobody may hang.

Usage: python kill_rank.py VICTIM_WORLD_RANK AT_STEP [HOW]

HOW: ``kill`` (SIGKILL, the default), ``stop`` (SIGSTOP: it stops answering), ``raise`` (an
uncaught exception) or ``exit`` (the worker returns early and exits without ``join()``). A
server victim (kill or stop) is signalled by worker 0 at that step, while it serves. Every rank
first says its process id, so the test can check that none is left.
"""

import os
import signal
import sys
import time

import torch
from common import say

import imerge_hooks as imh
from imerge_hooks.core._mpi import MPI, ensure_initialized

victim, at_step = int(sys.argv[1]), int(sys.argv[2])
how = sys.argv[3] if len(sys.argv) > 3 else "kill"
SIGNALS = {"kill": signal.SIGKILL, "stop": signal.SIGSTOP}
ensure_initialized()
world = MPI.COMM_WORLD
pids = world.allgather(os.getpid())
say(world.Get_rank(), "PID", os.getpid())
server_victim = victim >= world.Get_size() - int(os.environ["IMERGE_NUM_SERVERS"])


def fail(step: int) -> None:
    """Fail as ``how`` says, after telling when (wall clock, so the test can time the rest)."""
    say(victim, "FAILS", how, "AT", f"{time.time():.3f}")
    if how == "raise":
        raise RuntimeError(f"worker {victim} fails at step {step}")
    if how == "exit":
        sys.exit(0)
    os.kill(pids[victim], SIGNALS[how])


imh.init()
model = torch.nn.Linear(64, 64)
opt = imh.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01), named_parameters=model.named_parameters(),
                               schedule="wfbp")
for step in range(100000):
    if step == at_step and imh.rank() == (0 if server_victim else victim):
        fail(step)
    opt.zero_grad()
    model(torch.randn(4, 64)).sum().backward()
    opt.step()
    time.sleep(0.01)
say(imh.rank(), "finished without noticing")
