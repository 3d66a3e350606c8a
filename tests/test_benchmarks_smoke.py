"""The benchmarks run end to end (tiny sizes, few rounds); no timing is asserted."""

from __future__ import annotations

import configparser
import json
import subprocess
import sys
from pathlib import Path

import pytest
from mpirun import REPO, run_mpi


def test_transport_benchmark_runs(tmp_path):
    out = tmp_path / "transport.json"
    run = run_mpi(REPO / "benchmarks" / "transport.py", 2, "--max", "64KiB", "--iters", "3", "--json", str(out),
                  timeout=60).check()
    data = json.loads(out.read_text())
    rows = data["rows"]
    assert [r["bytes"] for r in rows] == [4 << 10, 16 << 10, 64 << 10]
    for r in rows:
        assert r["raw_us"] > 0 and r["imerge_us"] > 0
        assert r["ratio"] > 0
        assert len(r["raw_sweeps"]) == len(r["imerge_sweeps"]) == data["args"]["sweeps"]
    assert data["machine"]["cpus"] >= 1 and data["machine"]["mpi_library"]
    assert data["machine"]["nproc"] >= 1  # the lab's own record of the machine, beside the tool's
    assert "ratio" in run.stdout and "64 KiB" in run.stdout


def _console_scripts() -> dict[str, str]:
    cfg = configparser.ConfigParser()
    cfg.read(REPO / "setup.cfg")
    lines = cfg["options.entry_points"]["console_scripts"].strip().splitlines()
    return dict(tuple(part.strip() for part in line.split("=")) for line in lines)


@pytest.mark.parametrize("name", ["imerge-timeline-report", "imerge-calibrate", "imerge-transport-check",
                                  "imerge-whatif"])
def test_user_tools_are_installed_commands(name):
    """The user tools the README names are installed next to this Python and answer --help (no MPI started)."""
    assert name in _console_scripts()
    exe = Path(sys.executable).parent / name
    assert exe.exists(), f"{name} is not installed beside {sys.executable}: pip install -e . (make test does)"
    proc = subprocess.run([str(exe), "--help"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "usage:" in proc.stdout, proc.stderr[-2000:]


def test_every_lab_script_imports_and_answers_help():
    """A refactor cannot silently break a lab script: every import any of them makes (function-local
    ones too) resolves, and every script with a command line answers --help."""
    run = subprocess.run([sys.executable, str(REPO / "tests" / "scripts" / "lab_scripts.py")], capture_output=True,
                         text=True, cwd=REPO, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    found = json.loads(run.stdout.strip().splitlines()[-1])
    assert found["checked"] >= 40 and found["problems"] == {}, found
