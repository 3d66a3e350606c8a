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

import dataclasses
import logging
import os
from contextlib import nullcontext
from typing import Any

import torch
import torch.distributed as dist

from ..cluster import session, startup
from ..core.config import PROCESS_OPTIONS, SCHEDULE_TRAITS, SCHEDULES, Config
from ..core.errors import IMergeArgumentError, IMergeConfigError, IMergeUsageError
from ..core.layout import dtype_name
from ..worker.engine import GradientEngine
from ..worker.group import Group

log = logging.getLogger("imerge")

# What a comm hook can run: every schedule that does not overlap updates with the next forward
_BUCKET_SCHEDULES = tuple(s for s in SCHEDULES if not SCHEDULE_TRAITS[s].overlap_forward)


class BucketEngine(GradientEngine):
    """The engine with DDP's buckets as its tensors: gradients arrive from the hook, not from
    grad hooks, and the step is the user's; layout, keys, placement, registration, profiling,
    planning, compression, timeline and failures are the engine's."""

    def _connect(self) -> None:
        pass  # no parameter hooks; DDP's own join and broadcasts cover the rest


def _stand_in(numel: int, dtype: torch.dtype, device: torch.device) -> torch.nn.Parameter:
    """A bucket as an engine tensor: its shape, dtype and device, and no storage of its own."""
    return torch.nn.Parameter(torch.zeros((), dtype=dtype, device=device).expand(numel))


class IMergeHookState:
    """State of ``ps_hook``: the engine over DDP's buckets, and the schedule.

    ``schedule`` is ``wfbp`` (each bucket as soon as DDP hands it over), ``default`` (every
    bucket once DDP has handed over the last), ``priority`` (buckets cut into partitions, front
    layers first, credit-bounded), or a planned schedule (``threshold``, ``mgwfbp``,
    ``adaptive-ps``: adjacent buckets merged after ``profile_steps`` profiled iterations).
    Not given, it is ``init(schedule=...)``'s, else ``IMERGE_SCHEDULE``, else ``wfbp``; ``imerge``
    from one of those (a job-wide setting) runs as ``adaptive-ps`` here, its plan without the
    overlap that a comm hook cannot have (logged once); ``schedule="imerge"`` itself is refused.
    ``named_parameters`` (optional) lets error messages name tensors. ``process_group``
    (optional): DDP's group, checked to be all the workers (the servers average over all of them).
    """

    def __init__(self, schedule: str | None = None, named_parameters: Any | None = None,
                 process_group: Any | None = None, **config: Any) -> None:
        if not session.is_initialized():
            _refuse_world_process_group()
            startup.init()
        _check_process_group(process_group)
        schedule = _hook_schedule(schedule)
        self.cfg = _checked(session.engine_config("IMergeHookState", schedule=schedule, **config))
        self.names = {id(p): n for n, p in named_parameters} if named_parameters is not None else {}
        self._attach()

    def state_dict(self) -> dict[str, Any]:
        """The hook's settings as plain data: a checkpoint entry that ``torch.load(weights_only=True)``
        reads. Restore with :meth:`load_state_dict` or ``IMergeHookState(**state_dict)``."""
        return {f.name: getattr(self.cfg, f.name) for f in dataclasses.fields(Config) if f.name not in PROCESS_OPTIONS}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Take the settings of :meth:`state_dict`, validated as the constructor's; before training only."""
        if not isinstance(state_dict, dict):
            raise IMergeArgumentError(f"IMergeHookState.load_state_dict: expected a dict, got "
                                      f"{type(state_dict).__name__}")
        unknown = sorted(set(state_dict) - {f.name for f in dataclasses.fields(Config)})
        if unknown:
            raise IMergeConfigError(f"IMergeHookState.load_state_dict: unknown setting(s) {', '.join(unknown)}")
        cfg = _checked(session.engine_config("IMergeHookState.load_state_dict", **state_dict))
        if self.engine is not None and cfg != self.cfg:
            raise IMergeUsageError("IMergeHookState.load_state_dict: this hook state has already synchronised "
                                   "gradients; load the settings before the first backward")
        self.cfg = cfg

    def __getstate__(self) -> dict[str, Any]:
        """What ``pickle`` and ``deepcopy`` keep: the settings, not the communicator and buffers (as
        PowerSGD's state drops its process group); checkpoints hold :meth:`state_dict` instead.
        Tensor names are keyed by object identity, which means nothing in another process, so a
        restored state names bucket tensors by position (the same on every worker)."""
        return {"cfg": self.cfg}

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Validates the settings and binds to IMerge if it runs; never starts MPI (a state unpickled
        before ``init()`` binds at its first bucket)."""
        self.cfg = _checked(Config(**dataclasses.asdict(state["cfg"])))
        self.names = {}
        self.engine = None
        self.attached = False
        if session.is_initialized():
            self._attach()

    def _attach(self) -> None:
        """Bind to this process's IMerge runtime; the engine is built at the first iteration."""
        self.topo = session.topology()
        self.comm = session.comm_thread()
        self.engine: BucketEngine | None = None
        self.signature: list[tuple] = []  # the engine's buckets: (numel, dtype, device, names)
        self.iteration_open = False
        self.outstanding: dict[int, tuple[torch.Tensor, torch.futures.Future]] = {}  # this iteration's buckets
        self.collected: dict[int, tuple] = {}  # buckets of a new layout, pushed once the last one is in
        self.described: dict[int, tuple[tuple, tuple]] = {}  # bucket index -> (its tensors' ids, its signature)
        self.attached = True

    def _describe(self, bucket: dist.GradBucket) -> tuple:
        """The bucket's (numel, dtype, device, tensor names): what tells a rebuilt bucket from the one the engine
        has. Named once per bucket layout: the same tensors in the same buffer give the same signature."""
        buffer = bucket.buffer()
        params = bucket.parameters()
        index = bucket.index()
        ids = (buffer.data_ptr(), buffer.numel(), buffer.dtype, buffer.device, *map(id, params))
        known = self.described.get(index)
        if known is not None and known[0] == ids:
            return known[1]
        names = tuple(self.names.get(id(p), f"bucket{index}.param{j}") for j, p in enumerate(params))
        dtype_name(buffer.dtype, names[0] if names else "?", f"worker {self.topo.worker_rank}, DDP bucket {index}")
        signature = buffer.numel(), buffer.dtype, buffer.device, names
        self.described[index] = ids, signature
        return signature

    # ------------------------------------------------------------------ one bucket
    # The engine's tensors are the buckets in forward order (tensor j is bucket count-1-j, as
    # parameters are registered), so its first guess, priorities and plans read as for parameters.
    def _tensor(self, bucket_index: int) -> int:
        return len(self.signature) - 1 - bucket_index

    def push(self, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        if not self.attached:
            if not session.is_initialized():
                raise IMergeUsageError("IMerge: an unpickled IMergeHookState ran before imerge_hooks.init(); call "
                                       "init() first (unpickling never starts MPI)")
            self._attach()
        buffer = bucket.buffer()
        future = (torch.futures.Future(devices=[buffer.device]) if buffer.device.type == "cuda"
                  else torch.futures.Future())
        if self.comm is None:  # one worker, no server: nothing to average
            future.set_result(buffer)
            return future
        index = bucket.index()
        if index == 0:
            self._end_iteration()
        self.iteration_open = True
        self.outstanding[index] = (buffer, future)
        signature = self._describe(bucket)
        if self.collected or index >= len(self.signature) or self.signature[index] != signature:
            # DDP built or rebuilt its buckets: gather this iteration's new ones, then a new engine.
            self.collected[index] = signature
        else:
            self.engine.accept(self._tensor(index), buffer)
        if bucket.is_last():
            if self.collected or index + 1 != len(self.signature):
                self._adopt_buckets(index + 1)
            else:
                self.engine.push_remaining()  # schedule "default": every bucket goes now
        return future

    def _complete(self, group: Group):
        """The comm thread's completion of ``group``: averaged buckets back into DDP's buffers."""
        engine = self.engine
        spans = []
        offset = 0
        for i in group.members:
            numel = engine.params[i].numel()
            spans.append((self._tensor(i), offset, numel))  # tensor index <-> bucket index: same map
            offset += numel
        # On CUDA the averaged buckets come from the gradient buffer, uploaded on the copy stream: the
        # copies into DDP's buckets queue behind those uploads there, and each future is completed with
        # that stream current, so DDP's wait on it makes its stream wait for them (not the host); the
        # next round's writes into the gradient buffer wait for those copies (``Group.before_write``).
        result = group.flat if group.on_device else group.result

        def complete(error: BaseException | None) -> None:
            with group.device.on_copy_stream() if group.on_device else nullcontext():
                self._deliver(group, spans, result, error)

        return complete

    def _deliver(self, group: Group, spans: list[tuple[int, int, int]], result: torch.Tensor,
                 error: BaseException | None) -> None:
        """Hand each of this iteration's buckets in ``spans`` its averaged slice of ``result`` (or ``error``):
        every copy queued first, then the futures completed."""
        done = []
        for index, start, numel in spans:
            if index in self.collected:
                continue  # a bucket of the new layout: the old engine carried zeros for it
            entry = self.outstanding.pop(index, None)
            if entry is None:
                continue  # already averaged through the old engine (carried as zeros here)
            buffer, future = entry
            if error is None:
                buffer.reshape(-1).copy_(result[start:start + numel], non_blocking=True)
                if buffer.device.type == "cuda":
                    buffer.record_stream(torch.cuda.current_stream(buffer.device))
            done.append((buffer, future))
        if error is None:
            group.copies_out_queued()
        for buffer, future in done:
            if error is not None:
                future.set_exception(error)
            else:
                future.set_result(buffer)

    # ------------------------------------------------------------------ iteration boundaries
    def _end_iteration(self) -> None:
        """At the next iteration's first bucket: take the results and let the planner act."""
        if not self.iteration_open or self.engine is None:
            return
        self.iteration_open = False
        for group in self.engine.groups:
            if group.submitted:
                self.engine.wait_group(group)
        self.engine.finish_iteration()

    def _adopt_buckets(self, count: int) -> None:
        """The last bucket of a new layout is in: finish the old engine's groups, retire it, and
        average the new buckets through an engine built over all ``count`` of them."""
        old = self.engine
        if old is not None:
            # The buckets that matched the old layout went through it; send what is left of its
            # groups (every worker does the same) so they complete, then retire it (a plan epoch).
            old.push_remaining()
            for group in old.groups:
                if group.submitted:
                    old.wait_group(group)
            old.close()
        signature = [self.collected.get(b) or self.signature[b] for b in range(count)]
        named = []
        for b in reversed(range(count)):
            numel, dtype, device, names = signature[b]
            shown = ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")
            named.append((f"ddp_bucket{b}[{shown}]", _stand_in(numel, dtype, device)))
        self.signature = signature
        self.engine = engine = BucketEngine(named, self.cfg)
        engine.on_complete = self._complete
        log.info("IMerge worker %d: %d DDP buckets (%d bytes) adopted, plan epoch %d",
                 self.topo.worker_rank, count, sum(g.nbytes for g in engine.groups), engine.epoch)
        collected, self.collected = self.collected, {}
        for b in sorted(collected):
            engine.accept(self._tensor(b), self.outstanding[b][0])
        engine.push_remaining()  # buckets the old engine averaged go along as zeros, once
        self.iteration_open = True


DEFAULT_SCHEDULE = "wfbp"
_OVERLAP_STAND_IN = "adaptive-ps"  # `imerge` without what a comm hook cannot do: partitions and the overlap
_logged_stand_in = False


def _hook_schedule(schedule: str | None) -> str:
    """The hook's schedule: the argument > ``init(schedule=...)`` > ``IMERGE_SCHEDULE`` > ``wfbp``.

    ``imerge`` set job-wide (``init()`` or the env var) becomes ``adaptive-ps`` with one log line:
    the job's other engines may use it, and the hook's nearest schedule is its plan without the
    overlap. Asked for by name here, it is refused (``IMergeHookState.__init__``)."""
    global _logged_stand_in
    if schedule is not None:
        source, name = "the schedule argument", schedule
    elif session.init_option("schedule") is not None:
        source, name = "imerge_hooks.init(schedule=...)", session.init_option("schedule")
    elif os.environ.get("IMERGE_SCHEDULE"):
        source, name = "IMERGE_SCHEDULE", os.environ["IMERGE_SCHEDULE"]
    else:
        return DEFAULT_SCHEDULE
    if name not in _BUCKET_SCHEDULES and name not in SCHEDULE_TRAITS:
        raise IMergeConfigError(f"IMerge: unknown schedule {name!r} ({source}) for the DDP hook; it supports "
                                f"{', '.join(_BUCKET_SCHEDULES)}")
    if schedule is None and name not in _BUCKET_SCHEDULES:
        if not _logged_stand_in and session.topology().worker_rank == 0:
            log.warning("IMerge: %s is %r, which overlaps with the next forward pass; a DDP comm hook cannot "
                        "(DDP waits for every bucket before step()), so the DDP hook runs %r (the same plan, no "
                        "overlap). Pass IMergeHookState(schedule=...) to choose, or use DistributedOptimizer for "
                        "the overlap", source, name, _OVERLAP_STAND_IN)
        _logged_stand_in = True
        return _OVERLAP_STAND_IN
    return name


def _refuse_world_process_group() -> None:
    """torch.distributed over every MPI rank, then IMerge started here: the last ranks would become
    servers and never join DDP's collectives, so the workers would hang in them. Refuse at once."""
    if not (dist.is_available() and dist.is_initialized()):
        return
    world = dist.get_world_size()
    mpi_world = int(os.environ.get("PMI_SIZE") or os.environ.get("OMPI_COMM_WORLD_SIZE") or 0)
    if mpi_world > 1 and world == mpi_world:
        raise IMergeUsageError(
            f"IMerge: torch.distributed was initialised over all {world} ranks, but IMerge's last ranks are "
            "parameter servers and train nothing: call imerge_hooks.init() first (servers serve there) and "
            "give DDP process_group=imerge_hooks.worker_group()")


def _check_process_group(group: Any | None) -> None:
    """IMerge averages over all workers: a DDP over a subgroup of them would be averaged wrongly."""
    if group is None:
        return
    workers = session.topology().num_workers
    size = dist.get_world_size(group)
    if size != workers:
        raise IMergeConfigError(
            f"IMerge: the DDP hook averages over all {workers} workers, but process_group has {size} ranks; "
            "run DDP over imerge_hooks.worker_group() (a DDP over a subgroup is not supported)")


def _checked(cfg: Config) -> Config:
    """``cfg``, if the DDP hook can run it (constructor, load_state_dict, unpickling)."""
    if cfg.schedule not in _BUCKET_SCHEDULES:
        raise IMergeConfigError(
            f"IMerge: schedule {cfg.schedule!r} overlaps with the next forward pass, which a DDP comm hook "
            f"cannot; the DDP hook supports {', '.join(_BUCKET_SCHEDULES)}; use "
            "imerge_hooks.DistributedOptimizer or strategy='imerge' for it")
    if cfg.overlap_forward:
        raise IMergeConfigError("IMerge: overlap_forward is impossible through a DDP comm hook (DDP waits for "
                                "every bucket before step()); use imerge_hooks.DistributedOptimizer")
    if cfg.backward_passes_per_step != 1:
        raise IMergeConfigError("IMerge: backward_passes_per_step is DDP's no_sync() on the DDP hook path; "
                                "leave it at 1 there")
    return cfg


def ps_hook(state: IMergeHookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: average ``bucket`` over the workers through the parameter servers."""
    return state.push(bucket)
