"""IMERGE_TIMELINE writes one Chrome trace with a track per worker and per server."""

import json
import sys
import time
from collections import Counter
from pathlib import Path

from mpirun import run_mpi

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from imerge_hooks.tools import timeline_report  # noqa: E402

SCRIPT = Path(__file__).parent / "scripts" / "train_optimizer.py"


def test_timeline_has_worker_and_server_tracks(tmp_path):
    trace_path = tmp_path / "trace.json"
    started = time.monotonic()
    run_mpi(SCRIPT, 4, str(tmp_path / "final.pt"), "--schedule", "priority", servers=2, timeout=120,
            env={"IMERGE_TIMELINE": str(trace_path), "IMERGE_PARTITION_BYTES": "16384"}).check()
    finished = time.monotonic()
    doc = json.loads(trace_path.read_text())
    events = doc["traceEvents"]
    # The ranks share this host's monotonic clock: the origin lets link samples be aligned.
    assert started < doc["otherData"]["monotonic_origin_s"] < finished
    names = {e["pid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    assert sorted(names.values()) == ["server 0", "server 1", "worker 0", "worker 1"]
    spans = Counter((names[e["pid"]], e["cat"]) for e in events if e["ph"] == "X")
    for worker in ("worker 0", "worker 1"):
        assert spans[(worker, "forward")] >= 5 * 4  # 4 layers x 5 steps
        assert spans[(worker, "backward")] == 5
        assert spans[(worker, "comm")] > 0 and spans[(worker, "wait")] > 0
    assert spans[("server 0", "server")] > 0 and spans[("server 1", "server")] > 0
    assert all(e["dur"] >= 0 for e in events if e["ph"] == "X")

    report = timeline_report.report(trace_path)
    assert report["workers"] == 2 and len(report["iterations"]) == 4
    assert all(r["workers"] == 2 and r["spread_s"] >= 0 for r in report["push_spread"])
    assert all(r["last_result_s"] >= r["last_push_s"] for r in report["push_spread"])
