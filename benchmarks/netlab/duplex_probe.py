"""How many bytes per second can the emulated cluster move when every link runs both ways?

Ranks 0..W-1 are workers, the last S ranks servers (as in IMerge). Every worker streams
``--mib`` MiB to every server in ``--chunk-mib`` messages while every server streams the same
back to every worker, all at once, for ``--rounds`` rounds: the traffic of a PS iteration
with no compute. Waits poll with IMerge's own back-off (``polling.Backoff``, yield mode), so
the ranks use the CPU the way IMerge's ranks do.

The servers' ports bound it (2 x S x link rate x TCP goodput). On netlab it moves 88-97% of
that at every rate from 250 Mbit/s to 2 Gbit/s (``fabric_scaling.py``): the links set it, not
the 2 cores that run every rank's TCP stack. Rank 0 prints one JSON line::

    {"workers": W, "servers": S, "bytes": ..., "seconds": ..., "aggregate_Bps": ...}

``aggregate_Bps`` (the sum over all flows) is what ``imerge_hooks.simulate`` takes as
``ClusterSpec.fabric_Bps`` when it models this emulator.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np
from mpi4py import MPI

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
from imerge_hooks.polling import Backoff  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--servers", type=int, required=True)
    ap.add_argument("--mib", type=float, default=32.0, help="MiB per (worker, server) pair and direction per round")
    ap.add_argument("--chunk-mib", type=float, default=4.0)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args(argv)
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    S = args.servers
    W = size - S
    if W < 1 or S < 1:
        raise SystemExit(f"duplex_probe: need at least one worker and one server, got {size} ranks and S={S}")
    chunk = int(args.chunk_mib * (1 << 20))
    chunks = max(1, int(args.mib * (1 << 20)) // chunk)
    peers = list(range(W, size)) if rank < W else list(range(W))
    out = np.ones(chunk, np.uint8)
    inbox = {p: np.empty(chunk, np.uint8) for p in peers}
    timings = []
    for _ in range(args.rounds + 1):  # the first round warms TCP up and is not timed
        comm.Barrier()
        t0 = time.perf_counter()
        reqs = []
        for _c in range(chunks):
            for p in peers:
                reqs.append(comm.Irecv([inbox[p], MPI.BYTE], source=p, tag=5))
                reqs.append(comm.Isend([out, MPI.BYTE], dest=p, tag=5))
        backoff = Backoff()
        while not MPI.Request.Testall(reqs):
            backoff.idle()
        comm.Barrier()
        timings.append(time.perf_counter() - t0)
    seconds = min(timings[1:])
    total = 2 * W * S * chunks * chunk  # both directions, every pair
    if rank == 0:
        print(json.dumps({"workers": W, "servers": S, "bytes": total, "seconds": seconds,
                          "aggregate_Bps": total / seconds, "rounds": timings}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
