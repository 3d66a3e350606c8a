"""Link monitor: the switch ports' byte counters, sampled during a launch.

Every host of the lab hangs off one switch port, so the port's counters are the host's
NIC traffic: the port *receives* what the host uploads and *transmits* what it downloads.
A thread reads all ports with one ``ip -s -j link`` in the switch namespace every
``interval_s`` (one small process per sample, cheap next to the ranks).

:func:`summarize` turns the samples into what a benchmark reader needs:

* per host, the mean rate and utilisation of each direction while the launch ran;
* for the servers, how often their ingress was saturated and how busy their egress was
  meanwhile (a synchronous PS can send a key's result only when the slowest worker has
  pushed it, so egress lags ingress when workers push at different rates);
* **share dispersion**: in windows where every server's ingress is saturated and every
  worker is pushing, the coefficient of variation of the workers' push rates and how long a
  worker keeps its rank (lag-1 autocorrelation -> correlation time). Max-min fair sharing
  would give CV 0; TCP through a shaped port does not. ``imerge_hooks.simulate`` takes these
  two numbers (``ClusterSpec.share_cv``, ``share_period_s``) to model uneven sharing.
"""

from __future__ import annotations

import json
import math
import statistics
import subprocess
import threading
import time
from collections.abc import Sequence

from imerge_hooks.tools.timeline_report import rates

from . import netlab as nl


class LinkMonitor:
    """Samples every switch port of lab ``prefix`` in a background thread (use as a context manager)."""

    def __init__(self, hosts: int, prefix: str = nl.DEFAULT_PREFIX, interval_s: float = 0.1) -> None:
        self.hosts = hosts
        self.prefix = prefix
        self.interval_s = interval_s
        self.samples: list[tuple[float, list[tuple[int, int]]]] = []  # (t, [(up, down) per host])
        self.errors = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="linkmon", daemon=True)
        self._cmd = [nl._tool("ip"), "-n", nl.switch_ns(prefix), "-s", "-j", "link"]

    def start(self) -> LinkMonitor:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5.0)

    def __enter__(self) -> LinkMonitor:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def sample(self) -> tuple[float, list[tuple[int, int]]] | None:
        proc = subprocess.run(self._cmd, capture_output=True, text=True, timeout=5)
        t = time.monotonic()
        if proc.returncode != 0 or not proc.stdout.strip():
            return None
        ports = {link["ifname"]: link["stats64"] for link in json.loads(proc.stdout)}
        row = []
        for i in range(self.hosts):
            st = ports.get(nl._port_name(i))
            if st is None:
                return None
            row.append((st["rx"]["bytes"], st["tx"]["bytes"]))  # port rx = host upload
        return t, row

    def _run(self) -> None:
        next_t = time.monotonic()
        while not self._stop.is_set():
            try:
                s = self.sample()
            except (OSError, ValueError, KeyError, subprocess.SubprocessError):
                s = None
            if s is None:
                self.errors += 1
            else:
                self.samples.append(s)
            next_t += self.interval_s
            self._stop.wait(max(0.0, next_t - time.monotonic()))


def summarize(samples: Sequence[tuple[float, list[tuple[int, int]]]], workers: int, servers: int,
              link_Bps: float, window_s: float = 0.5, saturated: float = 0.85) -> dict:
    """Utilisation per host and direction, and the dispersion of workers' push rates (see module doc).

    Hosts ``0..workers-1`` are workers and the next ``servers`` hosts are servers (run.py's layout).
    """
    if len(samples) < 3:
        return {"samples": len(samples), "note": "too few samples"}
    span = samples[-1][0] - samples[0][0]
    hosts = workers + servers
    total_up = [samples[-1][1][h][0] - samples[0][1][h][0] for h in range(hosts)]
    total_down = [samples[-1][1][h][1] - samples[0][1][h][1] for h in range(hosts)]
    wins = rates(samples, window_s)
    srv = range(workers, hosts)
    sat = [w for w in wins if all(w[2][s] >= saturated * link_Bps for s in srv)]
    egress_when_sat = [statistics.fmean(w[1][s] for s in srv) / link_Bps for w in sat]
    # dispersion: every server saturated and every worker pushing
    cvs, pairs = [], []
    prev: tuple[float, list[float]] | None = None
    for t, up, down in wins:
        push = up[:workers]
        mean = statistics.fmean(push)
        ok = (mean > 0 and all(x > 0.1 * mean for x in push)
              and all(down[s] >= saturated * link_Bps for s in srv))
        if not ok:
            prev = None
            continue
        norm = [x / mean for x in push]
        cvs.append(statistics.pstdev(norm))
        if prev is not None and t - prev[0] < 1.5 * window_s:
            pairs.extend(zip(prev[1], norm))
        prev = (t, norm)
    rho = _correlation(pairs) if len(pairs) >= 8 else None
    period = (window_s / -math.log(rho)) if rho is not None and 0 < rho < 1 else None
    return {
        "samples": len(samples), "span_s": span, "window_s": window_s, "link_Bps": link_Bps,
        "upload_utilisation": [b / span / link_Bps for b in total_up],
        "download_utilisation": [b / span / link_Bps for b in total_down],
        "server_ingress_saturated_fraction": len(sat) / len(wins) if wins else None,
        "server_egress_utilisation_while_ingress_saturated": statistics.fmean(egress_when_sat) if sat else None,
        "dispersion_windows": len(cvs),
        "worker_push_cv": statistics.fmean(cvs) if cvs else None,
        "worker_push_lag1_correlation": rho,
        "share_period_s": period,
        # a worker's push rate sums its S connections: connection CV ~ worker CV * sqrt(S)
        "connection_share_cv": statistics.fmean(cvs) * math.sqrt(servers) if cvs else None,
    }


def _correlation(pairs: list[tuple[float, float]]) -> float | None:
    xs = [p[0] for p in pairs]
    ys = [p[1] for p in pairs]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxy = sum((x - mx) * (y - my) for x, y in pairs)
    sxx = sum((x - mx) ** 2 for x in xs)
    syy = sum((y - my) ** 2 for y in ys)
    if sxx <= 0 or syy <= 0:
        return None
    return sxy / math.sqrt(sxx * syy)
