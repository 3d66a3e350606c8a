"""Is the emulator's duplex ceiling set by the CPUs or by the links? Probe it at several rates.

``duplex_probe.py`` makes every link of a W-worker, S-server lab busy both ways at once. If the
2 cores that run every rank's TCP stack were what limits it, the bytes per second it moves would
stay put as the link rate goes up (and reach the links' capacity at low rates). If the links
limit it, it moves a constant fraction of their capacity at every rate. The capacity is what the
servers' ports can carry: S ports x 2 directions x the rate x TCP goodput (1448 of every
1514 bytes); every byte of the probe crosses one of them.

    sudo .venv/bin/python benchmarks/netlab/fabric_scaling.py --rates 250mbit,500mbit,1gbit,2gbit

Prints a table and writes ``benchmarks/results/fabric-scaling.json`` (``--out``). Uses its own
lab prefix (``--prefix``, default ``imfabric``) and takes it down at the end.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.netlab import netlab as nl  # noqa: E402


def probe(workers: int, servers: int, rate: str, prefix: str, rounds: int) -> dict:
    """One duplex probe on a fresh lab at ``rate``: the probe's JSON plus the links' capacity."""
    cfg = nl.up(hosts=workers + servers, bandwidth=rate, prefix=prefix, force=True)
    out = nl.duplex_probe(workers, servers, prefix=prefix, rounds=rounds, timeout=900)
    capacity = 2 * servers * cfg.rate_bit / 8 * nl.GOODPUT
    out.update(rate=rate, rate_bit=cfg.rate_bit, capacity_Bps=capacity, fraction=out["aggregate_Bps"] / capacity)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--servers", type=int, default=2)
    ap.add_argument("--rates", default="250mbit,500mbit,1gbit,2gbit")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prefix", default="imfabric")
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "fabric-scaling.json"))
    args = ap.parse_args(argv)
    rows = []
    try:
        for rate in args.rates.split(","):
            row = probe(args.workers, args.servers, rate.strip(), args.prefix, args.rounds)
            rows.append(row)
            print(f"{row['rate']:>8}: moved {row['aggregate_Bps'] / 1e6:7.1f} MB/s of the servers' ports' "
                  f"{row['capacity_Bps'] / 1e6:7.1f} MB/s duplex TCP capacity = {100 * row['fraction']:.0f}%",
                  flush=True)
    finally:
        nl.down(args.prefix)
    Path(args.out).write_text(json.dumps({"workers": args.workers, "servers": args.servers, "rows": rows},
                                         indent=1))
    print(f"JSON: {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
