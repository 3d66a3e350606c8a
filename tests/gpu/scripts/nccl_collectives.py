"""The tensor collectives on CUDA tensors with one worker per GPU: their data moves over the workers' NCCL group
(``imerge_hooks.frontends.device_collectives``), never through the host, and every op's result equals the host path's
(staged through ``.cpu()`` for MPI). The cases are ``tests/scripts/device_path_cases.py``'s, on the real
decision (``device_group``) this time.

Usage: IMERGE_NUM_SERVERS=1 mpiexec -n 3 python nccl_collectives.py   (2 workers on 2 GPUs; prints ``PASS``/``FAIL``
lines and ``ALL OK <workers>`` at the end)
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from device_path_cases import join_and_mixed, run_cases  # noqa: E402

import imerge_hooks as imh  # noqa: E402
from imerge_hooks.cluster import session
from imerge_hooks.frontends import device_collectives

imh.init()
R, W = imh.rank(), imh.size()


def say(*parts: object) -> None:
    print(f"@{session.topology().world_rank}", *parts, flush=True)


def decision(group: object, device: torch.device) -> None:
    """``device_group``: the NCCL group for CUDA tensors on this worker's GPU, None otherwise."""
    assert device_collectives.workers_group() is group and device_collectives.is_nccl(group)
    t = torch.ones(2, device=device)
    assert device_collectives.device_group([t]) is group
    assert device_collectives.device_group([t, t.to(torch.int64)], reduce=True) is group
    assert device_collectives.device_group([t, torch.ones(2)]) is None  # one CPU tensor: the host path
    assert device_collectives.device_group([t.to(torch.int16)], reduce=True) is None  # NCCL has no int16 reduction
    assert device_collectives.device_group([t.to(torch.int16)]) is group  # its bytes move
    other = torch.ones(2, device=torch.device("cuda", (device.index + 1) % torch.cuda.device_count()))
    assert device_collectives.device_group([other]) is None  # another GPU than this worker's
    say("PASS", "decision")


def main() -> None:
    assert W == 2 and torch.cuda.device_count() >= 2, "run 2 workers on 2 GPUs"
    group = imh.worker_group()
    assert dist.get_backend(group) == "nccl", dist.get_backend(group)
    device = torch.device("cuda", torch.cuda.current_device())
    assert device.index == session.topology().local_rank  # one worker per GPU
    decision(group, device)
    ok = run_cases(R, W, device, False, say)
    join_and_mixed(R, W, device, False, say)
    torch.cuda.synchronize()
    imh.barrier()
    if ok:
        say("ALL OK", W)


main()
