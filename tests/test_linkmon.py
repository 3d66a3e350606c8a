"""The link monitor's summary (benchmarks/netlab/linkmon.py) on hand-made counter samples."""

from __future__ import annotations

import pytest

from benchmarks.netlab.linkmon import summarize
from imerge_hooks.tools.timeline_report import rates

LINK = 100.0  # bytes/s


def samples(steps: list[tuple[list[float], list[float]]], dt: float = 0.5):
    """Cumulative (upload, download) counters per host from per-step rates."""
    out, t, up, down = [], 0.0, None, None
    for rate_up, rate_down in [([0.0] * len(steps[0][0]), [0.0] * len(steps[0][1]))] + steps:
        up = [0.0] * len(rate_up) if up is None else [u + r * dt for u, r in zip(up, rate_up)]
        down = [0.0] * len(rate_down) if down is None else [d + r * dt for d, r in zip(down, rate_down)]
        out.append((t, [(int(round(u)), int(round(d))) for u, d in zip(up, down)]))
        t += dt
    return out


def test_rates_per_window():
    s = samples([([10.0, 0.0], [0.0, 10.0])] * 4, dt=0.5)
    got = rates(s, 1.0)
    assert len(got) == 2
    assert got[0][1] == [10.0, 0.0] and got[0][2] == [0.0, 10.0]


def test_summary_of_an_uneven_incast():
    """Hosts 0, 1 are workers pushing 75 and 25 B/s into server host 2 (saturated), which sends
    50 B/s of results back to each worker; then a phase where only worker 1 pushes (not counted
    in the dispersion: not every worker pushes)."""
    incast = ([75.0, 25.0, 0.0], [0.0, 0.0, 100.0])  # (upload per host, download per host)
    incast_up_results = ([75.0, 25.0, 50.0], [25.0, 25.0, 100.0])
    alone = ([0.0, 100.0, 0.0], [0.0, 0.0, 100.0])
    s = samples([incast, incast_up_results] * 3 + [alone, alone])
    got = summarize(s, workers=2, servers=1, link_Bps=LINK, window_s=0.5)
    assert got["span_s"] == pytest.approx(4.0)
    assert got["server_ingress_saturated_fraction"] == pytest.approx(1.0)
    # egress while saturated: 0, 50, 0, 50, 0, 50, 0, 0 B/s
    assert got["server_egress_utilisation_while_ingress_saturated"] == pytest.approx(150 / 8 / LINK)
    assert got["dispersion_windows"] == 6
    assert got["worker_push_cv"] == pytest.approx(0.5)  # rates 1.5x and 0.5x the mean
    assert got["connection_share_cv"] == pytest.approx(0.5)  # one server
    assert got["worker_push_lag1_correlation"] == pytest.approx(1.0, abs=0.01)  # the same worker stays ahead
    assert got["share_period_s"] > 10 * got["span_s"]  # never decorrelates within the run
    assert got["upload_utilisation"][0] == pytest.approx(75 * 6 * 0.5 / 4.0 / LINK)


def test_too_few_samples():
    assert summarize([(0.0, [(0, 0)])], 1, 1, LINK)["samples"] == 1
