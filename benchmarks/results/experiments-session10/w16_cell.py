"""The W=16 ResNet-18 imerge cell of ``bench-session9-w16.json`` as the simulator sees it (shared
by this directory's experiments): its calibrated PS model, validation row, model spec and the
ClusterSpec fields of the emulated cluster (no startup: each experiment sets its own)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))

from benchmarks import run  # noqa: E402
from imerge_hooks import simulate  # noqa: E402
from imerge_hooks.costmodel import PSModel  # noqa: E402


def load() -> tuple[PSModel, dict, simulate.ModelSpec, dict]:
    grid = json.loads((ROOT / "benchmarks/results/bench-session9-w16.json").read_text())
    table = grid["calibration"]["16"]["table"]
    psm = PSModel.fit(16, 2, table["bytes"], table["time_s"])
    cell = next(v for v in grid["validation"]
                if v["model"] == "resnet18" and v["workers"] == 16 and v["schedule"] == "imerge")
    spec = simulate.ModelSpec.from_profile_json(run.PROFILES / "resnet18-cpu.json")
    cluster = dict(workers=16, servers=2, bandwidth_Bps=125e6 * run.GOODPUT, fabric_Bps=cell["fabric_Bps"],
                   share_period_s=cell["share_period_s"])
    return psm, cell, spec, cluster
