"""Start-up at the largest world this machine holds: 10 workers + 2 servers run init(), key
registration, the plan hand-off and the broadcasts (``benchmarks/startup.py``); every step completes
on every worker, broadcast values arrive (checked in the script) and the times per rank are printed
(``pytest -s``). The tree collectives send O(log W) messages per rank; the benchmark's table is in
``benchmarks/results/RESULTS.md``."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from mpirun import run_mpi

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "startup.py"
STEPS = ("init", "register", "handoff", "broadcast_parameters", "broadcast_object", "barrier")


def test_startup_steps_complete_on_twelve_ranks():
    run = run_mpi(SCRIPT, 12, "--inside", "--mb", "8", servers=2, timeout=240).check()
    (line,) = [x for x in run.stdout.splitlines() if x.startswith("STARTUP ")]
    result = json.loads(line.split(" ", 1)[1])
    assert result["workers"] == 10 and result["servers"] == 2
    rows = result["per_worker"]
    assert len(rows) == 10 and all(set(STEPS) <= set(row) for row in rows), rows
    for step in STEPS:
        times = [row[step] for row in rows]
        print(f"{step:<22} max {max(times):.3f} s  per rank {[round(t, 3) for t in times]}", file=sys.stderr)
