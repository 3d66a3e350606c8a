"""Measure the PS cost model on the real many-to-one pattern (collective over workers).

Every worker pushes and pulls m bytes at the same time (the m bytes cut into one key per
server), for m on a log-spaced grid; the time of a size is the slowest worker's median.
``python -m imerge_hooks.plan.calibrate`` runs it under mpiexec and prints the table.
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import os
import statistics
import time

import torch

from .. import polling, runtime
from ..group import Group
from ..layout import CALIBRATION_GRID, calibration_keys
from ..schedule import SchedulePolicy
from ..wire import KeySpec
from .costmodel import PSModel

log = logging.getLogger("imerge")

DEFAULT_GRID = list(CALIBRATION_GRID)


def _repeats(nbytes: int) -> int:
    return 12 if nbytes <= 256 * 1024 else 5 if nbytes <= 4 << 20 else 3 if nbytes <= 16 << 20 else 2


def measure(sizes: list[int] | None = None) -> PSModel:
    """Measure T(m) for this job's W workers and S servers; returns a fitted PSModel."""
    topo = runtime.topology()
    comm = runtime.comm_thread()
    if comm is None:
        raise RuntimeError("IMerge: calibration needs at least one server")
    sizes = sorted(sizes or DEFAULT_GRID)
    client = runtime.new_client_id()
    groups, keys = [], []
    for index, nbytes in enumerate(sizes):
        numel = max(1, nbytes // 4)
        cut = calibration_keys(nbytes, topo.num_servers)
        ranges = [(s, e) for s, e, _ in cut]
        ids = runtime.allocate_keys(len(cut))
        gkeys = [KeySpec(k, (e - s) * 4, "float32", server, (f"calibration.{nbytes}",))
                 for k, (s, e, server) in zip(ids, cut)]
        keys += gkeys
        groups.append(Group(index=index, flat=torch.ones(numel), result=torch.empty(numel), keys=gkeys,
                            key_ranges=ranges, priority=0, names=(f"calibration.{nbytes}",)))
    runtime.register_keys(client, keys)
    policy = SchedulePolicy()
    times = []
    try:
        for group in groups[: max(1, len(groups) // 2)]:  # warm up connections and buffers once
            comm.submit(group, policy)
            comm.wait(group, "during calibration ")
        for group, nbytes in zip(groups, sizes):
            comm.submit(group, policy)  # warm-up
            comm.wait(group, "during calibration ")
            samples = []
            for _ in range(_repeats(nbytes)):
                # Spin while waiting (as MPI's Barrier does), so the workers start their samples together.
                runtime.collective(topo.worker_comm, "barrier", None, "the calibration barrier",
                                   spin_s=polling.SPIN_S_DEDICATED)
                start = time.perf_counter()
                comm.submit(group, policy)
                comm.wait(group, "during calibration ")
                samples.append(time.perf_counter() - start)
            times.append(runtime.collective(topo.worker_comm, "max", statistics.median(samples),
                                            f"the calibration times of {nbytes} bytes"))
    finally:
        runtime.register_keys(client, [])
    return PSModel.fit(topo.num_workers, topo.num_servers, sizes, times, hosts=_hosts())


def _hosts() -> list[str]:
    """The workers' host names, sorted and without repeats (collective over workers)."""
    names = runtime.collective(runtime.topology().worker_comm, "allgather", os.uname().nodename,
                               "the workers' host names")
    return sorted(set(names))


def cache_path(template: str) -> str:
    """The cost-model cache file for this job's workers, servers and hosts (collective over workers)."""
    topo = runtime.topology()
    hosts = _hosts()
    digest = hashlib.sha1(",".join(hosts).encode()).hexdigest()[:10]
    return os.path.expanduser(template.format(workers=topo.num_workers, servers=topo.num_servers, hosts=digest))


def load_or_calibrate() -> PSModel:
    """The cached PS model for this (W, S, hosts), measuring and caching it if there is none."""
    cfg = runtime.config()
    topo = runtime.topology()
    path = cache_path(cfg.cost_model_path)
    cached = None
    if topo.worker_rank == 0 and os.path.exists(path):
        try:
            cached = PSModel.from_json(path).to_dict()
        except (OSError, ValueError, KeyError, TypeError) as exc:
            log.warning("IMerge: ignoring unreadable cost model cache %s (%s)", path, exc)
    cached = runtime.collective(topo.worker_comm, "bcast", cached, "worker 0's cached PS cost model")
    if cached is not None:
        return PSModel.from_dict(cached)
    if not cfg.calibrate:
        raise RuntimeError(f"IMerge: no cached PS cost model at {path} and calibrate=False; run "
                           "`mpiexec ... python -m imerge_hooks.plan.calibrate` first")
    start = time.perf_counter()
    model = measure()
    if topo.worker_rank == 0:
        model.to_json(path)
        log.info("IMerge: calibrated %s in %.1f s, cached at %s", model.describe(), time.perf_counter() - start, path)
    return model


def format_table(model: PSModel) -> str:
    lines = [f"{'workers':>7} {'servers':>7} {'bytes':>10} {'time_us':>10} {'fit_us':>10}"]
    for m, t in zip(model.sizes, model.times):
        fit = model.a + model.workers * m / (model.servers * model.bandwidth)
        lines.append(f"{model.workers:>7} {model.servers:>7} {int(m):>10} {t * 1e6:>10.1f} {fit * 1e6:>10.1f}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description="Measure IMerge's PS cost model (run under mpiexec).")
    parser.add_argument("--out", help="JSON path (default: the configured cache path)")
    parser.add_argument("--max-bytes", type=int, default=DEFAULT_GRID[-1])
    args = parser.parse_args()
    runtime.init()
    start = time.perf_counter()
    model = measure([m for m in DEFAULT_GRID if m <= args.max_bytes])
    path = args.out or cache_path(runtime.config().cost_model_path)  # collective over workers
    if runtime.topology().worker_rank == 0:
        model.to_json(path)
        print(format_table(model))
        print(f"{model.describe()}  ({time.perf_counter() - start:.1f} s) -> {path}", flush=True)


if __name__ == "__main__":
    main()
