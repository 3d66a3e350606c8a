"""How many bytes per second can the emulated cluster move when every link runs both ways?

Ranks 0..W-1 are workers, the last S ranks servers (as in IMerge). Every worker streams
``--mib`` MiB to every server in ``--chunk-mib`` messages while every server streams the same
back to every worker, all at once, for ``--rounds`` rounds: the traffic of a PS iteration
with no compute. Waits poll with IMerge's own back-off (``polling.Backoff``, yield mode), so
the ranks use the CPU the way IMerge's ranks do.

``aggregate_Bps`` counts what arrives while every pair is still streaming (from the moment every
rank has received a chunk to the moment the first pair has received all its chunks): the rate of the
fabric with every link busy; ``drain_Bps`` is the whole transfer's bytes over its time, which adds
the tail where the pairs that TCP served less finish alone.

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
from imerge_hooks.internals import Backoff  # noqa: E402


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
    timings, windows = [], []
    for _ in range(args.rounds + 1):  # the first round warms TCP up and is not timed
        comm.Barrier()
        t0 = time.perf_counter()
        reqs, owners = [], []
        for _c in range(chunks):
            for p in peers:
                reqs.append(comm.Irecv([inbox[p], MPI.BYTE], source=p, tag=5))
                reqs.append(comm.Isend([out, MPI.BYTE], dest=p, tag=5))
                owners += [p, None]
        arrived: list[tuple[float, int]] = []  # (time, peer) of every received chunk
        pending = len(reqs)
        backoff = Backoff()
        while pending:
            done = MPI.Request.Testsome(reqs) or []  # one progress pass per poll, as wire.PendingRequests
            if not done:
                backoff.idle()
                continue
            backoff.reset()
            now = time.perf_counter()
            pending -= len(done)
            arrived += [(now, owners[i]) for i in done if owners[i] is not None]
        comm.Barrier()
        timings.append(time.perf_counter() - t0)
        windows.append(_busy_window(comm, t0, arrived, peers, chunk))
    seconds = min(timings[1:])
    total = 2 * W * S * chunks * chunk  # both directions, every pair
    busy = max(windows[1:], key=lambda w: w["Bps"])
    if rank == 0:
        print(json.dumps({"workers": W, "servers": S, "bytes": total, "seconds": seconds,
                          "aggregate_Bps": busy["Bps"], "drain_Bps": total / seconds,
                          "busy_window_s": busy["seconds"], "rounds": timings}), flush=True)
    return 0


def _busy_window(comm: MPI.Comm, t0: float, arrived: list[tuple[float, int]], peers: list[int],
                 chunk: int) -> dict:
    """Bytes per second all ranks received while every pair was still streaming: from the first
    chunk anywhere to the moment the first pair finished (after that some links go idle, and TCP's
    uneven sharing of a port makes that tail long). Clocks are comparable: all ranks share one host."""
    last_of_pair = [max(t for t, p in arrived if p == peer) for peer in peers]
    every = comm.allgather((min((t for t, _ in arrived), default=t0), min(last_of_pair), arrived))
    start = max(e[0] for e in every)  # every rank has received something
    end = min(e[1] for e in every)  # no pair has finished yet
    moved = sum(chunk for e in every for t, _ in e[2] if start < t <= end)
    seconds = max(end - start, 1e-9)
    return {"Bps": moved / seconds, "seconds": seconds}


if __name__ == "__main__":
    raise SystemExit(main())
