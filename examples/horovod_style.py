"""A Horovod-style training loop on IMerge (digits data, no download): a Horovod script with
``import horovod.torch as hvd`` replaced by ``import imerge_hooks as hvd``.

    mpiexec -n 3 -env IMERGE_NUM_SERVERS 1 python examples/horovod_style.py --epochs 3
    mpiexec -n 3 -env IMERGE_NUM_SERVERS 1 python examples/horovod_style.py --fp16-allreduce \\
        --batches-per-allreduce 2 --checkpoint ckpt.pt      # run again to resume from ckpt.pt
    python examples/horovod_style.py            # single process, no server

The patterns of Horovod's own examples: metrics averaged with ``hvd.allreduce``, a checkpoint
written by worker 0 and resumed by broadcasting the epoch, the parameters and the optimizer
state, ``backward_passes_per_step`` and fp16 compression.
"""

import argparse
import os
import time

import torch
from sklearn.datasets import load_digits
from torch import nn

import imerge_hooks as hvd


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--schedule", default="imerge")
    parser.add_argument("--fp16-allreduce", action="store_true", help="compression=hvd.Compression.fp16")
    parser.add_argument("--batches-per-allreduce", type=int, default=1,
                        help="micro-batches per step (backward_passes_per_step)")
    parser.add_argument("--checkpoint", help="worker 0 saves here after every epoch; a later run resumes")
    parser.add_argument("--cuda", action="store_true", help="train on the GPU of this worker's local rank")
    args = parser.parse_args()

    hvd.init()  # on server ranks this serves and exits when the workers are done
    device = torch.device("cpu")
    if args.cuda:  # init() bound this worker to the GPU of hvd.local_rank(), as Horovod's examples do by hand
        device = torch.device("cuda", torch.cuda.current_device())
    torch.manual_seed(0)
    digits = load_digits()
    x = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(digits.target)
    x, y = x.to(device), y.to(device)
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    train_idx, val_idx = perm[:1500], perm[1500:]
    mine = train_idx[hvd.rank()::hvd.size()]  # this worker's shard
    my_val = val_idx[hvd.rank()::hvd.size()]

    model = nn.Sequential(nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(),
                          nn.MaxPool2d(2), nn.Flatten(), nn.Linear(32 * 4 * 4, 64), nn.ReLU(),
                          nn.Linear(64, 10)).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.05 * hvd.size(), momentum=0.9)

    # Resume: worker 0 reads the checkpoint, every worker learns the epoch and gets its state.
    first_epoch = 0
    if args.checkpoint and hvd.rank() == 0 and os.path.exists(args.checkpoint):
        saved = torch.load(args.checkpoint, weights_only=True, map_location=device)  # plain data only
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["optimizer"])
        first_epoch = saved["epoch"] + 1
    first_epoch = int(hvd.broadcast(torch.tensor(first_epoch), root_rank=0, name="resume_from_epoch").item())

    compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(), compression=compression,
                                   backward_passes_per_step=args.batches_per_allreduce, schedule=args.schedule,
                                   profile_steps=5)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    if first_epoch and hvd.rank() == 0:
        print(f"resumed at epoch {first_epoch}", flush=True)

    acc = float("nan")
    for epoch in range(first_epoch, args.epochs):
        model.train()
        order = mine[torch.randperm(len(mine), generator=torch.Generator().manual_seed(epoch))].to(device)
        start, seen = time.perf_counter(), 0
        loss_sum = torch.zeros((), device=device)
        for i in range(0, len(order) - args.batch_size + 1, args.batch_size):
            idx = order[i:i + args.batch_size]
            opt.zero_grad()
            for part in idx.chunk(args.batches_per_allreduce):
                loss = nn.functional.cross_entropy(model(x[part]), y[part])
                (loss * len(part) / len(idx)).backward()
                loss_sum += loss.detach() * len(part)
            opt.step()
            seen += len(idx)
        opt.synchronize()  # apply pending (overlapped) updates before evaluating
        elapsed = time.perf_counter() - start
        model.eval()
        with torch.no_grad():
            correct = (model(x[my_val.to(device)]).argmax(1) == y[my_val]).float().mean()
        # Metrics over every worker's shard: hvd.allreduce averages (as in Horovod's examples).
        acc = hvd.allreduce(correct, name="val_acc").item()
        train_loss = hvd.allreduce(loss_sum / seen, name="train_loss").item()
        if hvd.rank() == 0:
            print(f"epoch {epoch}: loss {train_loss:.4f}  val_acc {acc:.4f}  "
                  f"{seen * hvd.size() / elapsed:.0f} samples/s", flush=True)
            if args.checkpoint:
                torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "epoch": epoch},
                           args.checkpoint)
    if hvd.rank() == 0:
        print(f"RESULT val_acc={acc:.4f}", flush=True)


if __name__ == "__main__":
    main()
