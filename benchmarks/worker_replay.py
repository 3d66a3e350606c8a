"""Per-rank training script of ``benchmarks/run.py``: compute replay + IMerge, one or more schedules.

Every rank runs this file (launched by ``run.py`` through ``benchmarks/netlab``, one rank per
emulated host; the last ``IMERGE_NUM_SERVERS`` ranks are the parameter servers and never
return from ``imh.init()``). On a worker, for each schedule in ``--schedules``:

* a fresh :class:`benchmarks.replay.ReplayModel` of ``--model`` (the profiled model's real
  parameter names, shapes and bytes; forward/backward *sleep* the profiled times times
  ``--time-scale``) and ``imerge_hooks.DistributedOptimizer(SGD, schedule=...)``;
* warm-up: planned schedules (threshold, mgwfbp, adaptive-ps, imerge) first run
  ``--profile-steps`` profiled iterations (one tensor per message; the plan, and the one-off PS
  cost-model calibration cached at ``IMERGE_COST_MODEL_PATH``, happen at the end of them), then
  ``--warmup`` more iterations with the plan installed; other schedules just ``--warmup``;
* ``--iters`` timed iterations with no synchronisation in between: per worker, the duration
  of iteration i is (start of iteration i+1) - (start of iteration i), the last one ending when
  its ``step()`` returns. For ``imerge`` (updates deferred into the next forward) the first
  timed forward waits for the last warm-up iteration's communication and the last timed
  iteration's communication is left out: steady state, the same definition as the simulator
  (time between consecutive starts of the forward pass);
* then ``synchronize()`` (untimed), the engine is retired (hooks removed, its keys dropped from
  the servers so their buffers are freed) and worker 0 prints one line
  ``RESULT {json}`` (samples/s, iteration times, per-worker details, plan size).

Each process prints ``RANKINFO {json}`` at exit (CPU seconds, peak RSS) for diagnosis.

``--share-params FILE`` backs the parameters of every worker on the machine with one shared
mapping (saves RAM; the compute replay never reads parameter values, and every byte is still
broadcast, updated and communicated per worker; see :func:`share_parameters`).

    OMP_NUM_THREADS=1 mpiexec -n 4 -env IMERGE_NUM_SERVERS 2 python benchmarks/worker_replay.py \\
        --model alexnet --schedules default,imerge --time-scale 1 --iters 3

Run it with ``OMP_NUM_THREADS=1`` (see ``benchmarks/replay.py``). A single process with no
server trains locally with no communication (``--schedules local``); ``--baseline`` measures
the same one-worker baseline on worker 0 inside a cluster launch (the speed-up table's
denominator) before the schedules, while the other ranks wait idle.
"""

from __future__ import annotations

import argparse
import atexit
import dataclasses
import gc
import json
import os
import resource
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks import peers  # noqa: E402
from benchmarks.replay import ReplayModel, load_profile  # noqa: E402
from benchmarks.runner.grid import PEERS  # noqa: E402
from imerge_hooks.internals import MPI  # noqa: E402

PLANNED = ("threshold", "mgwfbp", "adaptive-ps", "imerge")


def _rank_info() -> None:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    info = {"world_rank": int(os.environ.get("PMI_RANK", "0")), "netns": os.environ.get("NETLAB_NETNS"),
            "cpu_s": round(ru.ru_utime + ru.ru_stime, 3), "maxrss_mb": round(ru.ru_maxrss / 1024, 1)}
    print("RANKINFO " + json.dumps(info), flush=True)


def _prefer_oom_kill() -> None:
    """Make this rank the kernel's first choice if the machine runs out of RAM (VGG-16 with 8
    workers needs most of a 24 GB box): a failed benchmark launch, not someone else's process."""
    try:
        with open("/proc/self/oom_score_adj", "w") as f:
            f.write("1000")
    except OSError:
        pass


def _retire(opt) -> None:
    """Drop an engine so the next schedule starts clean and memory is returned (the servers free
    its keys; hooks, callbacks and its buffers go)."""
    opt.close()


def share_parameters(model: torch.nn.Module, path: str) -> None:
    """Back every parameter with one file mapped MAP_SHARED by all workers of this machine.

    Only the physical pages are shared (the replayed compute never reads parameter values):
    each worker still broadcasts into, and SGD-updates, every parameter byte, and every
    gradient byte still goes through its own IMerge buffers and the network. It keeps W copies
    of VGG-16's 553 MB of parameters from exhausting the RAM of a one-machine emulation.
    """
    params = list(model.parameters())
    total = sum(p.numel() for p in params)
    if any(p.dtype != torch.float32 for p in params):
        raise ValueError("--share-params supports float32 parameters only")
    if os.path.getsize(path) < total * 4:
        raise ValueError(f"{path} holds {os.path.getsize(path)} bytes, need {total * 4}")
    flat = torch.from_file(path, shared=True, size=total, dtype=torch.float32)
    offset = 0
    with torch.no_grad():
        for p in params:
            n = p.numel()
            p.data = flat[offset:offset + n].view_as(p)
            offset += n


def _trainer(schedule: str, model: torch.nn.Module, base: torch.optim.Optimizer, args, imh, worker_comm,
             bucket_cap_mb: float | None = None):
    """(what to call forward on, what to zero_grad/step, the IMerge engine or None) for one schedule."""
    if schedule == "local":
        return model, base, None
    if schedule in ("ddp", "ddp-tuned"):
        return peers.wrap_ddp(model, bucket_cap_mb or 25.0), base, None
    if schedule == "mpi-allreduce":
        return model, peers.FusedAllreduce(base, list(model.parameters()), worker_comm), None
    opt = imh.DistributedOptimizer(base, named_parameters=model.named_parameters(), schedule=schedule,
                                   profile_steps=args.profile_steps)
    imh.broadcast_parameters(model.state_dict(), root_rank=0)
    return model, opt, opt._imerge_engine


def tune_ddp_bucket(profile: dict, args, imh, worker_comm) -> tuple[float, dict]:
    """``ddp-tuned``: time DDP with every cap of ``peers.ddp_caps`` (2 warm-up iterations, DDP
    rebuilds its buckets after the first, then 1 timed; the slowest worker's time) and return the
    fastest cap with every cap's s/iter."""
    total = sum(prm["bytes"] for layer in profile["layers"] for prm in layer["params"])
    times = {}
    for cap in peers.ddp_caps(total):
        model = ReplayModel(profile, time_scale=args.time_scale)
        if args.share_params:
            share_parameters(model, args.share_params)
        base = torch.optim.SGD(model.parameters(), lr=0.01)
        ddp = peers.wrap_ddp(model, cap)
        x = model.example_input()
        for it in range(3):
            if it == 2:
                t0 = time.perf_counter()
            base.zero_grad()
            ddp(x).sum().backward()
            base.step()
        mine = time.perf_counter() - t0
        times[cap] = worker_comm.allreduce(mine, op=MPI.MAX) if worker_comm is not None else mine
        del ddp, base, model
        gc.collect()
    best = min(times, key=times.get)
    return best, times


def run_schedule(schedule: str, profile: dict, args, imh, worker_comm) -> dict | None:
    tuning = None
    cap = None
    if schedule == "ddp":
        cap = 25.0
    elif schedule == "ddp-tuned":
        cap, tuning = tune_ddp_bucket(profile, args, imh, worker_comm)
    model = ReplayModel(profile, time_scale=args.time_scale)
    if args.share_params:
        share_parameters(model, args.share_params)
    base = torch.optim.SGD(model.parameters(), lr=0.01)
    local = schedule == "local"
    forward, opt, engine = _trainer(schedule, model, base, args, imh, worker_comm, cap)
    x = model.example_input()
    warm = args.warmup + (args.profile_steps if schedule in PLANNED else 0)
    if schedule in PEERS:
        warm = max(warm, 2)  # DDP builds its final buckets after the first iteration
    starts: list[float] = []
    cpu0 = None
    fwd_s, bwd_s = [], []
    policies = None
    for it in range(warm + args.iters):
        t = time.perf_counter()
        if it == warm:
            cpu0 = time.process_time()
            timed_from = time.monotonic()
            # A/B against the policy of the installed plan (the plan search may have changed it)
            policies = _ab_policies(engine, args.alternate) if engine is not None else None
        if policies is not None and it >= warm:
            # A/B in one launch, one plan: blocks of two iterations, A B A B ...; every worker
            # switches at the same iteration. Only a block's second iteration is counted (the
            # first may still wait for the other policy's communication).
            engine.set_policy(**policies[((it - warm) // 2) % 2])
        if it >= warm:
            starts.append(t)
        opt.zero_grad()
        out = forward(x)
        t1 = time.perf_counter()
        out.sum().backward()
        t2 = time.perf_counter()
        opt.step()
        if it >= warm:
            fwd_s.append(t1 - t)
            bwd_s.append(t2 - t1)
    end = time.perf_counter()
    timed_to = time.monotonic()
    cpu = time.process_time() - cpu0
    if engine is not None:
        opt.synchronize()
    durations = [b - a for a, b in zip(starts, starts[1:] + [end])]
    mine = {"durations": durations, "elapsed": end - starts[0], "forward_s": statistics.median(fwd_s),
            "backward_s": statistics.median(bwd_s), "cpu_s_per_iter": cpu / args.iters}
    n_groups = n_keys = installed = None
    if engine is not None:
        n_groups = len(engine.groups)
        n_keys = sum(len(g.keys) for g in engine.groups)
        installed = installed_plan(engine)
        _retire(opt)
    elif isinstance(opt, peers.FusedAllreduce):
        opt.close()
    everyone = worker_comm.gather(mine, root=0) if (worker_comm is not None and not local) else [mine]
    del opt, base, model, forward
    gc.collect()
    if everyone is None:  # not worker 0
        return None
    workers = len(everyone)
    elapsed = max(w["elapsed"] for w in everyone)
    per_iter = [statistics.mean(w["durations"][i] for w in everyone) for i in range(args.iters)]
    exp_f, exp_b = (sum(layer["forward_s"] for layer in profile["layers"]) * args.time_scale,
                    sum(layer["backward_s"] for layer in profile["layers"]) * args.time_scale)
    batch = int(profile.get("batch_size", 1))
    return {
        "model": profile["model"], "schedule": schedule, "workers": workers,
        "servers": imh.num_servers() if not local else 0, "batch_size": batch, "iters": args.iters,
        "warmup_iters": warm, "time_scale": args.time_scale,
        "iteration_s": elapsed / args.iters,  # slowest worker, mean over the timed iterations
        "iteration_median_s": statistics.median(per_iter),
        "iteration_s_each": per_iter,
        "samples_per_s": workers * batch * args.iters / elapsed,
        "expected_compute_s": exp_f + exp_b,
        "forward_s": statistics.mean(w["forward_s"] for w in everyone),
        "backward_s": statistics.mean(w["backward_s"] for w in everyone),
        "worker_cpu_s_per_iter": statistics.mean(w["cpu_s_per_iter"] for w in everyone),
        "worker_iteration_s": [w["elapsed"] / args.iters for w in everyone],
        "groups": n_groups, "keys": n_keys, "plan": installed,
        "timed_monotonic_s": [timed_from, timed_to],  # worker 0's clock = the host's: run.py's CPU monitor
        **({"bucket_cap_mb": cap} if cap is not None else {}),
        **({"bucket_tuning_s": {str(k): v for k, v in tuning.items()}} if tuning else {}),
        **({"alternate": {"policies": policies,
                          "a_s": [per_iter[i] for i in range(1, args.iters, 4)],
                          "b_s": [per_iter[i] for i in range(3, args.iters, 4)]}} if policies else {}),
    }


def installed_plan(engine) -> dict:
    """The plan the engine ran: its groups (parameter indices in registration order, which are the
    profile's tensor order and so the simulator's) in send order, and the partition size of
    partitioned schedules (None otherwise). ``run.py`` simulates exactly this plan. The windows and
    whether a tail group is installed are recorded too (``tail_credit`` False: none, as a searched plan
    without the tail credit says)."""
    policy = engine.policy
    tailed = any(g.tail_keys for g in engine.groups)
    return {"groups": [list(g.members) for g in engine.groups], "partition_bytes": engine.partition_limit,
            "stagger": policy.stagger, "waves": policy.waves, "credit_bytes": policy.credit_bytes,
            "server_credit_bytes": policy.server_credit_bytes,
            "tail_credit": None if policy.tail_credit_bytes is None else tailed}


def _ab_policies(engine, alternate: str | None) -> list[dict] | None:
    """(A, B) SchedulePolicy fields for ``--alternate`` (A: the engine's own), or None."""
    if not alternate or engine.policy.credit_bytes is None:  # only partitioned schedules
        return None
    a = dataclasses.asdict(engine.policy)
    b = dict(a)
    for item in alternate.split(","):
        name, _, value = item.partition("=")
        if name not in a:
            raise SystemExit(f"--alternate: SchedulePolicy has no field {name!r} (fields: {sorted(a)})")
        b[name] = _policy_value(name, value)
    return [a, b]


def _policy_value(name: str, text: str) -> bool | int | None:
    """``--alternate``'s value for one SchedulePolicy field, parsed as the IMERGE_* env vars are
    (``Config.from_env``): a bool field takes true/false/on/off/1/0, the byte fields an int or ``none``."""
    from imerge_hooks.internals import SchedulePolicy, parse_value

    field_type = next(f.type for f in dataclasses.fields(SchedulePolicy) if f.name == name)
    try:
        return parse_value(text, field_type)
    except ValueError:
        what = "true or false" if field_type == "bool" else "a byte count or none"
        raise SystemExit(f"--alternate: {name} is {what}, got {text!r}") from None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--model", required=True, help="profile name (resnet18, vgg16, alexnet, resnet50) or path")
    ap.add_argument("--device", default="cpu", help="profile tag")
    ap.add_argument("--schedules", default="imerge", help="comma-separated; 'local' = one process, no IMerge")
    ap.add_argument("--time-scale", type=float, default=1.0)
    ap.add_argument("--profile-steps", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=1, help="untimed iterations (after profiling for planned ones)")
    ap.add_argument("--iters", type=int, default=3, help="timed iterations")
    ap.add_argument("--baseline", action="store_true",
                    help="first time one worker alone with no communication (schedule 'local')")
    ap.add_argument("--alternate", default=None, metavar="FIELD=VALUE[,...]",
                    help="partitioned schedules: alternate the engine's SchedulePolicy with these fields "
                         "(e.g. tail_credit_bytes=none) in blocks of two timed iterations; A/B in one plan")
    ap.add_argument("--share-params", default=None, metavar="FILE",
                    help="map all parameters from FILE (MAP_SHARED, pre-sized) to save RAM; see share_parameters")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    _prefer_oom_kill()
    atexit.register(_rank_info)  # also runs on server ranks (init() exits them with SystemExit)
    profile = load_profile(args.model, args.device)
    schedules = [s for s in args.schedules.split(",") if s]
    if schedules == ["local"]:
        import imerge_hooks as imh  # noqa: F401  (no init: purely local)

        res = run_schedule("local", profile, args, None, None)
        print("RESULT " + json.dumps(res), flush=True)
        return 0

    import imerge_hooks as imh
    from imerge_hooks.internals import session

    imh.init()  # servers serve here and exit
    topo = session.topology()
    comm = topo.worker_comm if topo.num_workers > 1 else None
    if args.baseline:
        # One worker, no communication, in this same process (no extra launch): worker 0 trains
        # alone while the others wait in a sleeping poll (a blocking MPI barrier would spin a core).
        if topo.worker_rank == 0:
            res = run_schedule("local", profile, args, None, None)
            print("RESULT " + json.dumps(res), flush=True)
        if comm is not None:
            req = comm.Ibarrier()
            while not req.Test():
                time.sleep(0.02)
    for schedule in schedules:
        res = run_schedule(schedule, profile, args, imh, comm)
        if res is not None:
            print("RESULT " + json.dumps(res), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
