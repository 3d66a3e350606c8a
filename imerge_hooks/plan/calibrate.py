"""Measure the PS cost model on the real many-to-one pattern (collective over workers).

Every worker pushes and pulls m bytes at the same time (the m bytes cut into one key per
server), for m on a log-spaced grid; the time of a size is the slowest worker's median.
``python -m imerge_hooks.plan.calibrate`` runs it under mpiexec, measures the whole grid and
prints the table. The calibration a job runs at start-up when nothing is cached
(:func:`load_or_calibrate`) has a time budget (:data:`STARTUP_BUDGET_S`): on a slow link the
largest sizes alone take tens of seconds, so it stops once the bytes dominate the startup and
the next size would overrun the budget, and extends the table along the measured bandwidth
(``costmodel.extend_table``).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import logging
import math
import os
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..cluster import collectives, session, startup
from ..core import polling
from ..core.layout import CALIBRATION_GRID, calibration_keys
from ..core.wire import KeySpec
from ..worker import key_table
from ..worker.group import Group
from ..worker.schedule import SchedulePolicy
from .cache_files import integer, is_number, number, read_checked, record, require
from .costmodel import PSModel, extend_table

log = logging.getLogger("imerge")

DEFAULT_GRID = list(CALIBRATION_GRID)
# Seconds the start-up calibration aims to spend measuring (a target: it never stops before the bytes
# dominate, see measure_grid); with the set-up around it a job's first run pays well under 5 s.
STARTUP_BUDGET_S = 3.0
# Once the table is bandwidth-bound, a size whose round trip is expected to take longer gets fewer
# repeats (at least 2): its time is steady, and on a slow link every repeat costs seconds.
SAMPLE_TARGET_S = 0.25
BANDWIDTH_BOUND = 8.0  # see _bandwidth_bound
# With a budget, no size takes more than its share of what is left (a loaded machine makes every sample
# and barrier slow), but none gets fewer than this many samples for its median.
MIN_SHARED_REPEATS = 3


def _repeats(nbytes: int, predicted_s: float = 0.0) -> int:
    """Timed samples of one size: by size, and fewer when one is expected to take a while."""
    base = 12 if nbytes <= 256 * 1024 else 5 if nbytes <= 4 << 20 else 3 if nbytes <= 16 << 20 else 2
    return max(2, min(base, int(SAMPLE_TARGET_S / predicted_s))) if predicted_s > 0 else base


def _bandwidth_bound(times: Sequence[float]) -> bool:
    """Whether the bytes dominate: the largest time is at least BANDWIDTH_BOUND times the first.

    Below that the table is still bending from the startup into the line (measured on 250 Mbit/s
    links, extending from there misjudged the largest sizes by 40-55%, from 8x on by 1-6%).
    """
    return len(times) >= 2 and max(times) >= BANDWIDTH_BOUND * times[0]


# sample(index, repeats) -> (time of that size, seconds spent so far, seconds per sample beyond that time:
# its barrier and the samples' spread), the same on every worker.
Sampler = Callable[[int, int], tuple[float, float, float]]


def measure_grid(sizes: Sequence[int], sample: Sampler, budget_s: float | None = None) -> list[float]:
    """Times of the leading ``sizes`` that fit ``budget_s`` (None: all), measured by ``sample``.

    Sizes go in increasing order. Before a size, its time is predicted as the largest so far
    scaled by the size ratio (an upper bound while T(m) is a line with a startup >= 0). Once the
    table is bandwidth-bound (:func:`_bandwidth_bound`), that prediction sets the repeats
    (:func:`_repeats`). With a budget, a size's samples are also held to its share of the budget
    left (at least MIN_SHARED_REPEATS of them), and once bandwidth-bound a size whose warm-up and
    samples would end past ``budget_s`` is not measured, nor any after it: the table is never cut
    before the bytes dominate, so ``budget_s`` is a target, not a limit. Decisions use only the
    values ``sample`` returns, so every worker takes the same ones (``sample`` must agree them).
    """
    times: list[float] = []
    spent = overhead = 0.0
    for index, nbytes in enumerate(sizes):
        bound = _bandwidth_bound(times)
        predicted = max(times) * nbytes / sizes[index - 1] if times else 0.0
        repeats = _repeats(nbytes, predicted if bound else 0.0)
        if budget_s is not None and times:
            per_sample = (predicted if bound else times[-1]) + overhead
            share = (budget_s - spent) / (len(sizes) - index)
            if per_sample > 0:
                repeats = min(repeats, max(MIN_SHARED_REPEATS, int(share / per_sample)))
            if bound and spent + (repeats + 1) * predicted + repeats * overhead > budget_s:
                break
        t, spent, overhead = sample(index, repeats)
        times.append(t)
    return times


def measure(sizes: list[int] | None = None, budget_s: float | None = None) -> PSModel:
    """Measure T(m) for this job's W workers and S servers; returns a fitted PSModel.

    ``budget_s``: stop early as :func:`measure_grid` says and extend the table to the whole grid.
    """
    topo = session.topology()
    comm = session.comm_thread()
    if comm is None:
        raise RuntimeError("IMerge: calibration needs at least one server")
    sizes = sorted(sizes or DEFAULT_GRID)
    client = session.new_client_id()
    cuts, keys = [], []
    for nbytes in sizes:
        cut = calibration_keys(nbytes, topo.num_servers)
        ids = key_table.allocate_keys(len(cut))
        gkeys = [KeySpec(k, (e - s) * 4, "float32", server, (f"calibration.{nbytes}",))
                 for k, (s, e, server) in zip(ids, cut)]
        keys += gkeys
        cuts.append((cut, gkeys))
    groups: dict[int, Group] = {}

    def group(index: int) -> Group:  # allocated when first sent: a budgeted run may never send the largest
        if index not in groups:
            numel = max(1, sizes[index] // 4)
            cut, gkeys = cuts[index]
            groups[index] = Group(index=index, flat=torch.ones(numel), result=torch.empty(numel), keys=gkeys,
                                  key_ranges=[(s, e) for s, e, _ in cut], priority=0,
                                  names=(f"calibration.{sizes[index]}",))
        return groups[index]

    policy = SchedulePolicy()
    start = time.perf_counter()

    def round_trip(index: int) -> None:
        comm.submit(group(index), policy)
        comm.wait(group(index), "during calibration ")

    def sample(index: int, repeats: int) -> tuple[float, float, float]:
        round_trip(index)  # warm-up
        samples = []
        first = time.perf_counter()
        for _ in range(repeats):
            # Spin while waiting (as MPI's Barrier does), so the workers start their samples together.
            collectives.collective(topo.worker_comm, "barrier", None, "the calibration barrier",
                                   spin_s=polling.SPIN_S_DEDICATED)
            begin = time.perf_counter()
            round_trip(index)
            samples.append(time.perf_counter() - begin)
        now = time.perf_counter()
        median = statistics.median(samples)
        mine = (median, now - start, max(0.0, (now - first) / repeats - median))
        rows = collectives.collective(topo.worker_comm, "allgather", mine,
                                      f"the calibration times of {sizes[index]} bytes")
        return max(r[0] for r in rows), max(r[1] for r in rows), max(r[2] for r in rows)

    key_table.register_keys(client, keys)
    try:
        for index in range(max(1, len(sizes) // 2)):  # warm up connections and buffers once
            round_trip(index)
        times = measure_grid(sizes, sample, budget_s)
    finally:
        key_table.register_keys(client, [])
        groups.clear()
    return PSModel.fit(topo.num_workers, topo.num_servers, sizes, extend_table(sizes[:len(times)], times, sizes),
                       hosts=topo.worker_hosts, measured=len(times))


# A cached model older than this is measured again: links, firmware and neighbours change.
CACHE_MAX_AGE_DAYS = 30.0
# How far a cached model's time of measurement may lie ahead of this host's clock (hosts that share a
# cache folder disagree a little); further ahead its age is unknown, and the model is measured again.
CLOCK_SKEW_S = 300.0
# Environment prefixes that choose or tune the MPI transport: a cached model measured under others
# describes another network path.
TRANSPORT_ENV = ("MPIR_CVAR_", "FI_", "UCX_", "OMPI_MCA_", "I_MPI_", "PSM2_", "MV2_")


def cluster_fingerprint() -> dict[str, Any]:
    """What a measured PS model depends on: W, S, every rank's host (servers' too, in rank order),
    host aggregation, the MPI library, the transport settings of the environment and IMerge's
    version. Worker 0's view (the cache is worker 0's)."""
    from .. import __version__
    from ..core._mpi import MPI

    topo = session.topology()
    return {"workers": topo.num_workers, "servers": topo.num_servers, "hosts": list(topo.hosts),
            "aggregate": bool(topo.aggregate_in_host), "mpi": MPI.Get_library_version().strip().splitlines()[0],
            "transport": {k: v for k, v in sorted(os.environ.items()) if k.startswith(TRANSPORT_ENV)},
            "imerge": __version__}


def cache_path(template: str, fingerprint: dict[str, Any]) -> str:
    """The cost-model cache file for this cluster: ``{hosts}`` in the template is a digest of the
    whole fingerprint (the name kept for existing templates)."""
    digest = hashlib.sha1(json.dumps(fingerprint, sort_keys=True).encode()).hexdigest()[:10]
    return os.path.expanduser(template.format(workers=fingerprint["workers"], servers=fingerprint["servers"],
                                              hosts=digest))


def cache_problem(model: PSModel, fingerprint: dict[str, Any], now: float) -> str | None:
    """Why a cached model must not be used for this cluster, or None if it may."""
    if (model.workers, model.servers) != (fingerprint["workers"], fingerprint["servers"]):
        return (f"it was measured with {model.workers} workers and {model.servers} servers, this job has "
                f"{fingerprint['workers']} and {fingerprint['servers']}")
    if not model.cluster:
        return "it does not say which cluster it was measured on"
    differ = [k for k in fingerprint if model.cluster.get(k) != fingerprint[k]]
    differ += [str(k) for k in model.cluster if k not in fingerprint]
    if differ:
        return f"it was measured on another cluster (differs in: {', '.join(differ)})"
    if not is_number(model.created) or model.created <= 0:
        return f"it does not say when it was measured (created: {model.created!r})"
    if model.created > now + CLOCK_SKEW_S:
        return (f"it says it was measured {(model.created - now) / 86400.0:.2f} days in the future, "
                "so its age is unknown")
    age_days = (now - model.created) / 86400.0
    if age_days > CACHE_MAX_AGE_DAYS:
        return f"it is {age_days:.0f} days old (limit {CACHE_MAX_AGE_DAYS:g})"
    return None


_MODEL_FIELDS = (*(f.name for f in dataclasses.fields(PSModel)), "kind")


def check_model_file(data: Any, fingerprint: dict[str, Any], now: float) -> PSModel:
    """The model in a cost-model cache file, if it is what a calibration of this cluster writes
    (:func:`measure`, then :func:`load_or_calibrate`) and passes :func:`cache_problem`; else
    :class:`~.cache_files.UnusableCacheFile` says why.

    Sizes are a leading part of the calibration grid, times finite and positive, ``a`` and
    ``bandwidth`` the fit of that table, ``hosts`` the workers' hosts of the fingerprint.
    """
    record(data, "the file", _MODEL_FIELDS)
    require(data["kind"] == "PSModel", f"kind is {data['kind']!r}, not 'PSModel'")
    integer(data["workers"], "workers", 1)
    integer(data["servers"], "servers", 1)
    sizes, times = data["sizes"], data["times"]
    require(isinstance(sizes, list) and sizes and sizes == DEFAULT_GRID[:len(sizes)],
            "sizes are not a leading part of the calibration grid")
    require(isinstance(times, list) and len(times) == len(sizes) and all(is_number(t) and t > 0 for t in times),
            f"times are not {len(sizes)} finite, positive numbers")
    integer(data["measured"], "measured", 1, len(sizes))
    number(data["a"], "a")
    number(data["bandwidth"], "bandwidth")
    require(isinstance(data["hosts"], list) and all(isinstance(h, str) for h in data["hosts"]),
            "hosts are not a list of host names")
    require(isinstance(data["cluster"], dict), "cluster is not an object")
    number(data["created"], "created")
    model = PSModel.from_dict(data)
    problem = cache_problem(model, fingerprint, now)
    require(problem is None, problem or "")
    fitted = PSModel.fit(model.workers, model.servers, model.sizes, model.times)
    require(math.isclose(model.a, fitted.a, rel_tol=1e-6, abs_tol=1e-12)
            and math.isclose(model.bandwidth, fitted.bandwidth, rel_tol=1e-6),
            f"a={model.a:g} and bandwidth={model.bandwidth:g} are not the fit of its table "
            f"(a={fitted.a:g}, bandwidth={fitted.bandwidth:g})")
    worker_hosts = sorted(set(fingerprint["hosts"][:fingerprint["workers"]]))
    require(model.hosts == worker_hosts, f"hosts {model.hosts} are not the workers' hosts {worker_hosts}")
    return model


def read_cached_model(path: str, fingerprint: dict[str, Any], now: float,
                      instead: str = "calibrating again") -> PSModel | None:
    """The model cached at ``path`` if :func:`check_model_file` passes; else None, and a file that
    fails is set aside with one warning (``cache_files.read_checked``)."""
    return read_checked(path, "cost model cache", lambda data: check_model_file(data, fingerprint, now), instead)


def load_or_calibrate() -> PSModel:
    """The cached PS model for this cluster (``cluster_fingerprint``), measuring and caching it if
    there is none, or if the cached one fails :func:`check_model_file` (set aside, one warning says why).
    Worker 0 alone reads the file; the others receive what it found, so all use the same model."""
    cfg = session.config()
    topo = session.topology()
    cached = path = fingerprint = None
    if topo.worker_rank == 0:
        fingerprint = cluster_fingerprint()
        path = cache_path(cfg.cost_model_path, fingerprint)
        model = read_cached_model(path, fingerprint, time.time(),
                                  "calibrating again" if cfg.calibrate else "calibrate=False forbids measuring it")
        cached = None if model is None else model.to_dict()
    cached, path = collectives.collective(topo.worker_comm, "bcast", (cached, path), "worker 0's cached PS cost model")
    if cached is not None:
        return PSModel.from_dict(cached)
    if not cfg.calibrate:
        raise RuntimeError(f"IMerge: no usable cached PS cost model at {path} and calibrate=False; run "
                           "`mpiexec ... python -m imerge_hooks.plan.calibrate` first")
    start = time.perf_counter()
    model = measure(budget_s=STARTUP_BUDGET_S)
    if topo.worker_rank == 0:
        model.cluster, model.created = fingerprint, time.time()
        model.to_json(path)
        log.info("IMerge: calibrated %s in %.1f s, cached at %s%s", model.describe(), time.perf_counter() - start,
                 path, "" if model.measured == len(model.sizes) else
                 " (`python -m imerge_hooks.plan.calibrate` measures the whole grid and replaces it)")
    return model


def format_table(model: PSModel) -> str:
    """One row per grid point; points the calibration extended rather than measured end in ``*``."""
    lines = [f"{'workers':>7} {'servers':>7} {'bytes':>10} {'time_us':>10} {'fit_us':>10}"]
    for index, (m, t) in enumerate(zip(model.sizes, model.times)):
        fit = model.a + model.workers * m / (model.servers * model.bandwidth)
        mark = " *" if index >= model.measured else ""
        lines.append(f"{model.workers:>7} {model.servers:>7} {int(m):>10} {t * 1e6:>10.1f} {fit * 1e6:>10.1f}{mark}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description="Measure IMerge's PS cost model (run under mpiexec).")
    parser.add_argument("--out", help="JSON path (default: the configured cache path)")
    parser.add_argument("--max-bytes", type=int, default=DEFAULT_GRID[-1])
    parser.add_argument("--budget-s", type=float, default=None,
                        help="stop as the start-up calibration does after about this many seconds "
                             f"(it uses {STARTUP_BUDGET_S:g}); default: measure the whole grid")
    args = parser.parse_args()
    startup.init()
    start = time.perf_counter()
    model = measure([m for m in DEFAULT_GRID if m <= args.max_bytes], budget_s=args.budget_s)
    if session.topology().worker_rank == 0:
        fingerprint = cluster_fingerprint()
        model.cluster, model.created = fingerprint, time.time()
        path = args.out or cache_path(session.config().cost_model_path, fingerprint)
        model.to_json(path)
        print(format_table(model))
        print(f"{model.describe()}  ({time.perf_counter() - start:.1f} s) -> {path}", flush=True)


if __name__ == "__main__":
    main()
