"""Soak run: many iterations of the ResNet-18 replay model under `imerge`; watch resident memory.

    mpiexec -n 6 -env IMERGE_NUM_SERVERS 2 python benchmarks/soak.py --iters 2000

Every rank samples its VmRSS after warm-up and at the end; worker 0 gathers the workers' and
prints growth per rank (servers report their own at shutdown through stderr-free JSON files).
Saves benchmarks/results/soak.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import imerge_hooks as imh  # noqa: E402
from benchmarks.replay import ReplayModel  # noqa: E402
from imerge_hooks.internals import session, stages  # noqa: E402


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="resnet18")
    parser.add_argument("--iters", type=int, default=2000)
    parser.add_argument("--warmup", type=int, default=50)
    parser.add_argument("--time-scale", type=float, default=0.002)
    parser.add_argument("--schedule", default="imerge")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "soak.json"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    imh.init(serve="stage")
    topo = session.topology()
    if topo.is_server:
        stages.serve_stage()  # training stage
        first = rss_mb()
        stages.serve_until_shutdown()
        Path(args.out + f".server{topo.server_index}").write_text(json.dumps({"after_warmup_mb": first,
                                                                             "end_mb": rss_mb()}))
        return
    model = ReplayModel(args.model, time_scale=args.time_scale)
    opt = imh.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1e-6),
                                   named_parameters=model.named_parameters(), schedule=args.schedule, profile_steps=5)
    x = model.example_input()
    samples = []
    start = time.perf_counter()
    for it in range(args.iters):
        opt.zero_grad()
        model(x).sum().backward()
        opt.step()
        if it == args.warmup:
            warm = rss_mb()
            stages.end_stage()  # lets the servers sample their memory after warm-up too
        if it % 100 == 0:
            samples.append((it, rss_mb()))
            if imh.rank() == 0:
                print(f"iter {it}: rss {samples[-1][1]:.1f} MB, {it / (time.perf_counter() - start):.1f} it/s",
                      file=sys.stderr, flush=True)
    opt.synchronize()
    end = rss_mb()
    mine = {"rank": imh.rank(), "after_warmup_mb": warm, "end_mb": end, "growth": end / warm - 1, "samples": samples}
    everyone = topo.worker_comm.gather(mine, root=0)
    elapsed = time.perf_counter() - start
    if imh.rank() == 0:
        result = {"iters": args.iters, "schedule": args.schedule, "model": args.model, "workers": imh.size(),
                  "servers": imh.num_servers(), "elapsed_s": elapsed, "workers_rss": everyone}
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1))
        for w in everyone:
            print(f"worker {w['rank']}: {w['after_warmup_mb']:.1f} MB after warm-up -> {w['end_mb']:.1f} MB at "
                  f"iteration {args.iters} ({w['growth'] * 100:+.2f}%)")
        print(f"{args.iters} iterations in {elapsed:.0f} s, no error")


if __name__ == "__main__":
    main()
