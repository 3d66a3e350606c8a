"""torchvision ResNet-18 on synthetic images with a selectable IMerge schedule; prints samples/s.

    mpiexec -n 3 -env IMERGE_NUM_SERVERS 1 python examples/resnet_synthetic.py --schedule imerge
"""

import argparse
import json
import time

import torch
import torchvision
from torch import nn

import imerge_hooks as imh


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--schedule", default="imerge", choices=imh.SCHEDULES)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--image-size", type=int, default=64)
    parser.add_argument("--warmup", type=int, default=6, help="iterations not timed (profiling happens here)")
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--model", default="resnet18")
    parser.add_argument("--cuda", action="store_true", help="train on the GPU of this worker's local rank")
    args = parser.parse_args()

    imh.init()  # binds each worker to the GPU of its local rank among its host's workers
    device = torch.device("cuda", torch.cuda.current_device()) if args.cuda else torch.device("cpu")
    torch.manual_seed(0)
    model = getattr(torchvision.models, args.model)(num_classes=100).to(device)
    opt = imh.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9),
                                   named_parameters=model.named_parameters(), schedule=args.schedule,
                                   profile_steps=max(1, args.warmup - 2))
    imh.broadcast_parameters(model.state_dict(), root_rank=0)
    g = torch.Generator().manual_seed(imh.rank())
    x = torch.randn(args.batch_size, 3, args.image_size, args.image_size, generator=g)
    y = torch.randint(0, 100, (args.batch_size,), generator=g)
    x, y = x.to(device), y.to(device)
    for it in range(args.warmup + args.iters):
        if it == args.warmup:
            opt.synchronize()
            start = time.perf_counter()
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    opt.synchronize()
    elapsed = time.perf_counter() - start
    rate = args.iters * args.batch_size * imh.size() / elapsed
    if imh.rank() == 0:
        print(f"{args.model} schedule={args.schedule} workers={imh.size()} servers={imh.num_servers()}: "
              f"{rate:.1f} samples/s", flush=True)
        print("RESULT " + json.dumps({"schedule": args.schedule, "samples_per_s": rate, "workers": imh.size(),
                                      "servers": imh.num_servers()}), flush=True)


if __name__ == "__main__":
    main()
