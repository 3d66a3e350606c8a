"""Plain PyTorch DDP with IMerge's parameter-server communication hook.

    mpiexec -n 3 -env IMERGE_NUM_SERVERS 1 python examples/ddp_hook.py --epochs 3 [--checkpoint ckpt.pt]

With ``--checkpoint`` worker 0 saves the model, the optimizer and the hook state after every
epoch, and a later launch resumes from it (the hook state pickles as PowerSGD's does: its
settings travel, its communicator and buffers are rebuilt on load).

DDP waits for every bucket before step(), so this path cannot overlap with the next forward
pass; use imerge_hooks.DistributedOptimizer or the Lightning strategy for the `imerge` schedule.
"""

import argparse
import os
import time

import torch
from sklearn.datasets import load_digits
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import imerge_hooks as imh


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--schedule", choices=["default", "wfbp", "priority"],
                        help="default: IMERGE_SCHEDULE, else wfbp")
    parser.add_argument("--checkpoint", help="save after every epoch; resume from it if it exists")
    parser.add_argument("--cuda", action="store_true", help="train on the GPU of this worker's local rank")
    args = parser.parse_args()

    imh.init()  # binds each worker to the GPU of its local rank among its host's workers
    device = torch.device("cuda", torch.cuda.current_device()) if args.cuda else torch.device("cpu")
    torch.manual_seed(0)
    digits = load_digits()
    x = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(digits.target)
    x, y = x.to(device), y.to(device)
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    train_idx, val_idx = perm[:1500], perm[1500:]
    mine = train_idx[imh.rank()::imh.size()]

    model = nn.Sequential(nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
                          nn.Linear(16 * 4 * 4, 64), nn.ReLU(), nn.Linear(64, 10)).to(device)
    ddp = DistributedDataParallel(model, process_group=imh.worker_group())
    state = imh.IMergeHookState(schedule=args.schedule, named_parameters=model.named_parameters())
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05 * imh.size(), momentum=0.9)
    first_epoch = 0
    if args.checkpoint and os.path.exists(args.checkpoint):
        saved = torch.load(args.checkpoint, weights_only=True, map_location=device)  # plain data only
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["optimizer"])
        state.load_state_dict(saved["hook_state"])
        first_epoch = saved["epoch"] + 1
        if imh.rank() == 0:
            print(f"resumed after epoch {saved['epoch']} (schedule {state.cfg.schedule})", flush=True)
    ddp.register_comm_hook(state, imh.ps_hook)
    acc = float("nan")
    for epoch in range(first_epoch, args.epochs):
        start, seen = time.perf_counter(), 0
        order = mine[torch.randperm(len(mine), generator=torch.Generator().manual_seed(epoch))].to(device)
        for i in range(0, len(order) - args.batch_size + 1, args.batch_size):
            idx = order[i:i + args.batch_size]
            opt.zero_grad()
            nn.functional.cross_entropy(ddp(x[idx]), y[idx]).backward()
            opt.step()
            seen += len(idx)
        with torch.no_grad():
            acc = (model(x[val_idx.to(device)]).argmax(1) == y[val_idx.to(device)]).float().mean().item()
        if imh.rank() == 0:
            print(f"epoch {epoch}: val_acc {acc:.4f}  {seen * imh.size() / (time.perf_counter() - start):.0f} "
                  "samples/s", flush=True)
            if args.checkpoint:
                torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(),
                            "hook_state": state.state_dict(), "epoch": epoch}, args.checkpoint)
    if imh.rank() == 0:
        print(f"RESULT val_acc={acc:.4f}", flush=True)


if __name__ == "__main__":
    main()
