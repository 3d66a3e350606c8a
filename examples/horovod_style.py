"""A Horovod-style training loop with imerge_hooks.DistributedOptimizer (digits data, no download).

    mpiexec -n 3 -env IMERGE_NUM_SERVERS 1 python examples/horovod_style.py --epochs 3
    python examples/horovod_style.py            # single process, no server
"""

import argparse
import time

import torch
from sklearn.datasets import load_digits
from torch import nn

import imerge_hooks as imh


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--schedule", default="imerge")
    args = parser.parse_args()

    imh.init()  # on server ranks this serves and exits when the workers are done
    torch.manual_seed(0)
    digits = load_digits()
    x = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(digits.target)
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    train_idx, val_idx = perm[:1500], perm[1500:]
    mine = train_idx[imh.rank()::imh.size()]  # this worker's shard

    model = nn.Sequential(nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(),
                          nn.MaxPool2d(2), nn.Flatten(), nn.Linear(32 * 4 * 4, 64), nn.ReLU(), nn.Linear(64, 10))
    opt = imh.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05 * imh.size(), momentum=0.9),
                                   named_parameters=model.named_parameters(), schedule=args.schedule,
                                   profile_steps=5)
    imh.broadcast_parameters(model.state_dict(), root_rank=0)
    imh.broadcast_optimizer_state(opt, root_rank=0)

    for epoch in range(args.epochs):
        model.train()
        order = mine[torch.randperm(len(mine), generator=torch.Generator().manual_seed(epoch))]
        start, seen, total_loss = time.perf_counter(), 0, 0.0
        for i in range(0, len(order) - args.batch_size + 1, args.batch_size):
            idx = order[i:i + args.batch_size]
            opt.zero_grad()
            loss = nn.functional.cross_entropy(model(x[idx]), y[idx])
            loss.backward()
            opt.step()
            seen += len(idx)
            total_loss += loss.item() * len(idx)
        opt.synchronize()  # apply pending (overlapped) updates before evaluating
        elapsed = time.perf_counter() - start
        model.eval()
        with torch.no_grad():
            acc = (model(x[val_idx]).argmax(1) == y[val_idx]).float().mean().item()
        if imh.rank() == 0:
            print(f"epoch {epoch}: loss {total_loss / seen:.4f}  val_acc {acc:.4f}  "
                  f"{seen * imh.size() / elapsed:.0f} samples/s", flush=True)
    if imh.rank() == 0:
        print(f"RESULT val_acc={acc:.4f}", flush=True)


if __name__ == "__main__":
    main()
