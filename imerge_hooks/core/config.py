"""One place for every IMerge knob: keyword arguments override ``IMERGE_*`` env vars."""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass, field
from typing import Any

# Options of the whole process, set by imerge_hooks.init() (or IMERGE_* env vars); every other
# option belongs to one engine (DistributedOptimizer, IMergeHookState, IMergeStrategy's optimizers).
PROCESS_OPTIONS = frozenset({"num_servers", "timeout_s", "stall_warning_s", "polling", "cost_model_path",
                             "calibrate", "timeline", "debug_delay_per_mb_s", "host_aggregation",
                             "servers_per_host", "share_gpus", "cuda_aware_mpi", "master_interface",
                             "torch_store"})
SCHEDULES = ("default", "wfbp", "priority", "threshold", "mgwfbp", "adaptive-ps", "imerge")


@dataclass(frozen=True)
class ScheduleTraits:
    """What a schedule name switches on (see docs/architecture.md, "Schedules")."""

    planner: str  # none | threshold | mgwfbp | optimal
    push_after_backward: bool  # `default`: nothing leaves before synchronize()
    partition: bool  # cut groups into partitions of <= partition_bytes
    priority: bool  # front layers first, preempting at partition granularity
    stagger: bool  # worker r starts each group's partition sequence at server r % S
    overlap_forward: bool  # defer the update into the next forward pass

    @property
    def tail_credit(self) -> bool:
        """Planned, partitioned, prioritised (imerge): the plan's last group is urgent (schedule)."""
        return self.planner != "none" and self.partition and self.priority


SCHEDULE_TRAITS: dict[str, ScheduleTraits] = {
    "default": ScheduleTraits("none", True, False, False, False, False),
    "wfbp": ScheduleTraits("none", False, False, False, False, False),
    "priority": ScheduleTraits("none", False, True, True, False, False),
    "threshold": ScheduleTraits("threshold", False, False, False, False, False),
    "mgwfbp": ScheduleTraits("mgwfbp", False, False, False, False, False),
    "adaptive-ps": ScheduleTraits("optimal", False, False, False, False, False),
    "imerge": ScheduleTraits("optimal", False, True, True, True, True),
}

_MiB = 1 << 20
# Defaults shared by Config, the planner and the simulator.
PARTITION_BYTES = 4 * _MiB
CREDIT_BYTES = 8 * _MiB  # A/B of other sizes: benchmarks/run.py --alternate credit_bytes=...
FUSION_THRESHOLD_BYTES = 25 * _MiB
TAIL_CREDIT_BYTES: int | None = 1 * _MiB  # the default of Config.tail_credit_bytes (and simulate)


class InvalidOption(ValueError):
    """A setting's value is out of its range; ``option`` names the setting."""

    def __init__(self, option: str, message: str) -> None:
        super().__init__(message)
        self.option = option


@dataclass
class Config:
    """Every IMerge setting. Each field ``x`` can also be set with env var ``IMERGE_X``."""

    num_servers: int | None = None
    schedule: str = "imerge"
    backward_passes_per_step: int = 1
    partition_bytes: int = PARTITION_BYTES
    credit_bytes: int = CREDIT_BYTES
    fusion_threshold_bytes: int = FUSION_THRESHOLD_BYTES
    # Partitioned, planned schedules (imerge): while the next forward's first gradients are due,
    # other keys in flight are held to this (schedule, "tail credit"). None: off.
    tail_credit_bytes: int | None = TAIL_CREDIT_BYTES
    profile_steps: int = 10
    overlap_forward: bool | None = None  # None: as the schedule says
    timeout_s: float = 600.0
    stall_warning_s: float = 60.0
    plan_log: bool = False
    cost_model_path: str = field(default_factory=lambda: os.path.join(
        os.path.expanduser("~"), ".cache", "imerge", "psmodel-{workers}w-{servers}s-{hosts}.json"))
    calibrate: bool = True  # measure a PS model at start-up when none is cached
    timeline: str | None = None
    compression: str = "none"  # none | fp16 | bf16
    plan_search: bool = True  # optimal planner: score candidate plans with the simulator (plan/search.py)
    # Worker 0's CPU seconds for the plan search before training goes on with the DP's plan and the
    # search finishes in a background process, installed as a later plan epoch (plan/background.py).
    # None: search in the foreground to the end.
    plan_search_budget_s: float | None = 2.0
    plan_cache: bool = True  # keep chosen plans beside the cost-model cache and reuse them (plan/cache.py)
    polling: str = "auto"  # auto | spin | yield: how idle comm threads and servers wait (see polling.py)
    # While workers have joined (imerge_hooks.join()): "workers" divides every sum by the number of
    # workers (their missing pushes count as zeros: Horovod, DDP's Join), "active" by those that pushed.
    join_divisor: str = "workers"
    # Where a host holds several workers, they sum each key inside the host and one of them pushes the
    # host's sum (BytePS's design): the host link carries the gradient once each way, not once per worker.
    host_aggregation: bool = True
    # init() refuses a launch that puts more servers than this on one host (None: no limit; 1: one each)
    servers_per_host: int | None = None
    # init() refuses a host with more workers than GPUs (where it has GPUs) unless sharing is intended
    share_gpus: bool = False
    # Device buffers go to MPI directly where the MPI is CUDA-aware (None: ask the library,
    # MPIX_Query_cuda_support; False: always stage through pinned host memory)
    cuda_aware_mpi: bool | None = None
    # The interface whose address is the workers' torch.distributed rendezvous when workers span hosts
    # (as GLOO_SOCKET_IFNAME; MASTER_ADDR overrides it). None: worker 0's first address every other host
    # reaches and no other host holds (rendezvous.choose_address).
    master_interface: str | None = None
    # Worker 0 serves the workers' torch.distributed store (an unauthenticated TCPStore on the rendezvous
    # address) and torchrun's variables are set, for DDP, Lightning and torchrun-style scripts. False: no
    # store is opened; a script that uses torch.distributed initialises it itself.
    torch_store: bool = True
    # For tests: engines record (event, module, time, detail) of the overlap in ``engine.events``;
    # servers hold every result this many seconds per MB (not calibration keys) before sending it.
    record_events: bool = False
    debug_delay_per_mb_s: float = 0.0

    def __post_init__(self) -> None:
        if not isinstance(self.compression, str):  # Compression.fp16 (a compressor class): its name
            self.compression = getattr(self.compression, "name", self.compression)
        for name, field_type in _FIELD_TYPES.items():  # numbers: finite (nan and inf pass every comparison below)
            value = getattr(self, name)
            if str(field_type).startswith(("int", "float")) and value is not None and not _finite_number(value):
                raise InvalidOption(name, f"IMerge: {name} must be a finite number, got {value!r}")
        if self.schedule not in SCHEDULES:
            raise InvalidOption("schedule", f"IMerge: unknown schedule {self.schedule!r}; choose one of "
                                f"{', '.join(SCHEDULES)}")
        if self.backward_passes_per_step < 1:
            raise InvalidOption("backward_passes_per_step", "IMerge: backward_passes_per_step must be >= 1, "
                                f"got {self.backward_passes_per_step}")
        for name in ("partition_bytes", "credit_bytes", "fusion_threshold_bytes"):
            if getattr(self, name) <= 0:
                raise InvalidOption(name, f"IMerge: {name} must be positive, got {getattr(self, name)}")
        if self.tail_credit_bytes is not None and self.tail_credit_bytes <= 0:
            raise InvalidOption("tail_credit_bytes", "IMerge: tail_credit_bytes must be positive or None (off), "
                                f"got {self.tail_credit_bytes}")
        if self.timeout_s <= 0:
            raise InvalidOption("timeout_s", f"IMerge: timeout_s must be positive, got {self.timeout_s}")
        if self.plan_search_budget_s is not None and self.plan_search_budget_s < 0:
            raise InvalidOption("plan_search_budget_s", "IMerge: plan_search_budget_s must be >= 0 or None, got "
                                f"{self.plan_search_budget_s}")
        if self.polling not in ("auto", "spin", "yield"):
            raise InvalidOption("polling", f"IMerge: polling must be auto, spin or yield, got {self.polling!r}")
        if self.join_divisor not in ("workers", "active"):
            raise InvalidOption("join_divisor", "IMerge: join_divisor must be workers or active, got "
                                f"{self.join_divisor!r}")
        if self.servers_per_host is not None and self.servers_per_host < 1:
            raise InvalidOption("servers_per_host", "IMerge: servers_per_host must be >= 1 or None, got "
                                f"{self.servers_per_host}")
        if self.compression not in ("none", "fp16", "bf16"):
            raise InvalidOption("compression", "IMerge: compression must be none, fp16 or bf16, got "
                                f"{self.compression!r}")

    @property
    def traits(self) -> ScheduleTraits:
        return SCHEDULE_TRAITS[self.schedule]

    @property
    def overlap(self) -> bool:
        return self.traits.overlap_forward if self.overlap_forward is None else bool(self.overlap_forward)

    @classmethod
    def from_env(cls, base: Config | None = None, **overrides: Any) -> Config:
        """Build a Config: ``overrides`` > ``IMERGE_*`` env vars > ``base`` > defaults."""
        values: dict[str, Any] = dataclasses.asdict(base) if base is not None else {}
        overrides = given(overrides)
        known = {f.name: f for f in dataclasses.fields(cls)}
        for name in known:
            env = os.environ.get("IMERGE_" + name.upper())
            if env is not None and name not in overrides:
                values[name] = _env_value(name, env, known[name].type)
        for name, value in overrides.items():
            if name not in known:
                raise TypeError(f"IMerge: unknown config option {name!r}; known options: {', '.join(sorted(known))}")
            values[name] = value
        try:
            return cls(**values)
        except InvalidOption as exc:  # name the env var the value came from
            env = f"IMERGE_{exc.option.upper()}"
            if exc.option in overrides or env not in os.environ:
                raise
            raise InvalidOption(exc.option, f"{exc} (from env var {env}={os.environ[env]!r})") from None

    def replace(self, **changes: Any) -> Config:
        return dataclasses.replace(self, **changes)


def _finite_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)


def optional(name: str) -> bool:
    """Whether None is a value of option ``name`` (off, no limit, to the end, as the schedule says)."""
    field_type = _FIELD_TYPES.get(name)
    return field_type is not None and "None" in str(field_type)


def given(options: dict[str, Any]) -> dict[str, Any]:
    """The options a caller gave. None where an option cannot be None is a front end's "not given"
    (``schedule=None``); where it can, a keyword None means what it says (``tail_credit_bytes=None``:
    off; ``plan_search_budget_s=None``: search to the end). Unknown names stay, to be refused."""
    return {k: v for k, v in options.items() if v is not None or optional(k) or k not in _FIELD_TYPES}


def _env_value(name: str, text: str, type_name: Any) -> Any:
    try:
        return parse_value(text, type_name)
    except ValueError:
        raise ValueError(f"IMerge: env var IMERGE_{name.upper()}={text!r} is not a valid {type_name}") from None


def parse_value(text: str, type_name: Any) -> Any:
    """``text`` as a value of the annotated type ``type_name`` (e.g. ``"bool"``, ``"int | None"``):
    bools from 1/true/yes/on and 0/false/no/off, ``none`` or empty for an optional; ValueError else."""
    type_text = str(type_name)
    if "bool" in type_text:
        low = text.strip().lower()
        if low in ("", "none") and "None" in type_text:
            return None
        if low in ("1", "true", "yes", "on"):
            return True
        if low in ("0", "false", "no", "off"):
            return False
        raise ValueError(text)
    if type_text.startswith("int"):
        return None if text.strip().lower() in ("", "none") and "None" in type_text else int(text)
    if type_text.startswith("float"):
        return None if text.strip().lower() in ("", "none") and "None" in type_text else float(text)
    return text


_FIELD_TYPES = {f.name: f.type for f in dataclasses.fields(Config)}
