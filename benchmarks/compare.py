"""IMerge against the all-reduce peers, from two runs of ``benchmarks/run.py``: S = W and S = W/2.

    python benchmarks/compare.py [--full results/bench.json] [--half results/bench-half.json]
                                 [--plot results/peers-throughput.png]

For every model and W, measured and simulated: samples/s of ``ddp``, ``ddp-tuned``,
``mpi-allreduce`` and ``imerge`` with S = W and with S = W/2, each with its own bound's
efficiency, and imerge's ratio to DDP. Measured cells whose emulator check failed carry a '!'.
The plot: samples/s against W, one panel per model, imerge at S = W and S = W/2 and DDP,
measured (solid) and simulated (dashed).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.runner.grid import PEERS  # noqa: E402

RESULTS = REPO / "benchmarks" / "results"
COLUMNS = PEERS + ("imerge S=W", "imerge S=W/2")


def cells(doc: dict, kind: str, imerge_label: str) -> dict:
    """{(model, W): {column: run}} of one run's measured or simulated runs."""
    runs = doc.get("measured", {}).get("runs", []) if kind == "measured" else doc.get("simulated", {}).get("runs", [])
    out: dict = {}
    for r in runs:
        column = imerge_label if r["schedule"] == "imerge" else r["schedule"] if r["schedule"] in PEERS else None
        if column:
            out.setdefault((r["model"], r["workers"]), {})[column] = r
    return out


def merged(full: dict, half: dict, kind: str) -> dict:
    out = cells(full, kind, "imerge S=W")
    for key, row in cells(half, kind, "imerge S=W/2").items():  # and the peers where only that run has them
        mine = out.setdefault(key, {})
        mine.update({c: r for c, r in row.items() if c == "imerge S=W/2" or c not in mine})
    return out


def table(rows: dict, kind: str) -> str:
    lines = [f"{kind}: samples/s (efficiency against the schedule's own bound); imerge S=W / ddp",
             f"{'model':<10}{'W':>3}" + "".join(f"{c:>20}" for c in COLUMNS) + f"{'ratio':>8}"]
    for (model, w) in sorted(rows, key=lambda k: (k[0], k[1])):
        row = rows[(model, w)]
        text = []
        for c in COLUMNS:
            r = row.get(c)
            if r is None:
                text.append("-")
                continue
            eff = f" ({100 * r['efficiency']:.0f}%)" if r.get("efficiency") else ""
            mark = "!" if r.get("emulator_ok") is False else ""
            text.append(f"{r['samples_per_s']:.2f}{mark}{eff}")
        ratio = (f"{row['imerge S=W']['samples_per_s'] / row['ddp']['samples_per_s']:.2f}x"
                 if "imerge S=W" in row and "ddp" in row else "-")
        lines.append(f"{model:<10}{w:>3}" + "".join(f"{t:>20}" for t in text) + f"{ratio:>8}")
    return "\n".join(lines)


def simulated_efficiency(doc: dict, rows: dict) -> None:
    """Simulated runs carry no bound: compute it as run.py does for measured ones."""
    from benchmarks.runner.grid import model_facts, physical_bound, servers_for

    config = doc.get("config", {})
    ts = config.get("time_scale", 1.0)
    bandwidth = config.get("bandwidth_Bps")
    for (model, w), row in rows.items():
        facts = model_facts(model, ts)
        for r in row.values():
            if bandwidth and "efficiency" not in r:
                servers = r.get("servers") or servers_for(str(config.get("servers", "W")), w)
                b = physical_bound(facts, w, max(1, servers), bandwidth, r["schedule"])
                r["efficiency"] = b["bound_s"] / r["iteration_s"]


def plot(measured: dict, simulated: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = sorted({m for m, _ in list(measured) + list(simulated)})
    fig, axes = plt.subplots((len(models) + 1) // 2, 2, figsize=(12, 4 * ((len(models) + 1) // 2)), squeeze=False)
    colours = {"imerge S=W": "C0", "imerge S=W/2": "C1", "ddp": "C3"}
    for ax, model in zip(axes.flat, models):
        for rows, style, kind in ((measured, "o-", "measured"), (simulated, "x--", "simulated")):
            for column, colour in colours.items():
                ws = sorted(w for (m, w), row in rows.items() if m == model and column in row)
                if ws:
                    ax.plot(ws, [rows[(model, w)][column]["samples_per_s"] for w in ws], style, color=colour,
                            label=f"{column} ({kind})")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("workers W")
        ax.set_ylabel("samples/s (cluster)")
        ax.set_title(model)
        ax.grid(True, which="both", alpha=0.3)
    for ax in list(axes.flat)[len(models):]:
        ax.axis("off")
    handles, labels = axes.flat[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=3, fontsize=8)
    fig.suptitle("IMerge (S = W and S = W/2) against DDP: measured (solid, emulated cluster), simulated (dashed)")
    fig.tight_layout(rect=(0, 0.08, 1, 0.96))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    ap.add_argument("--full", default=str(RESULTS / "bench.json"), help="the run with --servers W")
    ap.add_argument("--half", default=str(RESULTS / "bench-half.json"), help="the run with --servers W/2")
    ap.add_argument("--plot", default=str(RESULTS / "peers-throughput.png"))
    args = ap.parse_args(argv)
    full = json.loads(Path(args.full).read_text())
    half = json.loads(Path(args.half).read_text()) if Path(args.half).exists() else {}
    measured, simulated = merged(full, half, "measured"), merged(full, half, "simulated")
    for doc, mine in ((full, lambda c: c != "imerge S=W/2"), (half, lambda c: c == "imerge S=W/2")):
        if doc:
            simulated_efficiency(doc, {k: {c: r for c, r in row.items() if mine(c)} for k, row in simulated.items()})
    print(table(measured, "measured (emulated cluster)"))
    print()
    print(table(simulated, "simulated"))
    plot(measured, simulated, Path(args.plot))
    print(f"plot: {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
