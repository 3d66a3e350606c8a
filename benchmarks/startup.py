"""Start-up at scale: init(), key registration, the plan hand-off and broadcasts, timed per rank.

    python benchmarks/startup.py [--ranks 14] [--servers 2] [--mb 100] [--out startup.json]

Launches ``--ranks`` ranks (the last ``--servers`` of them servers) under ``mpiexec`` and, on every
worker, times: ``init()``; building a ``DistributedOptimizer`` over a small model (its key
registration with every server); ``messages.from_worker0`` of a plan-sized object (the plan
hand-off); ``broadcast_parameters`` of ``--mb`` MB of float32 tensors; ``broadcast_object`` of a
small object; a barrier (one collective's round trip through the tree). Prints a table of the
slowest worker's time per step and writes the JSON. ``--inside`` is what each rank runs.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
STEPS = ("init", "register", "handoff", "broadcast_parameters", "broadcast_object", "barrier")


def inside(mb: float) -> None:
    started = time.perf_counter()
    import torch

    import imerge_hooks as imh
    from imerge_hooks.internals import collectives, messages, session

    imported = time.perf_counter()
    imh.init()
    times = {"import": imported - started, "init": time.perf_counter() - imported}
    rank, workers = imh.rank(), imh.size()

    def timed(step: str, fn) -> None:
        collectives.collective(session.topology().worker_comm, "barrier", None, f"the start of {step}")
        t = time.perf_counter()
        fn()
        times[step] = time.perf_counter() - t

    model = torch.nn.Sequential(*[torch.nn.Linear(32, 32) for _ in range(8)])
    base = torch.optim.SGD(model.parameters(), lr=0.1)  # torch imports its compiler here, seconds: not ours
    opt = None

    def register() -> None:
        nonlocal opt
        opt = imh.DistributedOptimizer(base, named_parameters=model.named_parameters(), schedule="wfbp")

    timed("register", register)
    plan = [[i] for i in range(2000)] if rank == 0 else None
    timed("handoff", lambda: messages.from_worker0(plan, "a plan"))
    count = max(1, int(mb * 2**20 / 4 / 2**20))
    tensors = {f"t{i}": torch.full((2**20,), float(rank)) for i in range(count)}
    timed("broadcast_parameters", lambda: imh.broadcast_parameters(tensors, root_rank=0))
    assert all(float(t[0]) == 0.0 for t in tensors.values())
    timed("broadcast_object", lambda: imh.broadcast_object({"epoch": 3, "names": list(range(100))}))
    timed("barrier", lambda: collectives.collective(session.topology().worker_comm, "barrier", None, "a barrier"))
    rows = collectives.collective(session.topology().worker_comm, "gather", times, "the start-up times")
    if rank == 0:
        print("STARTUP " + json.dumps({"workers": workers, "servers": imh.num_servers(), "mb": count * 4,
                                       "per_worker": rows}), flush=True)
    opt.synchronize()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=int, default=14)
    parser.add_argument("--servers", type=int, default=2)
    parser.add_argument("--mb", type=float, default=100.0)
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument("--out", default=None)
    parser.add_argument("--inside", action="store_true")
    args = parser.parse_args()
    if args.inside:
        inside(args.mb)
        return
    mpiexec = Path(sys.executable).parent / "mpiexec"
    env = {**os.environ, "IMERGE_NUM_SERVERS": str(args.servers), "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    cmd = [str(mpiexec), "-n", str(args.ranks), sys.executable, __file__, "--inside", "--mb", str(args.mb)]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=args.timeout, cwd=str(REPO))
    line = next((x for x in out.stdout.splitlines() if x.startswith("STARTUP ")), None)
    if out.returncode != 0 or line is None:
        sys.exit(f"startup benchmark failed (exit {out.returncode}):\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    result = json.loads(line.split(" ", 1)[1])
    print(f"{result['workers']} workers + {result['servers']} servers, {result['mb']} MB broadcast; "
          "seconds, slowest worker (median worker)")
    for step in ("import",) + STEPS:
        values = sorted(row[step] for row in result["per_worker"])
        print(f"  {step:<22} {values[-1]:8.3f}  ({values[len(values) // 2]:.3f})")
    if args.out:
        result["command"] = "python benchmarks/startup.py " + " ".join(sys.argv[1:])
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
