"""What is simulated: a model's layers and tensors (``LayerSpec``, ``ModelSpec``) and a cluster's
ranks, hosts and links (``ClusterSpec``)."""

from __future__ import annotations

import dataclasses
import json
import math
import numbers
import os
from collections.abc import Sequence
from dataclasses import dataclass

from ..core.layout import link_bytes
from ..plan.costmodel import PSModel

# Sizes that calibrate_model "measures" (the grid of imerge_hooks.plan.calibrate: 1 KiB .. 64 MiB).
EVENT_KINDS = ("forward", "backward", "push", "pull", "wait", "update")

# Events closer than this (seconds) count as simultaneous: they are handled as one batch before
# flow rates are recomputed (symmetric workers make many events coincide).
_EPS_T = 1e-12
# A cluster of more than FOLD_ABOVE alike workers is simulated through at least FOLD_WORKERS that stand
# for all (fold_factor).
FOLD_WORKERS = 4
FOLD_ABOVE = 16
# With stagger, where no fold leaves a multiple of S workers, the approximate fold over servers too
# (run.server_orbits) keeps at least this many workers (the finer its orbits, the closer it comes).
FOLD_ORBIT_WORKERS = 16
# A cluster of more than FOLD_ABOVE workers on alike hosts (run.host_fold) is simulated through at least
# this many hosts.
FOLD_HOSTS = 8


# ---------------------------------------------------------------------------------- specs
@dataclass
class LayerSpec:
    """One layer: its parameter tensors' sizes (bytes, registration order) and compute times (s)."""

    name: str
    param_bytes: list[int]
    forward_s: float
    backward_s: float


@dataclass
class ModelSpec:
    """A model as the simulator sees it: layers in forward (registration) order."""

    layers: list[LayerSpec]
    batch_size: int
    name: str = "model"

    @classmethod
    def from_profile_json(cls, path: str | os.PathLike[str]) -> ModelSpec:
        """Read a profile of ``benchmarks/make_profiles.py``::

            {"model": str, "device": str, "batch_size": int,
             "layers": [{"name": ..., "forward_s": ..., "backward_s": ...,
                         "params": [{"name": ..., "shape": [...], "bytes": int}]}]}

        Other top-level keys are ignored.
        """
        path = os.fspath(path)
        try:
            with open(path) as f:
                data = json.load(f)
        except json.JSONDecodeError as exc:
            raise ValueError(f"IMerge simulate: {path} is not valid JSON: {exc}") from None
        if not isinstance(data, dict) or not isinstance(data.get("layers"), list):
            raise ValueError(f"IMerge simulate: {path} is not a profile (no 'layers' list)")
        layers = []
        for i, layer in enumerate(data["layers"]):
            try:
                layers.append(LayerSpec(name=str(layer["name"]),
                                        param_bytes=[int(p["bytes"]) for p in layer.get("params", [])],
                                        forward_s=float(layer["forward_s"]),
                                        backward_s=float(layer["backward_s"])))
            except (KeyError, TypeError, ValueError, AttributeError) as exc:
                name = layer.get("name", "?") if isinstance(layer, dict) else layer
                raise ValueError(f"IMerge simulate: {path}: layer {i} ({name!r}) is malformed: "
                                 f"missing or bad {exc}") from None
        if "batch_size" not in data:
            raise ValueError(f"IMerge simulate: {path}: profile has no 'batch_size'")
        spec = cls(layers=layers, batch_size=int(data["batch_size"]),
                   name=str(data.get("model", os.path.splitext(os.path.basename(path))[0])))
        spec.check()
        return spec

    @property
    def tensor_bytes(self) -> list[int]:
        """Bytes of every tensor, in registration order (layer by layer)."""
        return [b for layer in self.layers for b in layer.param_bytes]

    @property
    def total_bytes(self) -> int:
        return sum(self.tensor_bytes)

    def check(self) -> None:
        """Raise ValueError (naming the layer) for an unusable spec."""
        if not self.layers:
            raise ValueError(f"IMerge simulate: model {self.name!r} has no layers")
        bs = self.batch_size
        if isinstance(bs, bool) or not isinstance(bs, numbers.Integral) or bs < 1:
            raise ValueError(f"IMerge simulate: batch_size must be an int >= 1, got {self.batch_size!r}")
        for i, layer in enumerate(self.layers):
            where = f"IMerge simulate: model {self.name!r} layer {i} ({layer.name!r})"
            for what in ("forward_s", "backward_s"):
                v = getattr(layer, what)
                if isinstance(v, bool) or not isinstance(v, numbers.Real) or not (math.isfinite(v) and v >= 0):
                    raise ValueError(f"{where}: {what} must be a finite number >= 0, got {v!r}")
            for b in layer.param_bytes:
                if isinstance(b, bool) or not isinstance(b, numbers.Integral) or b < 0:
                    raise ValueError(f"{where}: param_bytes must be ints >= 0, got {layer.param_bytes!r}")


@dataclass(frozen=True)
class ClusterSpec:
    """W workers and S servers, one NIC each.

    ``bandwidth_Bps``: bytes/s of every host's NIC, in each direction. ``startup_s``: the
    server's serial work per push message (see the module doc); a PSModel's startup ``a``
    measured with W workers is about ``W * startup_s``, so build the spec from a measured
    model with :meth:`from_psmodel`. ``time_scale``: factor on the model's compute times
    (replay a profile as a faster or slower device). ``fabric_Bps``: optional cap on the sum of
    all flows' rates, a link every flow crosses. None: the links alone; set it to what the
    cluster moves with every link busy both ways (``benchmarks/netlab/duplex_probe.py`` measures
    it, a little less than the links' TCP goodput; ``netlab/fabric_scaling.py`` at several link
    rates). ``share_cv``/``share_period_s``: how
    unevenly pushes into one server share its ingress, and for how long a share persists (0: max-min
    fair; the module doc has the model; ``benchmarks/netlab/linkmon.py`` measures both).
    ``worker_message_s``: wall time of a worker's comm thread per message (posting a push, or
    handling a result), one message at a time per worker; 0 (the default): free. A what-if knob:
    a serial per-message cost is hidden behind the network until it fills the thread, and then the
    iteration grows abruptly, so it cannot explain a gradual cost of many keys on an oversubscribed
    host (``tests/test_simulate.py``, ``test_worker_message_cost_*``, checks both by hand).
    """

    workers: int
    servers: int
    bandwidth_Bps: float
    startup_s: float
    time_scale: float = 1.0
    fabric_Bps: float | None = None
    share_cv: float = 0.0
    share_period_s: float = 1.0
    share_seed: int = 0
    worker_message_s: float = 0.0
    hosts: tuple[int, ...] | None = None
    host_aggregation: bool = True
    local_Bps: float = 2e9
    reduce_Bps: float = 2e9

    def __post_init__(self) -> None:
        for what in ("workers", "servers"):
            v = getattr(self, what)
            if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < 1:
                raise ValueError(f"IMerge simulate: ClusterSpec.{what} must be an int >= 1, got {v!r}")
            object.__setattr__(self, what, int(v))
        for what, positive in (("bandwidth_Bps", True), ("startup_s", False), ("time_scale", True),
                               ("share_cv", False), ("share_period_s", True), ("worker_message_s", False)):
            v = getattr(self, what)
            ok = (not isinstance(v, bool) and isinstance(v, numbers.Real) and math.isfinite(v)
                  and (v > 0 if positive else v >= 0))
            if not ok:
                raise ValueError(f"IMerge simulate: ClusterSpec.{what} must be a finite number "
                                 f"{'> 0' if positive else '>= 0'}, got {v!r}")
        v = self.fabric_Bps
        if v is not None and (isinstance(v, bool) or not isinstance(v, numbers.Real) or not math.isfinite(v)
                              or v <= 0):
            raise ValueError(f"IMerge simulate: ClusterSpec.fabric_Bps must be None or a finite number > 0, got {v!r}")
        for what in ("local_Bps", "reduce_Bps"):
            v = getattr(self, what)
            if isinstance(v, bool) or not isinstance(v, numbers.Real) or not math.isfinite(v) or v <= 0:
                raise ValueError(f"IMerge simulate: ClusterSpec.{what} must be a finite number > 0, got {v!r}")
        if self.hosts is not None:
            hosts = tuple(self.hosts)
            if len(hosts) != self.workers + self.servers or any(
                    isinstance(h, bool) or not isinstance(h, numbers.Integral) or h < 0 for h in hosts):
                raise ValueError(f"IMerge simulate: ClusterSpec.hosts must give a host index >= 0 to each of the "
                                 f"{self.workers + self.servers} ranks (workers, then servers), got {self.hosts!r}")
            object.__setattr__(self, "hosts", tuple(int(h) for h in hosts))

    @property
    def rank_hosts(self) -> tuple[int, ...]:
        """The host of every rank (workers, then servers): ``hosts``, or one host per rank."""
        return self.hosts if self.hosts is not None else tuple(range(self.workers + self.servers))

    @property
    def aggregates(self) -> bool:
        """Whether the workers of a host sum each key before one of them pushes it (as the runtime)."""
        hosts = self.rank_hosts[:self.workers]
        return self.host_aggregation and len(set(hosts)) < len(hosts)

    def busiest_link_share(self) -> float:
        """Bytes on the busiest host link, each way, when every worker pushes m bytes spread evenly over
        the servers, per byte of m (``layout.link_bytes``): what the calibration's transfers are bound by."""
        return max(link_bytes(self.rank_hosts, self.workers, 1.0, self.aggregates))

    @classmethod
    def from_psmodel(cls, model: PSModel, time_scale: float = 1.0, workers: int | None = None,
                     servers: int | None = None, hosts: Sequence[int] | None = None,
                     host_aggregation: bool = True) -> ClusterSpec:
        """The cluster whose :func:`calibrate_model` gives ``model``'s fit (``a``, ``bandwidth``);
        ``workers``/``servers``: the same links and startup for another job size (default: the model's).

        In the simulator the calibration pattern costs ``T(m) = W*startup + 2*max(W/S, 1)*m/B``
        (W serial startups; push then result, each limited by the busier side), so
        ``startup_s = a / W`` and ``bandwidth_Bps = 2 * bandwidth * max(1, S/W)``. For a table
        measured on a real cluster this is the simulator's best reading of it. ``hosts`` (a host index
        per rank): the model was measured on that layout, where the busiest host link carries
        ``busiest_link_share`` of each worker's bytes rather than ``max(W/S, 1)``; the link rate is
        read accordingly.
        """
        w = model.workers if workers is None else workers
        s = model.servers if servers is None else servers
        flat = cls(workers=w, servers=s, bandwidth_Bps=2.0 * model.bandwidth * max(1.0, s / w),
                   startup_s=model.a / w, time_scale=time_scale)
        if hosts is None:
            return flat
        placed = dataclasses.replace(flat, hosts=tuple(hosts), host_aggregation=host_aggregation)
        if placed.busiest_link_share() == 0:  # one host: no link; the flat reading of the model stands
            return flat
        pushers = len(set(placed.rank_hosts[:w])) if placed.aggregates else w
        return dataclasses.replace(placed, bandwidth_Bps=flat.bandwidth_Bps * placed.busiest_link_share()
                                   / max(w / s, 1.0), startup_s=model.a / pushers)
