"""imerge_hooks.tools.timeline_report (the imerge-timeline-report command) on a hand-made trace and link samples."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from imerge_hooks.tools import timeline_report  # noqa: E402

RATE = 100e6  # bytes/s of one link direction


def _span(pid, cat, name, start_s, end_s):
    return {"ph": "X", "pid": pid, "tid": 0, "cat": cat, "name": name, "ts": start_s * 1e6,
            "dur": (end_s - start_s) * 1e6}


def _trace(tmp_path: Path) -> Path:
    """Two workers, one server; three iterations of 2 s: backward 1 s, then a forward whose first
    wait is 0.3 s (worker 0) / 0.5 s (worker 1). Key 7 is pushed by worker 0 at 0.1 s and by
    worker 1 at 0.6 s of each iteration; key 8 by both at 0.9 s."""
    events = [{"ph": "M", "name": "process_name", "pid": p, "args": {"name": n}}
              for p, n in enumerate(["worker 0", "worker 1", "server 0"])]
    for it in range(3):
        t = 2.0 * it
        for pid, (first_wait, push7) in enumerate([(0.3, 0.1), (0.5, 0.6)]):
            events.append(_span(pid, "backward", "backward", t, t + 1.0))
            events.append(_span(pid, "wait", "wait+update Linear", t + 1.0, t + 1.0 + first_wait))
            events.append(_span(pid, "wait", "wait+update Linear", t + 1.6, t + 1.7))
            events.append(_span(pid, "forward", "forward Linear", t + 1.0, t + 1.9))
            events.append(_span(pid, "comm", "push+pull key 7 -> server 0", t + push7, t + 1.2))
            events.append(_span(pid, "comm", "push+pull key 8 -> server 0", t + 0.9, t + 1.1))
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": events, "otherData": {"monotonic_origin_s": 100.0}}))
    return path


def _links(tmp_path: Path) -> Path:
    """Samples every 0.1 s from 100 s: the server (host 2) downloads at the full rate and uploads
    nothing while worker 0's backward of iteration 1 runs (102-103 s), then the reverse."""
    samples, up, down = [], 0.0, 0.0
    for i in range(61):
        t = 100.0 + 0.1 * i
        samples.append([t, [[0, 0], [0, 0], [int(up), int(down)]]])  # per host: (port rx, port tx)
        if 102.0 <= t < 103.0 - 1e-9:
            down += RATE * 0.1
        elif 103.0 - 1e-9 <= t < 104.0 - 1e-9:
            up += RATE * 0.1
    path = tmp_path / "links.json"
    path.write_text(json.dumps(samples))
    return path


def test_iterations_split_into_backward_forward_and_waits(tmp_path):
    doc = timeline_report.report(_trace(tmp_path))
    assert doc["workers"] == 2 and len(doc["iterations"]) == 2
    it = doc["iterations"][1]
    assert it["iteration_s"] == pytest.approx(2.0)
    assert it["backward_s"] == pytest.approx(1.0)
    assert it["wait_s"] == pytest.approx((0.3 + 0.1 + 0.5 + 0.1) / 2)
    assert it["first_wait_s"] == pytest.approx((0.3 + 0.5) / 2)
    assert it["forward_compute_s"] == pytest.approx(1.0 - 0.5)
    assert it["last_result_after_backward_s"] == pytest.approx(0.2)


def test_push_spread_is_first_to_last_push_of_a_key(tmp_path):
    doc = timeline_report.report(_trace(tmp_path))
    spread = {r["key"]: r for r in doc["push_spread"]}
    assert spread[7]["spread_s"] == pytest.approx(0.5) and spread[7]["workers"] == 2
    assert spread[8]["spread_s"] == pytest.approx(0.0)
    assert spread[7]["last_result_s"] == pytest.approx(1.2)
    assert doc["push_spread_summary"]["max_s"] == pytest.approx(0.5)


def test_link_phases_align_on_the_recorded_origin(tmp_path):
    doc = timeline_report.report(_trace(tmp_path), _links(tmp_path), link_Bps=RATE)
    backward, forward = doc["links"]
    assert backward["phase"] == "backward" and forward["phase"] == "forward"
    assert backward["server_ingress"] == pytest.approx(1.0, abs=0.02)
    assert backward["server_egress"] == pytest.approx(0.0, abs=0.02)
    assert backward["egress_idle_while_ingress_busy"] == pytest.approx(1.0)
    assert forward["server_ingress"] == pytest.approx(0.0, abs=0.02)
    assert forward["server_egress"] == pytest.approx(1.0, abs=0.02)
    assert forward["egress_idle_while_ingress_busy"] == 0.0
    assert "egress idle while ingress busy 100%" in timeline_report.format_report(doc)


def test_a_trace_without_origin_cannot_be_aligned(tmp_path):
    path = _trace(tmp_path)
    doc = json.loads(path.read_text())
    del doc["otherData"]
    path.write_text(json.dumps(doc))
    with pytest.raises(ValueError, match="monotonic_origin_s"):
        timeline_report.report(path, _links(tmp_path))
