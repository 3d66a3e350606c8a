"""IMerge on one GPU beside DDP and single-process training: ResNet-50, batch 32 per worker.

    python benchmarks/gpu.py [--out benchmarks/results/gpu.json] [--iters 30]

Cells, each launched on its own (``mpiexec`` for the multi-rank ones) under a timeout:

* ``single``: one process on the GPU, the bound of every cell (two workers sharing one GPU cannot
  compute faster than it; the ratio to it is each cell's efficiency).
* ``imerge`` and ``imerge-wfbp``: 2 workers sharing the GPU (``share_gpus``) + 1 server on the host.
* ``ddp-nccl``: torch DDP, 2 ranks with NCCL on the same GPU (NCCL may refuse two ranks on one
  device; the refusal is recorded), and ``ddp-gloo``, the same over gloo.

Prints a table and writes the JSON (``make gpu-check`` runs it after ``tests/gpu``). Run inside a
cell: ``python benchmarks/gpu.py --cell NAME`` (what the orchestrator launches).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.machine import machine_info, mpiexec_path  # noqa: E402

CELLS = {  # name -> (ranks, servers)
    "single": (1, 0),
    "imerge": (3, 1),
    "imerge-wfbp": (3, 1),
    "ddp-nccl": (2, 0),
    "ddp-gloo": (2, 0),
}


# ---------------------------------------------------------------------- inside a cell
def run_cell(name: str, batch: int, warmup: int, iters: int, on: str = "cuda") -> None:
    import torch
    import torchvision
    from torch import nn

    report: dict = {"cell": name}
    workers, rank, opt = 1, 0, None
    if name.startswith("imerge"):
        import imerge_hooks as imh

        imh.init()
        workers, rank = imh.size(), imh.rank()
        device = torch.device("cuda", torch.cuda.current_device()) if on == "cuda" else torch.device("cpu")
    elif name.startswith("ddp-"):
        import torch.distributed as dist
        from mpi4py import MPI

        world = MPI.COMM_WORLD
        workers, rank = world.Get_size(), world.Get_rank()
        port = world.bcast(_free_port() if rank == 0 else None, root=0)
        device = torch.device(on, 0) if on == "cuda" else torch.device("cpu")  # every rank on the one GPU
        if on == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group(name.split("-", 1)[1], init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=workers)
    else:
        device = torch.device("cuda", 0) if on == "cuda" else torch.device("cpu")
    torch.manual_seed(0)
    model = torchvision.models.resnet50().to(device)
    base = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    if name.startswith("imerge"):
        schedule = "wfbp" if name == "imerge-wfbp" else "imerge"
        opt = imh.DistributedOptimizer(base, named_parameters=model.named_parameters(), schedule=schedule,
                                       profile_steps=max(1, warmup // 2))
        imh.broadcast_parameters(model.state_dict(), root_rank=0)
        report["cuda_aware_mpi"] = imh.cluster.devices.mpi_reads_device()
        net = model
    elif name.startswith("ddp-"):
        net = nn.parallel.DistributedDataParallel(model)
        opt = base
    else:
        net, opt = model, base
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(batch, 3, 224, 224, generator=g).to(device)
    y = torch.randint(0, 1000, (batch,), generator=g).to(device)
    for it in range(warmup + iters):
        if it == warmup:
            if hasattr(opt, "synchronize"):
                opt.synchronize()
            _synchronize(device, reset_peak=True)
            start = time.perf_counter()
        opt.zero_grad()
        nn.functional.cross_entropy(net(x), y).backward()
        opt.step()
    if hasattr(opt, "synchronize"):
        opt.synchronize()
    _synchronize(device)
    elapsed = time.perf_counter() - start
    report.update(workers=workers, batch=batch, iters=iters, seconds=elapsed,
                  samples_per_s=iters * batch * workers / elapsed, ms_per_iter=1000 * elapsed / iters,
                  peak_memory_mib=torch.cuda.max_memory_allocated(device) / 2**20 if on == "cuda" else 0.0,
                  gpu=torch.cuda.get_device_name(device) if on == "cuda" else "cpu")
    if rank == 0:
        print("RESULT " + json.dumps(report), flush=True)
    if name.startswith("ddp-"):
        import torch.distributed as dist

        dist.destroy_process_group()


def _synchronize(device, reset_peak: bool = False) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)
        if reset_peak:
            torch.cuda.reset_peak_memory_stats(device)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------------- orchestrator
def launch(name: str, args: argparse.Namespace) -> dict:
    ranks, servers = CELLS[name]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
           "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "4"),
           "IMERGE_SHARE_GPUS": "1", "IMERGE_NUM_SERVERS": str(servers),
           "IMERGE_COST_MODEL_PATH": str(Path(args.cache) / "gpu-{workers}w-{servers}s-{hosts}.json")}
    cell = [sys.executable, str(Path(__file__).resolve()), "--cell", name, "--batch", str(args.batch),
            "--warmup", str(args.warmup), "--iters", str(args.iters), "--device", args.device]
    cmd = cell if ranks == 1 else [mpiexec_path(), "-n", str(ranks), *cell]
    started = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            cwd=str(REPO), start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=args.timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        return {"cell": name, "error": f"timed out after {args.timeout:.0f} s", "tail": out[-2000:]}
    results = [json.loads(line.split(" ", 1)[1]) for line in out.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not results:
        reason = next((line for line in reversed(out.splitlines()) if "Error" in line or "error" in line),
                      f"exit code {proc.returncode}")
        return {"cell": name, "error": reason.strip()[:400], "tail": out[-2000:]}
    return {**results[0], "wall_s": time.monotonic() - started}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cell", choices=sorted(CELLS), help="run inside one cell (the orchestrator's launches)")
    parser.add_argument("--cells", default=",".join(CELLS))
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--warmup", type=int, default=10, help="iterations not timed (IMerge profiles in half)")
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--timeout", type=float, default=150.0, help="seconds per cell")
    parser.add_argument("--cache", default="/tmp/imerge-gpu-check", help="cost-model cache of the IMerge cells")
    parser.add_argument("--device", default="cuda", help="cpu: try the script without a GPU (no results file)")
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "gpu.json"))
    args = parser.parse_args()
    if args.cell:
        run_cell(args.cell, args.batch, args.warmup, args.iters, args.device)
        return
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("benchmarks/gpu.py: no CUDA device here; run it where a GPU is (make gpu-check)")
    Path(args.cache).mkdir(parents=True, exist_ok=True)
    cells = [launch(name, args) for name in args.cells.split(",")]
    bound = next((c["samples_per_s"] for c in cells if c["cell"] == "single" and "samples_per_s" in c), None)
    print(f"\nResNet-50, batch {args.batch} per worker, {args.iters} timed iterations, one GPU "
          f"({cells[0].get('gpu', '?')}); bound: single-process rate on that GPU")
    print(f"{'cell':<12} {'workers':>7} {'samples/s':>10} {'ms/iter':>8} {'of bound':>9} {'peak MiB':>9}")
    for c in cells:
        if "error" in c:
            print(f"{c['cell']:<12} {'-':>7} {'-':>10} {'-':>8} {'-':>9} {'-':>9}  {c['error'][:90]}")
            continue
        share = f"{c['samples_per_s'] / bound:.2f}" if bound else "-"
        print(f"{c['cell']:<12} {c['workers']:>7} {c['samples_per_s']:>10.1f} {c['ms_per_iter']:>8.1f} {share:>9} "
              f"{c['peak_memory_mib']:>9.0f}")
    result = {"command": "python benchmarks/gpu.py " + " ".join(sys.argv[1:]), "model": "resnet50",
              "batch_per_worker": args.batch, "bound_samples_per_s": bound, "cells": cells,
              "machine": {**machine_info(), "torch": torch.__version__,
                          "gpu": torch.cuda.get_device_name(0) if args.device == "cuda" else None}}
    if args.device == "cuda":
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
