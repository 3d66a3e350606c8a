"""How far the simulator's predictions were from measurement on the emulated cluster, per schedule, from
the result set: writes ``imerge_hooks/simulate/measured_error.json``, which ``imerge-whatif`` prints
beside its predictions.

    python benchmarks/measured_error.py [--results benchmarks/results] [--out imerge_hooks/simulate/measured_error.json]

The cells are the measured rows that carry the simulator's prediction of the same cell:

* ``clusters.json``, ``clusters-half-rate.json`` (``benchmarks/clusters.py --simulate``): several
  workers per host, servers beside them or on hosts of their own; ``iteration_s`` measured,
  ``simulated_s`` predicted. IMerge's rows without host aggregation are left out: the command
  predicts IMerge with it (the runtime's default).
* ``bench.json``, ``bench-half.json`` (``benchmarks/run.py``, its ``validation``): one rank per
  host; ``measured_s`` and ``predicted_s`` (links only, as the command predicts: no fabric cap, no
  uneven sharing).

Error = predicted / measured - 1 (negative: the simulator was faster than the measurement).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
RESULTS = REPO / "benchmarks" / "results"
OUT = REPO / "imerge_hooks" / "simulate" / "measured_error.json"
CLUSTER_FILES = ("clusters.json", "clusters-half-rate.json")
BENCH_FILES = ("bench.json", "bench-half.json")


def cluster_cells(path: Path) -> list[dict]:
    """The rows of a ``clusters.py`` JSON with a prediction (IMerge: with host aggregation only)."""
    from benchmarks.clusters import CELLS

    cells = []
    for r in json.loads(path.read_text())["rows"]:
        if r.get("simulated_s") is None or r.get("host_aggregation") is False:
            continue
        cells.append({"source": f"benchmarks/results/{path.name}", "script": "benchmarks/clusters.py",
                      "cell": r["cell"], "title": r["title"], "model": r["model"], "schedule": r["schedule"],
                      "workers": r["workers"], "servers": r["servers"] if r["schedule"] == "imerge" else 0,
                      "hosts": r["hosts"], "workers_per_host": r["workers"] // len(set(CELLS[r["cell"]].workers)),
                      "bandwidth": r["bandwidth"], "measured_s": round(r["iteration_s"], 6),
                      "predicted_s": round(r["simulated_s"], 6),
                      "error": round(r["simulated_s"] / r["iteration_s"] - 1, 6)})
    return cells


def bench_cells(path: Path) -> list[dict]:
    """The ``validation`` rows of a ``run.py`` JSON (one rank per host)."""
    doc = json.loads(path.read_text())
    config = doc["config"]
    cells = []
    for v in doc.get("validation", []):
        workers = v["workers"]
        servers = 0 if v["schedule"] in ("ddp", "ddp-tuned", "mpi-allreduce") else \
            (workers if config["servers"] == "W" else max(1, workers // 2) if config["servers"] == "W/2"
             else int(config["servers"]))
        cells.append({"source": f"benchmarks/results/{path.name}", "script": "benchmarks/run.py",
                      "cell": f"W={workers}, S={config['servers']}", "title": "one rank per host",
                      "model": v["model"], "schedule": v["schedule"], "workers": workers, "servers": servers,
                      "hosts": workers + servers, "workers_per_host": 1, "bandwidth": config["bandwidth"],
                      "measured_s": round(v["measured_s"], 6), "predicted_s": round(v["predicted_s"], 6),
                      "error": round(v["error"], 6)})
    return cells


def span(values: list) -> str:
    lo, hi = min(values), max(values)
    return f"{lo}" if lo == hi else f"{lo}-{hi}"


def where(cells: list[dict]) -> str:
    """One phrase per script: how many cells, on what clusters."""
    parts = []
    for script in dict.fromkeys(c["script"] for c in cells):
        mine = [c for c in cells if c["script"] == script]
        rates = sorted({c["bandwidth"] for c in mine}, key=lambda b: float(b.rstrip("mbit")))
        hosts = span(sorted({c["hosts"] for c in mine}))
        per_host = span(sorted({c["workers_per_host"] for c in mine}))
        parts.append(f"{len(mine)} cells of {script} ({span(sorted({c['workers'] for c in mine}))} workers, "
                     f"{per_host} per host, {hosts} emulated hosts in all, {'/'.join(rates)} links; "
                     f"{', '.join(sorted({c['model'] for c in mine}))})")
    return "; ".join(parts)


def summary(cells: list[dict]) -> dict:
    errors = [c["error"] for c in cells]
    return {"cells": len(cells), "max_abs_error": max(abs(e) for e in errors),
            "median_abs_error": statistics.median(abs(e) for e in errors), "min_error": min(errors),
            "max_error": max(errors), "where": where(cells), "sources": sorted({c["source"] for c in cells}),
            "rows": cells}


def build(results: Path) -> dict:
    cells = []
    for name in CLUSTER_FILES:
        if (results / name).exists():
            cells += cluster_cells(results / name)
    for name in BENCH_FILES:
        if (results / name).exists():
            cells += bench_cells(results / name)
    if not cells:
        raise SystemExit(f"no measured cell with a prediction under {results}")
    schedules = {s: summary([c for c in cells if c["schedule"] == s]) for s in dict.fromkeys(c["schedule"]
                                                                                           for c in cells)}
    return {"about": "How far imerge_hooks.simulate's predictions were from measurement on the emulated cluster "
                     "(benchmarks/netlab, one 2-core VM), per schedule; error = predicted / measured - 1. "
                     "Written by benchmarks/measured_error.py from benchmarks/results; see RESULTS.md.",
            "written_by": "python benchmarks/measured_error.py", "schedules": schedules}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--results", default=str(RESULTS), help="the result set (default %(default)s)")
    ap.add_argument("--out", default=str(OUT), help="default %(default)s")
    args = ap.parse_args(argv)
    doc = build(Path(args.results))
    Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")
    for schedule, s in doc["schedules"].items():
        print(f"{schedule:<14} {s['cells']:3d} cells  max |error| {100 * s['max_abs_error']:5.1f}%  "
              f"median {100 * s['median_abs_error']:5.1f}%  ({100 * s['min_error']:+.0f}% .. "
              f"{100 * s['max_error']:+.0f}%)  {s['where']}")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
