"""Worker 1 skips its backward before one step(); the servers must name it at its next push.

Usage: python skipped_backward.py
"""

import time

import torch
from common import batch, loss_fn, make_model, say

import imerge_hooks as imh

imh.init()
model = make_model()
opt = imh.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                               named_parameters=model.named_parameters(), schedule="wfbp")
for step in range(20):
    opt.zero_grad()
    if not (imh.rank() == 1 and step == 3):
        x, y = batch(step)
        loss_fn(model, x, y).backward()
    opt.step()
    time.sleep(0.01)
say(imh.rank(), "finished without noticing")
