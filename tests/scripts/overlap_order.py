"""Record forward / wait events under overlap_forward with slow communication.

Front layers are small, the last layer is large; the servers answer each key only after
IMERGE_DEBUG_DELAY_PER_MB_S seconds per MB. Worker 0 prints the event list of the last step.
``--device cuda``: the model on the worker's GPU (``tests/gpu``).
"""

import argparse
import json

import torch
from common import say
from torch import nn

import imerge_hooks as imh

parser = argparse.ArgumentParser()
parser.add_argument("--device", default="cpu")
args = parser.parse_args()
imh.init()
device = torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 4096), nn.Tanh(),
                      nn.Linear(4096, 256)).to(device)
opt = imh.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01), named_parameters=model.named_parameters(),
                               schedule="priority", overlap_forward=True, partition_bytes=1 << 20)
engine = opt._imerge_engine
names = {id(m): n for n, m in model.named_modules()}
for module in model:
    if isinstance(module, nn.Linear):
        module.register_forward_pre_hook(lambda m, _a: engine.events.append(("forward", names[id(m)], 0, None)))
x = torch.randn(4, 8, device=device)
for _ in range(4):
    opt.zero_grad()
    engine.events.clear()
    model(x).square().mean().backward()
    opt.step()
events = [(kind, name, detail) for kind, name, _, detail in engine.events]
opt.synchronize()
say(imh.rank(), "EVENTS", json.dumps(events))
