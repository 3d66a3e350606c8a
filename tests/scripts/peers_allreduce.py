"""Train the small CNN with the mpi-allreduce peer (benchmarks/peers.py) on each worker's shard;
worker 0 saves the final parameters (argv[1], formatted with ``fusion``) for the test to compare with
full-batch training. argv[2]: fusion buffer sizes in bytes, comma-separated: a fresh model each, in turn."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import common  # noqa: E402

import imerge_hooks as imh  # noqa: E402
from benchmarks.peers import FusedAllreduce  # noqa: E402
from imerge_hooks.cluster import session  # noqa: E402

STEPS = 4


def main() -> None:
    imh.init()  # the server rank serves here and exits: the peer does not use it
    topo = session.topology()
    for fusion in sys.argv[2].split(","):
        model = common.make_model()
        opt = FusedAllreduce(common.make_optimizer("sgd", model.parameters()), list(model.parameters()),
                             topo.worker_comm, fusion_bytes=int(fusion))
        for step in range(STEPS):
            x, y = common.batch(step)
            opt.zero_grad()
            common.loss_fn(model, common.shard(x, topo.worker_rank, topo.num_workers),
                           common.shard(y, topo.worker_rank, topo.num_workers)).backward()
            opt.step()
        opt.close()
        if topo.worker_rank == 0:
            final = {k: v.detach().clone() for k, v in model.state_dict().items()}
            torch.save(final, sys.argv[1].format(fusion=fusion))
    imh.shutdown()


if __name__ == "__main__":
    main()
