"""Which torch.distributed backend the workers' group runs: NCCL where every worker has a GPU of its own, else
gloo (``IMERGE_BACKEND`` overrides)."""

from __future__ import annotations

import os

import torch

from .topology import Topology


def workers_share_gpus(topo: Topology) -> bool:
    """Whether two workers of some host use one GPU (NCCL refuses such a group: gloo then)."""
    for host in set(topo.hosts[:topo.num_workers]):
        workers = topo.workers_on(host)
        visible = topo.gpus[workers[0]] if topo.gpus else 0
        if visible and len(workers) > visible:
            return True
    return False


def worker_backend(topo: Topology) -> str:
    """torch.distributed backend of the workers' group: NCCL on GPUs (one per worker), else gloo;
    ``IMERGE_BACKEND`` overrides."""
    override = os.environ.get("IMERGE_BACKEND", "").strip()
    if override:
        return override
    return "nccl" if torch.cuda.is_available() and not workers_share_gpus(topo) else "gloo"
