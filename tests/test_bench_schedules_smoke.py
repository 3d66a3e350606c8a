"""Smoke test for ``benchmarks/schedules.py``: one round of ``default`` and ``imerge`` with S=1, tiny sizes.

Checks only that the benchmark runs end to end (cost model, two launches of
``examples/resnet_synthetic.py``) and writes its JSON and text table; no timing assertions (the
numbers depend on the machine and its load).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "benchmarks" / "schedules.py"


@pytest.mark.timeout(360)  # the subprocess's own 300 s limit fires first, with the output so far
def test_bench_schedules_smoke(tmp_path):
    pytest.importorskip("torchvision")
    out = tmp_path / "schedules.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p))
    cmd = [sys.executable, str(SCRIPT), "--servers", "1", "--rounds", "1", "--schedules", "default,imerge",
           "--image-size", "32", "--batch-size", "2", "--iters", "2", "--warmup", "3", "--timeout", "150",
           "--out", str(out), "--cache-dir", str(tmp_path / "cache"), "--calib-max-bytes", str(1 << 16)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=str(REPO), env=env)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"benchmarks/schedules.py did not finish in 300 s\n--- stdout ---\n{exc.stdout}"
                    f"\n--- stderr ---\n{exc.stderr}")
    output = (f"exit code {proc.returncode}\n--- stdout ---\n{proc.stdout[-6000:]}"
              f"\n--- stderr ---\n{proc.stderr[-3000:]}")

    assert out.exists(), output
    assert out.with_suffix(".txt").exists(), output
    data = json.loads(out.read_text())
    assert data["args"]["servers"] == [1] and data["args"]["rounds"] == 1, output
    assert data["args"]["schedules"] == ["default", "imerge"], output
    assert "schedules.py" in data["command"], output
    assert data["machine"]["nproc"] >= 1 and "date" in data["machine"], output

    runs = data["runs"]
    assert sorted(r["schedule"] for r in runs) == ["default", "imerge"], output
    for r in runs:
        assert r["servers"] == 1 and r["workers"] == 2 and r["round"] == 0, output
        assert r["ok"] and r["samples_per_s"] > 0, output
        assert r["result"]["schedule"] == r["schedule"] and r["result"]["servers"] == 1, output
        assert r["result"]["workers"] == 2, output

    cell = data["summary"]["1"]
    assert set(cell) == {"default", "imerge"}, output
    assert cell["default"]["ratio_to_default"] == pytest.approx(1.0), output
    assert cell["imerge"]["ratio_to_default"] > 0 and len(cell["imerge"]["paired_ratios"]) == 1, output
    assert [c["servers"] for c in data["calibrations"]] == [1], output
    assert "S=1 samples/s" in proc.stdout and "imerge" in data["table"], output
    assert proc.returncode == 0 and not data["failures"], output
