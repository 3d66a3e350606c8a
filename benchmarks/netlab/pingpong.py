"""Tiny mpi4py bandwidth probe used to verify netlab links.

Rank 0 sends ``--mib`` MiB to rank 1 (``--iters`` times, after one warm-up
round), rank 1 answers each round with a 1-byte ack.  Rank 0 prints one JSON
line with the measured one-way bandwidth.  An optional ``--bidir`` mode also
measures rank 1 -> rank 0.

    mpiexec -n 2 python benchmarks/netlab/pingpong.py --mib 8
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time

import numpy as np
from mpi4py import MPI


def _one_way(comm, src: int, dst: int, buf: np.ndarray, ack: np.ndarray, iters: int) -> float:
    """Return seconds per transfer of ``buf`` from ``src`` to ``dst``."""
    rank = comm.Get_rank()
    comm.Barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        if rank == src:
            comm.Send([buf, MPI.BYTE], dest=dst, tag=1)
            comm.Recv([ack, MPI.BYTE], source=dst, tag=2)
        elif rank == dst:
            comm.Recv([buf, MPI.BYTE], source=src, tag=1)
            comm.Send([ack, MPI.BYTE], dest=src, tag=2)
    dt = time.perf_counter() - t0
    return dt / iters


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=float, default=8.0, help="message size in MiB (default 8)")
    ap.add_argument("--iters", type=int, default=3, help="timed repetitions (default 3)")
    ap.add_argument("--warmup", type=int, default=1, help="untimed repetitions (default 1)")
    ap.add_argument("--bidir", action="store_true", help="also time rank1 -> rank0")
    args = ap.parse_args(argv)

    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    if size < 2:
        print("pingpong needs at least 2 ranks", file=sys.stderr)
        return 2
    nbytes = int(args.mib * 1024 * 1024)
    buf = np.zeros(nbytes, dtype=np.uint8)
    if rank == 0:
        buf[:] = 7
    ack = np.zeros(1, dtype=np.uint8)

    if args.warmup:
        _one_way(comm, 0, 1, buf, ack, args.warmup)
    t01 = _one_way(comm, 0, 1, buf, ack, args.iters)
    t10 = _one_way(comm, 1, 0, buf, ack, args.iters) if args.bidir else None

    where = comm.gather(
        {
            "rank": rank,
            "host": socket.gethostname(),
            "netns": os.environ.get("NETLAB_NETNS", ""),
            "pid": os.getpid(),
        },
        root=0,
    )
    if rank == 0:
        out = {
            "bytes": nbytes,
            "iters": args.iters,
            "sec_0to1": t01,
            "MBps_0to1": nbytes / t01 / 1e6,
            "Mbitps_0to1": nbytes * 8 / t01 / 1e6,
            "ranks": where,
            "mpi": MPI.Get_library_version().splitlines()[0],
        }
        if t10 is not None:
            out["sec_1to0"] = t10
            out["MBps_1to0"] = nbytes / t10 / 1e6
            out["Mbitps_1to0"] = nbytes * 8 / t10 / 1e6
        print("PINGPONG " + json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
