"""The result document of one run: its folders, the models' facts, the JSON it writes after every
step (``<out-dir>/<name>.json``), and what ``--resume`` keeps of the JSON already there."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.netlab import netlab as nl
from benchmarks.runner.grid import fmt_s, model_facts, servers_for

# a resumed file keeps its measured runs only if these settings are the same
SAME_MEASUREMENT = ("servers", "bandwidth", "time_scale", "iters", "warmup", "profile_steps", "rank_env")


@dataclass
class Bench:
    """One run's state, shared by its steps. ``measured_runs``, ``launches`` and ``baseline_runs``
    are the very objects under ``doc["measured"]``, so a step that appends to them changes what
    :meth:`save` writes."""

    args: argparse.Namespace
    out_dir: Path
    log_dir: Path
    cache_dir: Path
    json_path: Path
    facts: dict[str, dict]
    t_start: float
    doc: dict = field(default_factory=dict)
    measured_runs: list[dict] = field(default_factory=list)
    launches: list[dict] = field(default_factory=list)
    baseline_runs: dict = field(default_factory=dict)
    calibration_kept: dict = field(default_factory=dict)

    @classmethod
    def open(cls, args: argparse.Namespace) -> Bench:
        """The output folders (made if missing) and the facts of ``--models``."""
        out_dir = Path(args.out_dir).resolve()
        out_dir.mkdir(parents=True, exist_ok=True)
        log_dir = out_dir / "logs" / args.name
        log_dir.mkdir(parents=True, exist_ok=True)
        cache_dir = out_dir / "cache" / nl.format_rate(nl.parse_rate(args.bandwidth))
        cache_dir.mkdir(parents=True, exist_ok=True)
        facts = {m: model_facts(m, args.time_scale) for m in args.models}
        return cls(args=args, out_dir=out_dir, log_dir=log_dir, cache_dir=cache_dir,
                   json_path=out_dir / f"{args.name}.json", facts=facts, t_start=time.perf_counter())

    def servers(self, workers: int) -> int:
        """S of W (``--servers``)."""
        return servers_for(self.args.servers, workers)

    def start_document(self, argv: list[str] | None) -> None:
        """The new document: this run's config, and with ``--resume`` what the JSON already holds
        if it was measured with the same settings (runs, launches, baseline, fabric probe,
        calibration, scale check, timeline). ``--recalibrate`` empties the PS-model cache."""
        args, ts = self.args, self.args.time_scale
        doc: dict = {}
        if args.resume and self.json_path.exists():
            doc = json.loads(self.json_path.read_text())
        from benchmarks.machine import machine_info

        config = {"models": args.models, "workers": args.workers,
                  "servers": int(args.servers) if str(args.servers).isdigit() else args.servers,
                  "bandwidth": args.bandwidth, "bandwidth_Bps": args.bandwidth_Bps, "goodput": args.goodput,
                  "time_scale": ts, "time_scale_why": args.time_scale_why,
                  "iters": args.iters, "min_timed_s": args.min_timed_s, "max_iters": args.max_iters,
                  "warmup": args.warmup, "profile_steps": args.profile_steps,
                  "fusion_schedules": args.fusion, "schedules": args.table2, "sim_workers": args.sim_workers,
                  "validate_workers": args.validate_workers, "prefix": args.prefix, "rank_env": args.rank_env,
                  "mtu": args.mtu,
                  "argv": sys.argv[1:] if argv is None else argv}
        same = doc.get("config", {})
        keep = args.resume and all(same.get(k) == config[k] for k in SAME_MEASUREMENT)
        self.measured_runs = doc.get("measured", {}).get("runs", []) if keep else []
        for r in self.measured_runs:  # a resumed file may hold models that --models leaves out: keep their runs
            if r["model"] not in self.facts:
                self.facts[r["model"]] = model_facts(r["model"], ts)
        self.launches = doc.get("measured", {}).get("launches", []) if keep else []
        self.baseline_runs = doc.get("measured", {}).get("baseline", {}) if keep else {}
        fabric_kept = doc.get("fabric", {}) if keep else {}
        self.calibration_kept = doc.get("calibration", {}) if keep else {}
        # measured once, reported again: the scale check and the timeline (a new one replaces them)
        kept_extras = {k: doc.get(k) for k in ("scale_check", "timeline")} if keep else {}
        self.doc = {"description": "IMerge benchmark (benchmarks/run.py): cells are samples/s of the whole cluster",
                    "config": config, "machine": machine_info(),
                    "measured": {"runs": self.measured_runs, "launches": self.launches,
                                 "baseline": self.baseline_runs},
                    "fabric": fabric_kept,
                    **{k: v for k, v in kept_extras.items() if v is not None}}
        self.doc["machine"]["omp_num_threads"] = "1 (ranks)"
        if args.recalibrate:
            for p in self.cache_dir.glob("psmodel-*.json"):
                p.unlink()

    def save(self) -> None:
        """Write the document (atomically: a reader never sees half a file)."""
        tmp = self.json_path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(self.doc, indent=1, default=str))
        os.replace(tmp, self.json_path)

    def close(self) -> int:
        """Save the document with the run's wall time; the exit code: 1 if a launch failed."""
        self.doc["total_wall_s"] = time.perf_counter() - self.t_start
        self.save()
        print(f"JSON: {self.json_path}  ({fmt_s(self.doc['total_wall_s'])})")
        failed = [la for la in self.launches if la.get("rc") or la.get("missing")]
        return 1 if failed else 0
