"""Communication cost models: how long one message of m bytes takes.

The planner only needs ``T(m)``, monotone in m. Two models are provided:

- :class:`LinearModel` (``alpha + beta*m``), the all-reduce model MG-WFBP assumes (for the PS,
  :func:`mgwfbp_model` derives its alpha and beta from a measured table);
- :class:`PSModel`, a table measured on the real many-to-one parameter-server pattern
  (every worker pushes and pulls m bytes at once), because its startup cost grows quickly
  with the number of workers (incast) and a straight line misjudges it.

Both also offer ``time_array`` so the planner's dynamic program can evaluate many sizes at
once. ``calibrate()`` (which needs MPI) lives elsewhere; this module imports no MPI.
"""

from __future__ import annotations

import bisect
import json
import math
import os
import tempfile
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol, runtime_checkable

import numpy as np

# Smallest slope (s/byte) a fit may return, so bandwidth stays finite and JSON-safe.
_MIN_SLOPE = 1e-15


@runtime_checkable
class CostModel(Protocol):
    """Anything that can say how long one message of ``nbytes`` takes (monotone in nbytes)."""

    def time(self, nbytes: float) -> float:
        ...


def _least_squares(sizes: Sequence[float], times: Sequence[float]) -> tuple[float, float]:
    """Fit ``t = c + k*m`` by least squares with ``c >= 0`` and ``k >= 0``.

    A negative intercept is refitted through the origin (the constrained optimum); a
    negative slope becomes a flat line at the mean. Why: a cost model with negative startup
    or negative per-byte cost would make the planner believe in free messages.
    """
    x = np.asarray(sizes, dtype=float)
    y = np.asarray(times, dtype=float)
    if x.ndim != 1 or x.shape != y.shape or x.size == 0:
        raise ValueError(f"IMerge: fit needs equal-length, non-empty sizes and times, "
                         f"got {x.size} sizes and {y.size} times")
    if not (np.all(np.isfinite(x)) and np.all(np.isfinite(y))):
        raise ValueError("IMerge: fit got non-finite sizes or times")
    if x.size == 1 or np.ptp(x) == 0:
        return max(float(np.mean(y)), 0.0), 0.0
    # Relative (1/t) weights: on a log-spaced grid an unweighted fit is decided by the largest
    # messages alone and leaves the startup term, which the planner cares most about, unconstrained.
    weights = 1.0 / np.maximum(y, 1e-12) if np.all(y > 0) else None
    k, c = np.polyfit(x, y, 1, w=weights)
    if c < 0:
        c = 0.0
        denom = float(np.dot(x, x))
        k = float(np.dot(x, y)) / denom if denom > 0 else 0.0
    if k < 0:
        k, c = 0.0, max(float(np.mean(y)), 0.0)
    return float(c), float(k)


@dataclass
class LinearModel:
    """``T(m) = alpha + beta*m`` (seconds; alpha is the startup, beta seconds per byte)."""

    alpha: float
    beta: float

    def time(self, nbytes: float) -> float:
        return self.alpha + self.beta * float(nbytes)

    def time_array(self, nbytes: np.ndarray) -> np.ndarray:
        """Vectorised :meth:`time`."""
        return self.alpha + self.beta * np.asarray(nbytes, dtype=float)

    @classmethod
    def fit(cls, sizes: Sequence[float], times: Sequence[float]) -> LinearModel:
        """Least-squares fit, alpha and beta clipped to >= 0."""
        alpha, beta = _least_squares(sizes, times)
        return cls(alpha=alpha, beta=beta)

    def to_dict(self) -> dict[str, Any]:
        return {"kind": "LinearModel", "alpha": float(self.alpha), "beta": float(self.beta)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> LinearModel:
        return cls(alpha=float(d["alpha"]), beta=float(d["beta"]))


@dataclass
class PSModel:
    """Measured PS cost table for ``workers`` workers and ``servers`` servers.

    ``sizes`` (bytes, strictly increasing) and ``times`` (seconds) are the grid; the first
    ``measured`` points were measured (default: all), the rest extended along the measured
    bandwidth (:func:`extend_table`) by a calibration that ran out of its time budget.
    ``a`` (startup, s) and ``bandwidth`` (bytes/s per server) are the fit
    ``T(m) = a + W*m/(S*B)``, used only for extrapolation beyond the grid; when left as
    ``None`` they are fitted from the table.

    ``time(m)``: the table is first made monotone (running maximum, so measurement noise
    can never make a bigger message look cheaper); below the grid the first value, on the
    grid piecewise-linear interpolation, beyond it the fitted slope, continuous at the last
    point.
    """

    workers: int
    servers: int
    sizes: list[float]
    times: list[float]
    hosts: list[str] = field(default_factory=list)
    a: float | None = None
    bandwidth: float | None = None
    measured: int | None = None
    # What the table was measured on (``calibrate.cluster_fingerprint``) and when (Unix time): the cache's check
    cluster: dict[str, Any] = field(default_factory=dict)
    created: float | None = None

    def __post_init__(self) -> None:
        self.workers, self.servers = int(self.workers), int(self.servers)
        if self.workers < 1 or self.servers < 1:
            raise ValueError(f"IMerge: PSModel needs workers >= 1 and servers >= 1, "
                             f"got workers={self.workers}, servers={self.servers}")
        self.sizes = [float(s) for s in self.sizes]
        self.times = [float(t) for t in self.times]
        self.hosts = [str(h) for h in self.hosts]
        if not self.sizes or len(self.sizes) != len(self.times):
            raise ValueError(f"IMerge: PSModel needs equal-length, non-empty sizes and times, "
                             f"got {len(self.sizes)} sizes and {len(self.times)} times")
        if not all(math.isfinite(v) and v >= 0 for v in self.sizes + self.times):
            raise ValueError("IMerge: PSModel sizes and times must be finite and >= 0")
        if any(b <= a for a, b in zip(self.sizes, self.sizes[1:])):
            raise ValueError(f"IMerge: PSModel sizes must be strictly increasing, got {self.sizes}")
        self.measured = len(self.sizes) if self.measured is None else int(self.measured)
        if not 1 <= self.measured <= len(self.sizes):
            raise ValueError(f"IMerge: PSModel measured must be 1..{len(self.sizes)} (grid points), "
                             f"got {self.measured}")
        if self.a is None or self.bandwidth is None:
            a, bw = self._fit_params(self.workers, self.servers, self.sizes, self.times)
            self.a = a if self.a is None else float(self.a)
            self.bandwidth = bw if self.bandwidth is None else float(self.bandwidth)
        self.a, self.bandwidth = float(self.a), float(self.bandwidth)
        if self.a < 0 or not self.bandwidth > 0 or not math.isfinite(self.bandwidth):
            raise ValueError(f"IMerge: PSModel needs a >= 0 and finite bandwidth > 0, "
                             f"got a={self.a}, bandwidth={self.bandwidth}")
        self._x = np.asarray(self.sizes, dtype=float)
        self._y = np.maximum.accumulate(np.asarray(self.times, dtype=float))
        self._mono = self._y.tolist()
        self._slope = self.workers / (self.servers * self.bandwidth)

    @staticmethod
    def _fit_params(workers: int, servers: int, sizes: Sequence[float],
                    times: Sequence[float]) -> tuple[float, float]:
        a, k = _least_squares(sizes, times)
        k = max(k, _MIN_SLOPE)
        return a, workers / (servers * k)

    @classmethod
    def fit(cls, workers: int, servers: int, sizes: Sequence[float], times: Sequence[float],
            hosts: Sequence[str] = (), measured: int | None = None) -> PSModel:
        """Build a model from a table, fitting ``a`` (>= 0) and ``B`` (> 0) to all of it
        (``measured``: how many leading points were measured, the rest extended)."""
        a, bw = cls._fit_params(int(workers), int(servers), [float(s) for s in sizes],
                                [float(t) for t in times])
        return cls(workers=workers, servers=servers, sizes=list(sizes), times=list(times),
                   hosts=list(hosts), a=a, bandwidth=bw, measured=measured)

    def time_array(self, nbytes: np.ndarray) -> np.ndarray:
        """Vectorised :meth:`time`."""
        m = np.asarray(nbytes, dtype=float)
        out = np.interp(m, self._x, self._y)  # clamps to the end values outside the grid
        beyond = m > self._x[-1]
        if np.any(beyond):
            out = np.where(beyond, self._y[-1] + self._slope * (m - self._x[-1]), out)
        return out

    def time(self, nbytes: float) -> float:
        # Pure-Python path: the planner's simulation calls this once per group.
        m, xs, ys = float(nbytes), self.sizes, self._mono
        if m <= xs[0]:
            return ys[0]
        if m >= xs[-1]:
            return ys[-1] + self._slope * (m - xs[-1])
        k = bisect.bisect_right(xs, m)
        x0, x1, y0, y1 = xs[k - 1], xs[k], ys[k - 1], ys[k]
        return y0 + (y1 - y0) * (m - x0) / (x1 - x0)

    def describe(self) -> str:
        """One line for logs: startup, per-server bandwidth, W, S and the grid."""
        extended = (f", measured up to {self.sizes[self.measured - 1]:.0f} B, extended beyond"
                    if self.measured < len(self.sizes) else "")
        return (f"PSModel W={self.workers} S={self.servers}: a={self.a * 1e6:.1f} us, "
                f"B={self.bandwidth / 1e6:.1f} MB/s per server, "
                f"grid {self.sizes[0]:.0f}..{self.sizes[-1]:.0f} B ({len(self.sizes)} points{extended})")

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["kind"] = "PSModel"
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> PSModel:
        return cls(workers=d["workers"], servers=d["servers"], sizes=list(d["sizes"]),
                   times=list(d["times"]), hosts=list(d.get("hosts", [])),
                   a=d.get("a"), bandwidth=d.get("bandwidth"), measured=d.get("measured"),
                   cluster=dict(d.get("cluster") or {}), created=d.get("created"))

    def to_json(self, path: str | os.PathLike[str]) -> None:
        """Write atomically (temp file + rename): several ranks may share one cache path."""
        path = os.fspath(path)
        directory = os.path.dirname(path) or "."
        os.makedirs(directory, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".psmodel-", suffix=".json", dir=directory)
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(self.to_dict(), f, indent=1)
            os.replace(tmp, path)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise

    @classmethod
    def from_json(cls, path: str | os.PathLike[str]) -> PSModel:
        with open(path) as f:
            return cls.from_dict(json.load(f))


def extension_slope(sizes: Sequence[float], times: Sequence[float]) -> float:
    """Seconds per byte to extend a measured table (sizes increasing) beyond its last point.

    On the running maximum of the times (as :class:`PSModel` reads them): the larger of the
    last two points' slope and the chord from the first point to the last, so one low last
    sample cannot make the bytes look free (for an exact line ``c + k*m`` both are ``k``).
    One point: proportional to size (``t/m``, an upper bound for any line with ``c >= 0``).
    """
    if not sizes or len(sizes) != len(times):
        raise ValueError(f"IMerge: extension needs equal-length, non-empty sizes and times, "
                         f"got {len(sizes)} sizes and {len(times)} times")
    y = np.maximum.accumulate(np.asarray(times, dtype=float))
    x = np.asarray(sizes, dtype=float)
    if len(x) == 1:
        return float(y[0] / x[0]) if x[0] > 0 else 0.0
    last = (y[-1] - y[-2]) / (x[-1] - x[-2])
    chord = (y[-1] - y[0]) / (x[-1] - x[0])
    return float(max(last, chord, 0.0))


def extend_table(sizes: Sequence[float], times: Sequence[float], grid: Sequence[float]) -> list[float]:
    """Times on ``grid``: the measured ``times`` where ``sizes`` (a prefix of ``grid``) has them,
    beyond them the last measured time plus :func:`extension_slope` per byte.

    Why: a calibration stopped by its time budget has measured up to where the bytes already
    dominate the startup, so the rest of the table lies on that line; extending it there (and
    fitting ``a + W*m/(S*B)`` to the whole grid) gives the planner the model a full
    calibration would, without the seconds the largest messages take on a slow link.
    """
    n = len(sizes)
    if n == 0 or n > len(grid) or any(float(a) != float(b) for a, b in zip(sizes, grid)):
        raise ValueError(f"IMerge: measured sizes must be a non-empty prefix of the grid, got {list(sizes)} "
                         f"for grid {list(grid)}")
    slope = extension_slope(sizes, times)
    top, t_top = float(sizes[-1]), float(max(times))
    return [float(t) for t in times] + [t_top + slope * (float(m) - top) for m in grid[n:]]


def mgwfbp_model(model: PSModel) -> LinearModel:
    """MG-WFBP's ``alpha + beta*m`` for the PS, from a measured table: ``alpha = a/S``,
    ``beta = W/(2*S*B)`` (half the table's slope).

    MG-WFBP (Shi, Chu, Li, INFOCOM 2019; reference code HKBU-HPML/MG-WFBP) times one all-reduce
    of each size alone, one after another (``CommunicationProfiler``: op, then sync), fits
    ``alpha + beta*m`` and runs its merge rule on one channel that carries one message at a
    time: a message starts when its gradients are ready and the previous message has ended, and
    lasts ``alpha + beta*m``; merging two messages saves ``alpha``. For an all-reduce the time
    of one message alone is also how long it holds the channel, so the isolated times are that
    model. For the PS they are not, and the line fitted to the table (``alpha = a``, ``beta`` =
    its slope) misreads both terms:

    * ``a`` is W pushes in a row at one server: the calibration gives every server one key and
      each server works W startups for it, all servers at once. A job's groups go one per server
      (the least loaded; large ones spread over all), so the S servers work on different groups
      in parallel and one group more costs ``a/S`` of the critical path (the server's per-push
      startup times W/S). That is what merging two groups saves when startups are the bound.
    * the slope counts every byte twice: a round trip pushes m bytes and then receives m bytes,
      in opposite directions of the busiest full-duplex link. Groups in a row overlap one's
      result with the next one's push, so a group holds the channel for the next one half the
      slope per byte (the link's own rate, as ``ClusterSpec.from_psmodel`` reads the table).

    Both come from the fit ``a + W*m/(S*B)`` that :class:`PSModel` keeps, so the engine (its
    measured table) and the simulator (``calibrate_model``) derive the same line.
    """
    return LinearModel(alpha=model.a / model.servers,
                       beta=model.workers / (2.0 * model.servers * model.bandwidth))


def planner_model(method: str, model: CostModel) -> CostModel:
    """The model a planner method judges plans on: for ``mgwfbp`` on a measured PS table, the
    alpha-beta line its rule assumes (:func:`mgwfbp_model`); every other method the model itself."""
    if method == "mgwfbp" and isinstance(model, PSModel):
        return mgwfbp_model(model)
    return model

