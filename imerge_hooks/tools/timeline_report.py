"""Where does a measured iteration go? A text report of an ``IMERGE_TIMELINE`` trace.

    imerge-timeline-report trace.json [--links links.json] [--link-rate 125e6] [--json out.json]
    python -m imerge_hooks.tools.timeline_report trace.json ...   (the same)

For every worker and iteration (backward start to the next backward start) it splits the
time into backward, forward compute and the optimizer's waits, and separates the **first
wait** of the forward (for the front layers' results, the last gradients of the backward;
without overlap it is the step's wait for every group) from the rest. For every key it
measures the **push spread**: how far apart the workers pushed it; a synchronous server
completes a key only at its last push, so a wide spread means the server's egress idles while
its ingress is busy.

With ``--links`` (the link monitor's samples of the same launch; the trace records its
``monotonic_origin_s``, so both share the host's clock) it also reports, per phase of
worker 0's iteration, how busy the servers' ingress and egress were.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

_KEY = re.compile(r"key (\d+)")


def rates(samples: Sequence[tuple[float, list[tuple[int, int]]]], window_s: float
          ) -> list[tuple[float, list[float], list[float]]]:
    """(window start, upload B/s per host, download B/s per host) over consecutive windows of link
    byte-counter samples ``(time, [(tx bytes, rx bytes) per host])``."""
    out = []
    i = 0
    while i < len(samples) - 1:
        t0, a = samples[i]
        j = i + 1
        while j < len(samples) - 1 and samples[j][0] - t0 < window_s * 0.999:
            j += 1
        t1, b = samples[j]
        dt = t1 - t0
        if dt > 0:
            out.append((t0, [(y[0] - x[0]) / dt for x, y in zip(a, b)], [(y[1] - x[1]) / dt for x, y in zip(a, b)]))
        i = j
    return out


def load_trace(path: str | Path) -> tuple[dict[str, list[dict]], float | None]:
    """Complete events per track name, and the trace's monotonic origin (None if not recorded)."""
    doc = json.loads(Path(path).read_text())
    events = doc["traceEvents"] if isinstance(doc, dict) else doc
    origin = doc.get("otherData", {}).get("monotonic_origin_s") if isinstance(doc, dict) else None
    names = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e["name"] == "process_name"}
    tracks: dict[str, list[dict]] = defaultdict(list)
    for e in events:
        if e.get("ph") == "X":
            tracks[names.get(e["pid"], str(e["pid"]))].append(e)
    for evs in tracks.values():
        evs.sort(key=lambda e: e["ts"])
    return tracks, origin


def _workers(tracks: dict[str, list[dict]]) -> list[str]:
    return sorted((t for t in tracks if t.startswith("worker ")), key=lambda t: int(t.split()[1]))


def _backward(tracks: dict[str, list[dict]], worker: str) -> list[dict]:
    """The worker's backward spans, one per iteration, in time order."""
    return [e for e in tracks[worker] if e["cat"] == "backward"]


def iterations(tracks: dict[str, list[dict]], worker: str) -> list[dict[str, float]]:
    """Per iteration of one worker (seconds): start (trace clock), iteration, backward,
    forward compute, waits, first wait, and the last result's arrival after backward ended."""
    evs = tracks[worker]
    backward = _backward(tracks, worker)
    out = []
    for cur, nxt in zip(backward, backward[1:]):
        b0, b1, end = cur["ts"], cur["ts"] + cur["dur"], nxt["ts"]
        waits = [e for e in evs if e["cat"] == "wait" and b1 <= e["ts"] < end]
        comm = [e for e in evs if e["cat"] == "comm" and b0 <= e["ts"] < end]
        wait_s = sum(e["dur"] for e in waits) / 1e6
        out.append({
            "start_s": b0 / 1e6,
            "iteration_s": (end - b0) / 1e6,
            "backward_s": cur["dur"] / 1e6,
            "forward_compute_s": (end - b1) / 1e6 - wait_s,
            "wait_s": wait_s,
            "first_wait_s": waits[0]["dur"] / 1e6 if waits else 0.0,
            "last_result_after_backward_s": (max(e["ts"] + e["dur"] for e in comm) - b1) / 1e6 if comm else 0.0,
        })
    return out


def push_spread(tracks: dict[str, list[dict]], iteration: int) -> list[dict[str, Any]]:
    """Per key pushed in ``iteration`` (counted per worker): first and last push relative to
    the earliest backward start of that iteration, the spread, and the last result."""
    pushes: dict[int, list[tuple[float, float]]] = defaultdict(list)
    names: dict[int, str] = {}
    starts = []
    for w in _workers(tracks):
        backward = _backward(tracks, w)
        if iteration + 1 >= len(backward):
            return []
        b0, end = backward[iteration]["ts"], backward[iteration + 1]["ts"]
        starts.append(b0)
        for e in tracks[w]:
            if e["cat"] == "comm" and b0 <= e["ts"] < end:
                key = int(_KEY.search(e["name"]).group(1))
                pushes[key].append((e["ts"], e["ts"] + e["dur"]))
                names[key] = e["name"]
    t0 = min(starts)
    rows = []
    for key in sorted(pushes):
        p = pushes[key]
        first, last = min(s for s, _ in p) - t0, max(s for s, _ in p) - t0
        rows.append({"key": key, "name": names[key], "workers": len(p), "first_push_s": first / 1e6,
                     "last_push_s": last / 1e6, "spread_s": (last - first) / 1e6,
                     "last_result_s": (max(d for _, d in p) - t0) / 1e6})
    return rows


def link_phases(tracks: dict[str, list[dict]], origin: float, samples: list, link_Bps: float,
                iteration: int) -> list[dict[str, Any]]:
    """Mean utilisation of the servers' ingress and egress in worker 0's backward and forward
    of ``iteration``, and the fraction of samples in which the egress idled (< 10%) while the
    ingress was busy (> 80%). Hosts 0..W-1 are the workers, then the servers (as in run.py)."""
    W = len(_workers(tracks))
    backward = _backward(tracks, "worker 0")
    b0 = origin + backward[iteration]["ts"] / 1e6
    b1 = b0 + backward[iteration]["dur"] / 1e6
    end = origin + backward[iteration + 1]["ts"] / 1e6
    phases = []
    for label, lo, hi in (("backward", b0, b1), ("forward", b1, end)):
        ins, outs, idle_egress = [], [], 0
        for t, upload, download in rates(samples, 0.0):  # between consecutive samples
            if not lo <= t < hi:
                continue
            rin = statistics.fmean(download[W:]) / link_Bps
            rout = statistics.fmean(upload[W:]) / link_Bps
            ins.append(rin)
            outs.append(rout)
            idle_egress += rin > 0.8 and rout < 0.1
        if ins:
            phases.append({"phase": label, "seconds": hi - lo, "server_ingress": statistics.fmean(ins),
                           "server_egress": statistics.fmean(outs),
                           "egress_idle_while_ingress_busy": idle_egress / len(ins)})
    return phases


def report(trace: str | Path, links: str | Path | None = None, link_Bps: float = 125e6) -> dict[str, Any]:
    tracks, origin = load_trace(trace)
    workers = _workers(tracks)
    if not workers:
        raise ValueError(f"{trace}: no worker tracks (is this an IMERGE_TIMELINE trace?)")
    per_worker = {w: iterations(tracks, w) for w in workers}
    n = min(len(v) for v in per_worker.values())
    if n == 0:
        raise ValueError(f"{trace}: fewer than two iterations per worker")
    fields = [k for k in per_worker[workers[0]][0] if k != "start_s"]
    mean_iters = [{k: statistics.fmean(per_worker[w][i][k] for w in workers) for k in fields} for i in range(n)]
    doc: dict[str, Any] = {"trace": str(trace), "workers": len(workers), "iterations": mean_iters}
    last = n - 1  # the last complete iteration: warm, and its neighbours exist
    spread = push_spread(tracks, last)
    doc["push_spread"] = spread
    if spread:
        doc["push_spread_summary"] = {"iteration": last, "keys": len(spread),
                                      "median_s": statistics.median(r["spread_s"] for r in spread),
                                      "max_s": max(r["spread_s"] for r in spread)}
    if links is not None:
        if origin is None:
            raise ValueError(f"{trace} has no monotonic_origin_s (written by an older IMerge); cannot align links")
        doc["links"] = link_phases(tracks, origin, json.loads(Path(links).read_text()), link_Bps, last)
    return doc


def format_report(doc: dict[str, Any]) -> str:
    lines = [f"{doc['trace']}: {doc['workers']} workers (means over workers, seconds)",
             "  it  iteration  backward  fwd compute  waits  first wait  last result after bw"]
    for i, it in enumerate(doc["iterations"]):
        lines.append(f"  {i:2d}  {it['iteration_s']:9.3f}  {it['backward_s']:8.3f}  {it['forward_compute_s']:11.3f}"
                     f"  {it['wait_s']:5.3f}  {it['first_wait_s']:10.3f}  {it['last_result_after_backward_s']:20.3f}")
    s = doc.get("push_spread_summary")
    if s:
        lines.append(f"  push spread over workers, iteration {s['iteration']}: median {s['median_s']:.3f} s, "
                     f"max {s['max_s']:.3f} s over {s['keys']} keys; widest:")
        for r in sorted(doc["push_spread"], key=lambda r: -r["spread_s"])[:5]:
            lines.append(f"    {r['name']}: pushed {r['first_push_s']:.2f}-{r['last_push_s']:.2f} s, "
                         f"last result {r['last_result_s']:.2f} s")
    for p in doc.get("links", []):
        lines.append(f"  links, worker 0's {p['phase']} ({p['seconds']:.2f} s): server ingress "
                     f"{100 * p['server_ingress']:.0f}%, egress {100 * p['server_egress']:.0f}%, egress idle "
                     f"while ingress busy {100 * p['egress_idle_while_ingress_busy']:.0f}% of the time")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace")
    ap.add_argument("--links", help="link monitor samples of the same launch (<tag>.links.json)")
    ap.add_argument("--link-rate", type=float, default=125e6, help="bytes/s of one link direction")
    ap.add_argument("--json", help="also write the report here")
    args = ap.parse_args(argv)
    doc = report(args.trace, args.links, args.link_rate)
    print(format_report(doc))
    if args.json:
        Path(args.json).write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
