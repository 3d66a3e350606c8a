"""IMerge benchmark runner: fusion schemes, schedules and scaling, measured on an emulated cluster
and simulated from the calibrated cost model.

    sudo .venv/bin/python benchmarks/run.py                      # the full run (see README: ~1 h)
    sudo .venv/bin/python benchmarks/run.py --models vgg16 --workers 8      # one slice
    .venv/bin/python benchmarks/run.py --no-measure             # simulated tables only (no root)
    .venv/bin/python benchmarks/run.py --resume --no-measure --workers 2,4,8,16 --validate-workers 4,8,16
                                                                 # the stored results/bench.json again
    sudo .venv/bin/python benchmarks/run.py --quick             # smoke run (~1-2 min)
    sudo .venv/bin/python benchmarks/run.py --timeline vgg16:8:imerge --models vgg16 --workers 8

Three tables, each for ResNet-18, VGG-16, AlexNet and ResNet-50, one row per number of workers
W and one column per scheme, cells in samples/s (whole cluster):

1. fusion schemes: ``threshold``, ``mgwfbp``, ``adaptive-ps``;
2. schedules: ``default``, ``wfbp``, ``priority``, ``mgwfbp``, ``imerge``;
3. speed-up over one worker (the same replayed model in one process, no communication)
   for every schedule of table 2, against the linear line.

**Measured** (W in ``--workers``, default 2, 4, 8): ``benchmarks/netlab`` brings up W + S
emulated hosts (network namespaces, veth, ``tc tbf`` at ``--bandwidth`` per host and
direction), one MPI rank per host (servers last), and every rank runs
``benchmarks/worker_replay.py``: a ``ReplayModel`` (real parameter shapes, compute = profiled
sleeps times the time scale) trained with ``imerge_hooks.DistributedOptimizer``. One mpiexec
launch per (model, W) runs every schedule one after the other. The PS cost model is
calibrated once per (W, S, bandwidth) and cached under ``<out-dir>/cache/<bandwidth>/``.

**Simulated** (W in ``--sim-workers``, default 4, 8, 16, 32): ``imerge_hooks.simulate`` with a
``ClusterSpec`` matching the emulation (per-host bandwidth = link rate x TCP goodput 1448/1514,
per-push server startup = calibrated PSModel ``a / W``), and the calibrated PSModel as the
planner's cost model where one was measured for that W.

For every measured run it prints the physical lower bound
``max(compute per iteration, max(W/S, 1) * gradient bytes / per-host bandwidth)`` and the
efficiency bound / measured; then the simulator's error against the measurement for W in
``--validate-workers`` (default 4, 8), and the issue's targets at W=8, S=2, 1 Gbit/s
(checked, not asserted). Everything goes to ``<out-dir>/<name>.json`` (written after every
launch; ``--resume`` skips what is already there) and ``<name>-throughput.png`` /
``<name>-speedup.png``.

**Time scale.** Compute is the CPU profile (``benchmarks/profiles/*-cpu.json``, batch 8)
times ``--time-scale``. What decides the schedules is the ratio of communication to
computation, so the emulation at ``--bandwidth`` B_emu with time scale t has the ratio of a
real cluster with links ``--real-bandwidth`` B_real whose devices are ``--speedup`` k times
faster than the profiled CPU iff ``t = (B_real / B_emu) / k``. Default: B_real = 10 Gbit/s,
k = 10, B_emu = 1 Gbit/s, so t = 1.0. ``--time-scale`` sets t directly.

``--timeline [MODEL:W:SCHEDULE]`` runs one more measured launch of that configuration with
``IMERGE_TIMELINE`` set (Chrome trace of every rank) and writes the simulator's trace of the
same configuration next to it.

Needs root for the measured part (network namespaces); never sends traffic outside loopback
and the lab namespaces. ``netlab.down`` runs in a ``finally``.
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.runner.cli import parse_args  # noqa: E402
from benchmarks.runner.document import Bench  # noqa: E402
from benchmarks.runner.measure import measure  # noqa: E402
from benchmarks.runner.predict import calibrated_models, simulate_grid  # noqa: E402
from benchmarks.runner.report import print_header, report_efficiency, report_plots, report_tables, report_targets  # noqa: E402
from benchmarks.runner.validate import validate_simulator  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    """Measure what is missing, predict, check, report, save: the exit code (see the module doc)."""
    args = parse_args(argv, description=__doc__.split("\n\n", 1)[0])
    bench = Bench.open(args)  # output folders, the models' facts
    print_header(bench)
    bench.start_document(argv)  # this run's config; with --resume, what the JSON already holds
    if not args.no_measure and (stop := measure(bench)) is not None:
        return stop  # --dry-run, or no lab to measure on
    psmodels = calibrated_models(bench)  # the PS cost models: cache, else the stored calibration
    sim_runs, sim_base = simulate_grid(bench, psmodels)
    tp = report_tables(bench, sim_runs, sim_base)  # with the emulator check of every measured cell
    eff = report_efficiency(bench)
    validate_simulator(bench, psmodels)
    report_targets(bench, tp, eff, sim_runs)
    if not args.no_plots:
        report_plots(bench, tp)
    return bench.close()  # saved; 1 if a launch failed


if __name__ == "__main__":
    sys.exit(main())
