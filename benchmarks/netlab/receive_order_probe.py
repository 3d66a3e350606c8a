"""Can a server choose whose push arrives first by the order in which it receives?

Ranks 0..N-2 each send ``--mib`` MiB to the last rank at once. The last rank matches every
message (``Improbe``), then receives them either one after another (``--mode serial``) or all
at once (``--mode concurrent``), and prints when each finished. If receiving throttled the
senders, the first serial receive would take mib / link rate and the others would queue behind
it; if the transport buffers unexpected data, every push streams at its share of the link
whatever the receive order (measured with the mpich wheel's ofi/tcp: the latter, so a server
can only order pushes with a protocol in which workers wait for its go-ahead).

    python -m benchmarks.netlab.netlab up --hosts 4
    python -m benchmarks.netlab.netlab run --np 4 -- python benchmarks/netlab/receive_order_probe.py --mode serial

Each repetition prints one line ``RECEIVE_ORDER {json}`` from the receiver.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
from mpi4py import MPI


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=float, default=32.0)
    ap.add_argument("--mode", choices=("serial", "concurrent"), default="serial")
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args(argv)
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    receiver = size - 1
    if receiver < 1:
        raise SystemExit("receive_order_probe: needs at least 2 ranks")
    nbytes = int(args.mib * (1 << 20))
    payload = np.ones(nbytes, np.uint8)
    for _ in range(args.reps):
        comm.Barrier()
        t0 = time.monotonic()
        if rank != receiver:
            comm.Send([payload, MPI.BYTE], dest=receiver, tag=7)
            comm.gather(time.monotonic() - t0, root=receiver)
            continue
        status = MPI.Status()
        matched: dict[int, tuple[MPI.Message, float]] = {}
        while len(matched) < receiver:
            msg = comm.Improbe(MPI.ANY_SOURCE, 7, status)
            if msg is not None:
                matched[status.Get_source()] = (msg, time.monotonic() - t0)
        inbox = {src: np.empty(nbytes, np.uint8) for src in matched}
        done: dict[int, float] = {}
        if args.mode == "serial":
            for src in sorted(matched):
                matched[src][0].Recv([inbox[src], MPI.BYTE])
                done[src] = time.monotonic() - t0
        else:
            pending = {src: matched[src][0].Irecv([inbox[src], MPI.BYTE]) for src in matched}
            while pending:
                for src in [s for s, req in pending.items() if req.Test()]:
                    done[src] = time.monotonic() - t0
                    del pending[src]
        senders = comm.gather(0.0, root=receiver)[:receiver]
        print("RECEIVE_ORDER " + json.dumps({
            "mode": args.mode, "mib": args.mib, "matched_s": {s: round(m[1], 4) for s, m in sorted(matched.items())},
            "received_s": {s: round(t, 4) for s, t in sorted(done.items())},
            "sender_done_s": [round(t, 4) for t in senders]}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
