"""PyTorch DDP communication hook: DDP buckets go through IMerge's servers.

::

    imerge_hooks.init()
    ddp = DistributedDataParallel(model, process_group=imerge_hooks.worker_group())
    ddp.register_comm_hook(imerge_hooks.IMergeHookState(schedule="wfbp"), imerge_hooks.ps_hook)

DDP waits for every bucket's future before ``backward()`` returns and before ``step()``, so
this path cannot overlap communication with the next forward pass (``overlap_forward`` is
refused here); use ``DistributedOptimizer`` or the Lightning strategy for that.

This module must keep annotations evaluated (no postponed-annotations future import): ``register_comm_hook``
compares the hook's annotations by identity.
"""

import logging
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist

from . import runtime
from .errors import IMergeConfigError
from .layout import Group, Placement, cut_keys, dtype_name, names_in_range, wire_dtype
from .planchoice import choose_plan
from .scheduler import SchedulePolicy
from .transport import SUPPORTED_DTYPES, KeySpec

log = logging.getLogger("imerge")

_BUCKET_SCHEDULES = ("default", "wfbp", "priority", "threshold", "mgwfbp", "adaptive-ps")


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
        self.cfg = runtime.engine_config("IMergeHookState", schedule=schedule, **config)
        if self.cfg.schedule not in _BUCKET_SCHEDULES:
            raise IMergeConfigError(
                f"IMerge: schedule {self.cfg.schedule!r} overlaps with the next forward pass, which a DDP comm hook "
                f"cannot; the DDP hook supports {', '.join(_BUCKET_SCHEDULES)}; use "
                "imerge_hooks.DistributedOptimizer or strategy='imerge' for it")
        if self.cfg.overlap_forward:
            raise IMergeConfigError("IMerge: overlap_forward is impossible through a DDP comm hook (DDP waits for "
                                    "every bucket before step()); use imerge_hooks.DistributedOptimizer")
        traits = self.cfg.traits
        self.policy = SchedulePolicy(priority=traits.priority, stagger=traits.stagger,
                                     credit_bytes=self.cfg.credit_bytes if traits.partition else None,
                                     result_window_bytes=self.cfg.result_window_bytes if traits.partition else None)
        self.names = {id(p): n for n, p in named_parameters} if named_parameters is not None else {}
        self._attach()

    def __getstate__(self) -> dict[str, Any]:
        """What a checkpoint, ``pickle`` or ``deepcopy`` keeps: the settings, not the communicator
        and buffers (as PowerSGD's state drops its process group); ``__setstate__`` re-attaches."""
        return {"cfg": self.cfg, "policy": self.policy, "names": self.names}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        if not runtime.is_initialized():
            runtime.init()
        self._attach()

    def _attach(self) -> None:
        """Bind to this process's IMerge runtime with a fresh bucket layout (registered on first use)."""
        self.topo = runtime.topology()
        self.comm = runtime.comm_thread()
        self.client = runtime.new_client_id()
        self.groups: dict[int, Group] = {}  # bucket index -> group
        self.layout: dict[int, tuple] = {}  # bucket index -> (numel, dtype, device, names)
        self.epoch = 0
        # Planned schedules: DDP buckets are the planner's tensors; adjacent buckets are merged.
        self.planned = self.cfg.traits.planner != "none"
        self.iteration = 0
        self.ready: dict[int, float] = {}  # bucket index -> seconds after the first bucket
        self.samples: list[dict[int, float]] = []
        self.merged: list[Group] | None = None  # planned groups of buckets (after profiling)
        self.merged_of: dict[int, int] = {}  # bucket index -> merged group index
        self.pending: dict[int, tuple] = {}  # bucket index -> (buffer, future) until its group is done
        self.first_ready: float | None = None

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
            self.merged, self.merged_of, self.samples = None, {}, []  # re-profile the new buckets
        numel = buffer.numel()
        wire = wire_dtype(buffer.dtype, self.cfg.compression)
        esize = wire.itemsize
        ranges = cut_keys(numel, esize, self.cfg.partition_bytes if self.cfg.traits.partition else None,
                          self.topo.num_servers)
        placement = Placement(self.topo.num_servers)
        for g in self.groups.values():
            for k in g.keys:
                placement.place(k.nbytes)
        ids = runtime.allocate_keys(len(ranges))
        keys = [KeySpec(key, (end - start) * esize, SUPPORTED_DTYPES[wire],
                        placement.place((end - start) * esize), names_in_range(spans, start, end))
                for key, (start, end) in zip(ids, ranges)]
        self.groups[index] = Group(index=index, flat=buffer, keys=keys, key_ranges=ranges, priority=-index,
                                   names=tuple(n for n, _, _ in spans), members=[index],
                                   **_wire_buffers(buffer, wire))
        self.layout[index] = signature
        all_keys = [k for i in sorted(self.groups) for k in self.groups[i].keys]
        self.epoch = runtime.register_keys(self.client, all_keys)
        log.info("IMerge worker %d: DDP bucket %d registered (%d bytes, %d keys), plan epoch %d",
                 self.topo.worker_rank, index, numel * esize, len(keys), self.epoch)


    # ------------------------------------------------------------------ planned fusion of buckets
    def note_ready(self, bucket: dist.GradBucket) -> None:
        now = time.monotonic()
        if self.first_ready is None:
            self.first_ready = now
        self.ready[bucket.index()] = now - self.first_ready
        if bucket.is_last():
            self.iteration += 1
            if self.iteration > 2:  # DDP rebuilds its buckets after the first iteration(s)
                self.samples.append(dict(self.ready))
            self.ready, self.first_ready = {}, None

    def maybe_plan(self) -> None:
        """At an iteration boundary after profile_steps, merge adjacent buckets (a plan epoch)."""
        if self.merged is not None or len(self.samples) < max(1, self.cfg.profile_steps - 2) or self.ready:
            return
        from .replan import cost_model_for

        order = sorted(self.groups)
        sizes = [self.groups[b].nbytes for b in order]
        ready = [statistics.median(s.get(b, 0.0) for s in self.samples) for b in order]
        model = cost_model_for(self.cfg.traits.planner) if self.topo.num_servers else None
        decision = None
        if self.topo.worker_rank == 0:
            names = [f"bucket{b}" for b in order]
            decision = choose_plan(sizes, ready, names, model, self.cfg, self.topo.num_workers,
                                   self.topo.num_servers,
                                   dtypes=[str(self.groups[b].flat.dtype) for b in order]).groups
        decision = runtime.from_worker0(decision, "the merged-bucket plan")
        placement = Placement(self.topo.num_servers)
        merged, keys = [], []
        for gi, members in enumerate(decision):
            buckets = [order[j] for j in members]
            flat = torch.cat([self.groups[b].flat.detach().reshape(-1) for b in buckets])
            wire = wire_dtype(flat.dtype, self.cfg.compression)
            ranges = cut_keys(flat.numel(), wire.itemsize, None, self.topo.num_servers)
            ids = runtime.allocate_keys(len(ranges))
            names = tuple(n for b in buckets for n in self.groups[b].names)
            spans, offset = [], 0
            for b in buckets:
                for n in self.groups[b].names:
                    spans.append((n, offset, 0))
                offset += self.groups[b].flat.numel()
            gkeys = [KeySpec(k, (e - s_) * wire.itemsize, SUPPORTED_DTYPES[wire],
                             placement.place((e - s_) * wire.itemsize), names)
                     for k, (s_, e) in zip(ids, ranges)]
            keys += gkeys
            merged.append(Group(index=gi, flat=flat, keys=gkeys, key_ranges=ranges, priority=-min(buckets),
                                names=names, members=buckets, **_wire_buffers(flat, wire)))
            for b in buckets:
                self.merged_of[b] = gi
        self.merged = merged
        self.epoch = runtime.register_keys(self.client, keys)
        log.info("IMerge worker %d: DDP buckets merged into %d groups (%s plan), plan epoch %d",
                 self.topo.worker_rank, len(merged), self.cfg.traits.planner, self.epoch)

    def push_merged(self, bucket: dist.GradBucket, future: torch.futures.Future) -> None:
        group = self.merged[self.merged_of[bucket.index()]]
        offset = 0
        for b in group.members:
            if b == bucket.index():
                break
            offset += self.groups[b].flat.numel()
        buffer = bucket.buffer()
        group.flat[offset:offset + buffer.numel()].copy_(buffer.reshape(-1))
        self.pending[bucket.index()] = (buffer, future, offset)
        if any(b not in self.pending for b in group.members):
            return

        def complete(error: BaseException | None, group: Group = group) -> None:
            for b in group.members:
                buf, fut, off = self.pending.pop(b)
                if error is not None:
                    fut.set_exception(error)
                    continue
                buf.reshape(-1).copy_(group.flat[off:off + buf.numel()])
                fut.set_result(buf)

        group.callbacks.append(complete)
        self.comm.submit(group, self.policy)


def _wire_buffers(flat: torch.Tensor, wire: torch.dtype) -> dict[str, torch.Tensor | None]:
    """A group's result buffer in the wire dtype (host memory) and, when the gradients are on a GPU
    or go compressed, the host staging copy they are pushed from (``Group.send_buffer``)."""
    on_host = flat.device.type == "cpu"
    result = torch.empty(flat.numel(), dtype=wire, pin_memory=not on_host and torch.cuda.is_available())
    staging = None if on_host and wire == flat.dtype else torch.empty_like(result)
    return {"result": result, "staging": staging}


def ps_hook(state: IMergeHookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: average ``bucket`` over the workers through the parameter servers."""
    if state.planned and state.comm is not None:
        if bucket.index() == 0:
            state.maybe_plan()
        state.note_ready(bucket)
        if state.merged is not None and bucket.index() in state.merged_of \
                and state.groups.get(bucket.index()) is not None \
                and state.layout.get(bucket.index(), (None,))[0] == bucket.buffer().numel():
            future = torch.futures.Future()
            state.push_merged(bucket, future)
            return future
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
