"""The tensor collectives' device path driven on CPU: the workers' gloo group (``worker_group()`` without CUDA)
runs ``device_collectives``' calls with CPU tensors, and each op's result must equal the MPI path's
(``device_path_cases``). Also checks the decision function on gloo.

Usage: IMERGE_NUM_SERVERS=1 mpiexec -n 3 python device_path.py   (2 workers; prints ``PASS``/``FAIL`` lines,
``REDUCESCATTER gloo|emulated`` and ``ALL OK <workers>`` at the end)

Where gloo has no reduce_scatter (torch before it gained one) the device path's
``reduce_scatter_tensor`` is emulated by an all_reduce and a slice: the padding and splitting around
it are still checked, the collective itself is not.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from common import say as tagged_say
from device_path_cases import join_and_mixed, run_cases

import imerge_hooks as hvd
from imerge_hooks.cluster import session
from imerge_hooks.frontends import device_collectives

hvd.init()
R, W = hvd.rank(), hvd.size()


def say(*parts: object) -> None:
    tagged_say(session.topology().world_rank, *parts)


def reducescatter_on_gloo(group: object) -> str:
    """``gloo`` where this torch's gloo group reduce-scatters, else ``emulated`` (and the emulation installed)."""
    probe, out = torch.ones(W), torch.empty(1)
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor  # as device_collectives
    try:
        scatter(out, probe, group=group)
        assert out.item() == W
        return "gloo"
    except RuntimeError:  # raised on every worker alike, before anything moved
        pass

    def emulated(output: torch.Tensor, input: torch.Tensor, op: object = dist.ReduceOp.SUM, group: object = None,
                 async_op: bool = False) -> None:
        total = input.clone()
        dist.all_reduce(total, op=op, group=group)
        output.copy_(total.reshape(W, *output.shape)[dist.get_rank(group)])

    dist.reduce_scatter_tensor = emulated
    if hasattr(dist, "reduce_scatter_single"):
        dist.reduce_scatter_single = emulated
    return "emulated"


def decision(group: object) -> None:
    """``device_group``: CPU tensors, a gloo group, no group: None."""
    assert device_collectives.workers_group() is group
    assert not device_collectives.is_nccl(group)
    cpu = [torch.ones(2), torch.zeros(3, dtype=torch.int64)]
    assert device_collectives.device_group(cpu) is None
    assert device_collectives.device_group(cpu, reduce=True) is None
    assert device_collectives.device_group([]) is None
    saved = device_collectives.on_this_gpu
    device_collectives.on_this_gpu = lambda t: True  # as if they were on this worker's GPU: the group is gloo
    try:
        assert device_collectives.device_group(cpu) is None
    finally:
        device_collectives.on_this_gpu = saved
    say("PASS", "decision")


def main() -> None:
    assert W == 2, "run on 2 workers"
    group = hvd.worker_group()
    assert dist.get_backend(group) == "gloo"
    decision(group)
    say("REDUCESCATTER", reducescatter_on_gloo(group))
    ok = run_cases(R, W, torch.device("cpu"), True, say)
    join_and_mixed(R, W, torch.device("cpu"), True, say)
    hvd.barrier()
    if ok:
        say("ALL OK", W)
    sys.stdout.flush()


main()
