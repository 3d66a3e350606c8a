"""imerge-whatif: how fast each way of synchronising gradients would train a model on your cluster.

    imerge-whatif --profile benchmarks/profiles/resnet50-cpu.json --workers 32 --gpus-per-host 8 --link-gbit 10
    imerge-whatif --model resnet18 --batch-size 16 --time-scale 0.05 --workers 64 --gpus-per-host 8 \\
                  --link-gbit 25 --server-hosts 4 --schedules imerge,wfbp

The model is a saved profile (``--profile``, as ``benchmarks/make_profiles.py`` writes) or a
torchvision model profiled here on this machine's CPU (``--model``, ``--batch-size``, ``--image-size``).
``--time-scale`` multiplies every layer's compute time: 1 replays the profile as measured; to predict
a faster device from a CPU profile give (device's iteration time) / (profile's iteration time), e.g.
0.05 for a GPU 20x faster than this CPU on this model and batch.

The cluster: ``--workers`` W, ``--gpus-per-host`` G workers on each host behind one NIC of
``--link-gbit`` (each way; give what the NIC carries, e.g. ~95% of its rate for TCP at MTU 1500),
``--startup-us`` of server work per push, in-host link and summing rates (``--local-gbyte-s``,
``--reduce-gbyte-s``; they price the traffic between the workers of a host), and where servers may
go (``--servers``, ``--server-hosts``).

Every row is the simulator's prediction (``imerge_hooks.simulate``; the all-reduces:
``imerge_hooks.simulate.allreduce``), printed beside how far the simulator was from measurement on
the emulated cluster for that schedule (``imerge_hooks/simulate/measured_error.json``). Then the
option with the smallest predicted iteration, and by how much. PS cells share ``--cpu-budget`` CPU
seconds; one that does not finish in its share is reported as skipped.
"""

from __future__ import annotations

import argparse
import math
import sys
import textwrap
import time
from pathlib import Path

from ..core.config import SCHEDULES

DEFAULT_STARTUP_US = 200.0  # the servers' per-push work the benchmarks simulate (benchmarks/clusters.py)
DEFAULT_CPU_BUDGET_S = 300.0
DEFAULT_LOCAL_GBYTE_S = 10.0
DEFAULT_REDUCE_GBYTE_S = 2.0
TIE = 0.005  # predictions closer than this (relative) count as a tie
LABELS = {"ddp": "DDP (ring all-reduce)", "hierarchical": "hierarchical all-reduce",
          "mpi-allreduce": "Horovod (ring all-reduce)"}


def _positive(kind: type, allow_zero: bool = False):
    """An argparse type: a finite number > 0 (>= 0 with ``allow_zero``)."""
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a{'n integer' if kind is int else ' number'}: {text!r}") from None
        if not math.isfinite(value) or value < 0 or (value == 0 and not allow_zero):
            raise argparse.ArgumentTypeError(f"must be {'>= 0' if allow_zero else '> 0'}, got {text}")
        return value
    return parse


def _names(choices: tuple[str, ...]):
    """An argparse type: a comma-separated list of names out of ``choices``."""
    def parse(text: str) -> list[str]:
        names = [n.strip() for n in text.split(",") if n.strip()]
        bad = [n for n in names if n not in choices]
        if bad or not names:
            raise argparse.ArgumentTypeError(f"unknown {', '.join(bad) or 'empty list'}; choose from "
                                             f"{', '.join(choices)}")
        return names
    return parse


def parser() -> argparse.ArgumentParser:
    from ..simulate.choices import PLACEMENTS

    ap = argparse.ArgumentParser(prog="imerge-whatif", description=__doc__.split("\n\n")[0],
                                 epilog="\n\n".join(__doc__.split("\n\n")[1:]).replace("``", ""),
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    model = ap.add_argument_group("model (one of --profile, --model)")
    which = model.add_mutually_exclusive_group(required=True)
    which.add_argument("--profile", metavar="PATH", help="a saved profile JSON (benchmarks/profiles/*.json)")
    which.add_argument("--model", metavar="NAME", help="a torchvision model, profiled here on the CPU (e.g. resnet50)")
    model.add_argument("--batch-size", type=_positive(int), default=None, help="per worker, with --model (default 8)")
    model.add_argument("--image-size", type=_positive(int), default=None, help="with --model (default 224)")
    model.add_argument("--time-scale", type=_positive(float), default=1.0,
                       help="factor on every compute time: device time / profiled time (default 1)")
    cluster = ap.add_argument_group("cluster")
    cluster.add_argument("--workers", type=_positive(int), required=True, help="W, the training processes")
    cluster.add_argument("--gpus-per-host", type=_positive(int), default=1, help="workers per host, behind one NIC")
    cluster.add_argument("--link-gbit", type=_positive(float), required=True, help="NIC rate, Gbit/s each way")
    cluster.add_argument("--startup-us", type=_positive(float, allow_zero=True), default=DEFAULT_STARTUP_US,
                         help=f"a server's work per push, us (default {DEFAULT_STARTUP_US:.0f})")
    cluster.add_argument("--local-gbyte-s", type=_positive(float), default=DEFAULT_LOCAL_GBYTE_S,
                         help="each worker's link to the others on its host, GB/s; a host's workers share "
                              f"G times it (default {DEFAULT_LOCAL_GBYTE_S:g}, PCIe-class; NVLink has more)")
    cluster.add_argument("--reduce-gbyte-s", type=_positive(float), default=DEFAULT_REDUCE_GBYTE_S,
                         help="rate at which a worker adds up gradients, GB/s (default "
                              f"{DEFAULT_REDUCE_GBYTE_S:g}, the simulator's)")
    cluster.add_argument("--servers", type=_names(PLACEMENTS), default=None,
                         help="server placements to try: colocated (one server on each worker host), "
                              "colocated-half (on half of them), dedicated (on --server-hosts hosts of their own); "
                              "default colocated,colocated-half and dedicated if --server-hosts")
    cluster.add_argument("--server-hosts", type=_positive(int, allow_zero=True), default=0,
                         help="dedicated server hosts available (default 0)")
    ap.add_argument("--schedules", type=_names((*SCHEDULES, "mpi-allreduce")), default=["imerge"],
                    help="IMerge schedules (and mpi-allreduce) to predict beside DDP and hierarchical "
                         "all-reduce (default imerge)")
    ap.add_argument("--cpu-budget", type=_positive(float), default=DEFAULT_CPU_BUDGET_S, metavar="SECONDS",
                    help=f"CPU seconds for all simulations together (default {DEFAULT_CPU_BUDGET_S:.0f})")
    return ap


def check(ap: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """What argparse cannot see alone; ``ap.error`` (exit 2) naming the option."""
    if args.workers < 2:
        ap.error(f"--workers must be at least 2 to synchronise anything, got {args.workers}")
    if args.workers % args.gpus_per_host:
        ap.error(f"--workers ({args.workers}) must be a multiple of --gpus-per-host ({args.gpus_per_host})")
    for option, value in (("--batch-size", args.batch_size), ("--image-size", args.image_size)):
        if args.profile is not None and value is not None:
            ap.error(f"{option} goes with --model: a profile's times are for its own batch and images")
    if args.servers is None:
        args.servers = ["colocated", "colocated-half"] + (["dedicated"] if args.server_hosts else [])
    if "dedicated" in args.servers and not args.server_hosts:
        ap.error("--servers dedicated needs --server-hosts N (N >= 1)")
    if args.profile is not None and not Path(args.profile).is_file():
        ap.error(f"--profile {args.profile}: no such file")
    if args.model is not None:
        from ..simulate.torch_profile import torchvision_models

        known = torchvision_models()
        if args.model not in known:
            ap.error(f"--model {args.model!r} is not a torchvision model; e.g. {', '.join(known[:12])}, ...")


def load_model(ap: argparse.ArgumentParser, args: argparse.Namespace):
    from ..simulate import ModelSpec

    if args.profile is not None:
        try:
            return ModelSpec.from_profile_json(args.profile)
        except (ValueError, OSError) as exc:
            ap.error(f"--profile {args.profile}: {exc}")
    from ..simulate.torch_profile import profile_torchvision

    batch, size = args.batch_size or 8, args.image_size or 224
    print(f"profiling {args.model} (batch {batch}, {size}x{size}) on this CPU ...", file=sys.stderr, flush=True)
    return profile_torchvision(args.model, batch, size)


def table(outcomes, cluster, errors) -> list[str]:
    """The rows, aligned: option, servers, s/iter, samples/s, throughput against DDP, measured error."""
    from ..simulate.measured import short

    ddp = next(o for o in outcomes if o.option.schedule == "ddp")
    head = ("option", "servers", "s/iter", "samples/s", "vs DDP", "simulator vs measurement")
    lines = []
    for o in outcomes:
        name = LABELS.get(o.option.schedule, o.option.schedule)
        if o.iteration_s is None:
            lines.append((name, o.option.describe(cluster), "-", "-", "-", o.skipped or "not predicted"))
            continue
        ratio = f"{ddp.iteration_s / o.iteration_s:.2f}x" if ddp.iteration_s else "-"
        lines.append((name, o.option.describe(cluster), f"{o.iteration_s:.4f}", f"{o.throughput:.1f}", ratio,
                      short(errors, o.option.schedule)))
    widths = [max(len(row[i]) for row in [head, *lines]) for i in range(len(head))]
    fmt = "  ".join(f"{{:{'<' if i < 2 or i == 5 else '>'}{w}}}" for i, w in enumerate(widths))
    return [fmt.format(*row).rstrip() for row in [head, tuple("-" * w for w in widths), *lines]]


def advice(outcomes, cluster, errors, compute_s: float) -> list[str]:
    """Which option to use and by how much, with the simulator's error beside the margin."""
    from ..simulate.choices import recommend

    best, second = recommend(outcomes)
    ddp = next(o for o in outcomes if o.option.schedule == "ddp")

    def name(o) -> str:
        label = LABELS.get(o.option.schedule, o.option.schedule)
        return label if o.option.is_allreduce else f"{label} with {o.option.describe(cluster)}"

    among = "Of the options predicted, use" if any(o.iteration_s is None for o in outcomes) else "Use"
    out = [f"{among} {name(best)}: {best.iteration_s:.4f} s per iteration, {best.throughput:.1f} samples/s."]
    if best is not ddp:
        out.append(f"  That is {ddp.iteration_s / best.iteration_s:.2f}x DDP's throughput "
                   f"({100 * (1 - best.iteration_s / ddp.iteration_s):.1f}% less time per iteration).")
    if second is not None:
        margin = second.iteration_s / best.iteration_s - 1
        out.append(f"  The next best, {name(second)}, takes {100 * margin:.1f}% longer.")
        ties = [o for o in outcomes if o is not best and o.iteration_s is not None
                and o.iteration_s <= best.iteration_s * (1 + TIE)]
        simple = next((o for o in ties if o.option.is_allreduce), None)
        if simple is not None and not best.option.is_allreduce:
            tied = name(simple)
            out.append(f"  {tied[0].upper()}{tied[1:]} is within {100 * TIE:.1f}%: a tie, and it needs no server "
                       f"processes.")
        elif margin >= TIE:
            medians = [errors[o.option.schedule]["median_abs_error"] for o in (best, second)
                       if o.option.schedule in errors]
            if medians and margin < max(medians):
                out.append(f"  The margin is below the simulator's median error on measured cells "
                           f"({100 * max(medians):.0f}%): measure both before committing.")
    if best.iteration_s <= compute_s * (1 + TIE):
        out.append(f"  Compute alone takes {compute_s:.4f} s: communication is hidden behind it, so the choice "
                   f"matters little here (a faster device, --time-scale < 1, makes it matter).")
    if any(o.skipped for o in outcomes):
        out.append("  Some cells were skipped for the CPU budget: raise --cpu-budget to include them.")
    return out


def main(argv: list[str] | None = None) -> int:
    """Parse, predict, print; 0 on success, 2 for bad input (argparse's code)."""
    from ..simulate import measured
    from ..simulate.choices import Cluster, options, predict_all

    ap = parser()
    args = ap.parse_args(argv)
    check(ap, args)
    model = load_model(ap, args)
    cluster = Cluster(workers=args.workers, per_host=args.gpus_per_host, link_Bps=args.link_gbit * 1e9 / 8,
                      startup_s=args.startup_us * 1e-6, local_Bps=args.local_gbyte_s * 1e9 * args.gpus_per_host,
                      reduce_Bps=args.reduce_gbyte_s * 1e9, time_scale=args.time_scale)
    rows = options(cluster, args.schedules, args.servers, args.server_hosts)
    compute = sum(layer.forward_s + layer.backward_s for layer in model.layers) * args.time_scale
    print(f"model: {model.name}, batch {model.batch_size} per worker, {len(model.tensor_bytes)} tensors, "
          f"{model.total_bytes / 1e6:.1f} MB of gradients; compute {compute:.4f} s per iteration "
          f"(time scale {args.time_scale:g})")
    print(f"cluster: {cluster.workers} workers on {cluster.hosts} host{'s' if cluster.hosts > 1 else ''} of "
          f"{cluster.per_host}, NICs {args.link_gbit:g} Gbit/s each way, in-host links {args.local_gbyte_s:g} GB/s "
          f"per worker, sums {args.reduce_gbyte_s:g} GB/s, server work {args.startup_us:g} us per push")
    started, wall = time.process_time(), time.monotonic()
    outcomes = predict_all(model, cluster, rows, args.cpu_budget)
    errors = measured.load()
    print()
    for line in table(outcomes, cluster, errors):
        print(line)
    print()
    for line in advice(outcomes, cluster, errors, compute):
        print(textwrap.fill(line, width=120, subsequent_indent="    " if line.startswith(" ") else "  "))
    print()
    print("How far the simulator was from measurement on the emulated cluster (benchmarks/results):")
    for schedule in dict.fromkeys(o.option.schedule for o in outcomes):
        print(textwrap.fill(measured.sentence(errors, schedule), width=120, initial_indent="  ",
                            subsequent_indent="    "))
    folded = sorted({o.fold for o in outcomes if o.fold > 1})
    if folded:
        print(f"  Large clusters are simulated through alike workers each standing for {folded} (fold_factor).")
    print(f"({time.process_time() - started:.1f} s of CPU, {time.monotonic() - wall:.1f} s; "
          f"budget {args.cpu_budget:g} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
