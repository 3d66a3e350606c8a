"""Smoke test for ``benchmarks/calibrate.py``: a tiny grid, W in {1, 2}, one server.

Checks only that the benchmark runs end to end and writes its JSON (rows for both W) and PNG;
no timing assertions (the numbers depend on the machine and its load).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "benchmarks" / "calibrate.py"


def test_bench_calibrate_smoke(tmp_path):
    pytest.importorskip("matplotlib")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p))
    cmd = [sys.executable, str(SCRIPT), "--workers", "1,2", "--servers", "1", "--max-bytes", "65536",
           "--out-dir", str(tmp_path), "--timeout", "100"]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=str(REPO), env=env)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"benchmarks/calibrate.py did not finish in 120 s\n--- stdout ---\n{exc.stdout}"
                    f"\n--- stderr ---\n{exc.stderr}")
    output = (f"exit code {proc.returncode}\n--- stdout ---\n{proc.stdout[-6000:]}"
              f"\n--- stderr ---\n{proc.stderr[-3000:]}")

    json_path, png_path = tmp_path / "calibrate.json", tmp_path / "calibrate.png"
    assert json_path.exists(), output
    assert png_path.exists() and png_path.stat().st_size > 0, output
    data = json.loads(json_path.read_text())
    assert {r["workers"] for r in data["rows"]} == {1, 2}, output
    assert all(r["servers"] == 1 for r in data["rows"]), output
    assert {r["bytes"] for r in data["rows"]} == {1024, 4096, 16384, 65536}, output
    assert all(r["time_s"] > 0 and r["fit_s"] > 0 for r in data["rows"]), output
    assert {(f["workers"], f["servers"]) for f in data["fits"]} == {(1, 1), (2, 1)}, output
    assert data["machine"]["nproc"] >= 1 and "date" in data["machine"], output
    assert proc.returncode == 0 and not data["failures"], output
