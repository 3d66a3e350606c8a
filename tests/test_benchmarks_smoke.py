"""The benchmarks run end to end (tiny sizes, few rounds); no timing is asserted."""

from __future__ import annotations

import json

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
    assert data["machine"]["nproc"] >= 1 and data["machine"]["mpi_library"]
    assert "ratio" in run.stdout and "64 KiB" in run.stdout
