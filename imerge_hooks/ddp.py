"""PyTorch DDP communication hook: DDP buckets go through IMerge's servers.

::

    imerge_hooks.init()
    ddp = DistributedDataParallel(model, process_group=imerge_hooks.worker_group())
    ddp.register_comm_hook(imerge_hooks.IMergeHookState(schedule="wfbp"), imerge_hooks.ps_hook)

DDP waits for every bucket's future before ``backward()`` returns and before ``step()``, so
this path cannot overlap communication with the next forward pass (``overlap_forward`` is
refused here); use ``DistributedOptimizer`` or the Lightning strategy for that.

This module must not use ``from __future__ import annotations``: ``register_comm_hook``
compares the hook's annotations by identity.
"""

import logging
from typing import Any

import torch
import torch.distributed as dist

from . import runtime
from .config import Config
from .errors import IMergeConfigError
from .layout import Group, Placement, cut_keys, dtype_name, names_in_range
from .scheduler import SchedulePolicy
from .transport import SUPPORTED_DTYPES, KeySpec

log = logging.getLogger("imerge")

_BUCKET_SCHEDULES = ("default", "wfbp", "priority")


class IMergeHookState:
    """State of ``ps_hook``: the bucket layout registered with the servers, and the schedule.

    ``schedule`` is ``wfbp`` (each bucket as soon as DDP hands it over), ``priority``
    (buckets cut into partitions, front layers first, credit-bounded) or ``default`` (same
    as wfbp: DDP itself decides when buckets are ready). Fusion is DDP's ``bucket_cap_mb``.
    ``named_parameters`` (optional) lets error messages name tensors.
    """

    def __init__(self, schedule: str = "wfbp", named_parameters: Any | None = None, **config: Any) -> None:
        if not runtime.is_initialized():
            runtime.init()
        self.cfg = Config.from_env(runtime.config(), schedule=schedule, **config)
        if self.cfg.schedule not in _BUCKET_SCHEDULES:
            raise IMergeConfigError(
                f"IMerge: schedule {self.cfg.schedule!r} plans its own fusion, which DDP's buckets fix already; the "
                f"DDP hook supports {', '.join(_BUCKET_SCHEDULES)} (tune fusion with DDP's bucket_cap_mb), or use "
                "imerge_hooks.DistributedOptimizer / strategy='imerge' for the planned schedules")
        if self.cfg.overlap_forward:
            raise IMergeConfigError("IMerge: overlap_forward is impossible through a DDP comm hook (DDP waits for "
                                    "every bucket before step()); use imerge_hooks.DistributedOptimizer")
        traits = self.cfg.traits
        self.policy = SchedulePolicy(priority=traits.priority, stagger=traits.stagger,
                                     credit_bytes=self.cfg.credit_bytes if traits.partition else None)
        self.topo = runtime.topology()
        self.comm = runtime.comm_thread()
        self.client = runtime.new_client_id()
        self.names = {id(p): n for n, p in named_parameters} if named_parameters is not None else {}
        self.groups: dict[int, Group] = {}  # bucket index -> group
        self.layout: dict[int, tuple] = {}  # bucket index -> (numel, dtype, device, names)
        self.epoch = 0

    def _bucket_names(self, bucket: dist.GradBucket) -> list[tuple[str, int, int]]:
        spans, offset = [], 0
        for j, p in enumerate(bucket.parameters()):
            name = self.names.get(id(p), f"bucket{bucket.index()}.param{j}")
            spans.append((name, offset, p.numel()))
            offset += p.numel()
        return spans

    def group_for(self, bucket: dist.GradBucket) -> Group:
        """The group for this bucket; registers a new plan epoch when DDP changed its buckets."""
        buffer = bucket.buffer()
        index = bucket.index()
        spans = self._bucket_names(bucket)
        where = f"worker {self.topo.worker_rank}, DDP bucket {index}"
        dtype_name(buffer.dtype, spans[0][0] if spans else "?", where)
        signature = (buffer.numel(), buffer.dtype, buffer.device, tuple(n for n, _, _ in spans))
        if self.layout.get(index) != signature:
            self._register_bucket(index, buffer, spans, signature)
        group = self.groups[index]
        group.flat = buffer
        return group

    def _register_bucket(self, index: int, buffer: torch.Tensor, spans: list, signature: tuple) -> None:
        # A bucket index beyond the known ones, or with a new shape: DDP built or rebuilt its buckets.
        if index == 0:
            self.groups, self.layout = {}, {}
        numel, esize = buffer.numel(), buffer.element_size()
        ranges = cut_keys(numel, esize, self.cfg.partition_bytes if self.cfg.traits.partition else None,
                          self.topo.num_servers)
        placement = Placement(self.topo.num_servers)
        for g in self.groups.values():
            for k in g.keys:
                placement.place(k.nbytes)
        ids = runtime.allocate_keys(len(ranges))
        keys = [KeySpec(key, (end - start) * esize, SUPPORTED_DTYPES[buffer.dtype],
                        placement.place((end - start) * esize), names_in_range(spans, start, end))
                for key, (start, end) in zip(ids, ranges)]
        on_host = buffer.device.type == "cpu"
        result = torch.empty(numel, dtype=buffer.dtype, pin_memory=not on_host and torch.cuda.is_available())
        self.groups[index] = Group(index=index, flat=buffer, result=result, keys=keys, key_ranges=ranges,
                                   priority=-index, names=tuple(n for n, _, _ in spans),
                                   staging=None if on_host else torch.empty_like(result), members=[index])
        self.layout[index] = signature
        all_keys = [k for i in sorted(self.groups) for k in self.groups[i].keys]
        self.epoch = runtime.register_keys(self.client, all_keys)
        log.info("IMerge worker %d: DDP bucket %d registered (%d bytes, %d keys), plan epoch %d",
                 self.topo.worker_rank, index, numel * esize, len(keys), self.epoch)


def ps_hook(state: IMergeHookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: average ``bucket`` over the workers through the parameter servers."""
    group = state.group_for(bucket)
    buffer = bucket.buffer()
    if buffer.device.type == "cuda":
        future: torch.futures.Future = torch.futures.Future(devices=[buffer.device])
        event = torch.cuda.Event()
        event.record()
        group.cuda_event = event
    else:
        future = torch.futures.Future()
    if state.comm is None:  # one worker, no server: nothing to average
        future.set_result(buffer)
        return future

    def complete(error: BaseException | None) -> None:
        if error is None:
            future.set_result(buffer)
        else:
            future.set_exception(error)

    group.callbacks.append(complete)
    state.comm.submit(group, state.policy)
    return future
