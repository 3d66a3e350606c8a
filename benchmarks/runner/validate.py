"""The simulator against the measurement: every measured run at W in ``--validate-workers``
predicted with the plan it ran, on the links alone, with the emulator's fabric cap, and with
uneven incast sharing as the link monitor saw it; the errors, printed and recorded."""

from __future__ import annotations

import statistics
from typing import TYPE_CHECKING

from benchmarks.runner.emulator_check import measured_shares, transfer_class
from benchmarks.runner.grid import log
from benchmarks.runner.predict import simulate_one, startup_of, validation_plan
from benchmarks.runner.report import table_text

if TYPE_CHECKING:
    from benchmarks.runner.document import Bench

SHARE_SEEDS = 3  # the uneven-sharing prediction is the mean over this many draws of the shares


def validate_simulator(bench: Bench, psmodels: dict) -> None:
    """Predict every measured run at a validated W, record the rows (``validation``) and the share
    statistics (``shares``), and print one table per prediction variant. Nothing without measured runs."""
    if not bench.measured_runs:
        return
    val = validation_rows(bench, psmodels)
    bench.doc["validation"] = val
    print_validation(val, bench.args.models, bench.args.all_schedules)


def validation_rows(bench: Bench, psmodels: dict) -> list[dict]:
    """One row per measured run at W in ``--validate-workers``: measured and predicted seconds per
    iteration and the errors of each variant (fabric and sharing where the fabric was probed)."""
    args, doc = bench.args, bench.doc
    B, ts = args.bandwidth_Bps, args.time_scale
    val = []
    vw = [w for w in args.validate_workers if w in args.workers]
    shares = measured_shares(bench.measured_runs, bench.launches, vw, args)
    doc["shares"] = {f"{w}:{cls}": v for (w, cls), v in shares.items()}
    for (W, cls), (cv, period, src) in sorted(shares.items()):
        log(f"[links] W={W} {cls} pushes: connection share CV {cv:.2f}, period {period:.2f} s ({src})")
    for r in bench.measured_runs:
        if r["workers"] not in vw:
            continue
        W = r["workers"]
        psm = psmodels.get(W)
        st, src = startup_of(args, W, psmodels)
        S = bench.servers(W)
        plan, plan_source = validation_plan(r, S, ts, psm)
        p = simulate_one(r["model"], W, S, r["schedule"], B, st, ts, cost_model=psm, plan=plan, goodput=args.goodput)
        row = {"model": r["model"], "workers": W, "schedule": r["schedule"], "measured_s": r["iteration_s"],
               "predicted_s": p.iteration_s, "error": (p.iteration_s - r["iteration_s"]) / r["iteration_s"],
               "startup_s": st, "startup_source": src, "measured_groups": r.get("groups"),
               "predicted_groups": len(p.groups), "plan": plan_source}
        fab = doc.get("fabric", {}).get(str(W))
        if fab:
            pf = simulate_one(r["model"], W, S, r["schedule"], B, st, ts, cost_model=psm,
                              fabric_Bps=fab["aggregate_Bps"], plan=plan, goodput=args.goodput)
            row.update(fabric_Bps=fab["aggregate_Bps"], predicted_fabric_s=pf.iteration_s,
                       error_fabric=(pf.iteration_s - r["iteration_s"]) / r["iteration_s"])
            share = shares.get((W, transfer_class(r["schedule"])))
            if share is not None:
                draws = [simulate_one(r["model"], W, S, r["schedule"], B, st, ts, cost_model=psm,
                                      fabric_Bps=fab["aggregate_Bps"], share=share[:2], plan=plan,
                                      seed=seed, goodput=args.goodput).iteration_s for seed in range(SHARE_SEEDS)]
                predicted = statistics.fmean(draws)
                row.update(share_cv=share[0], share_period_s=share[1], share_source=share[2],
                           predicted_share_s=predicted, predicted_share_draws_s=draws,
                           error_share=(predicted - r["iteration_s"]) / r["iteration_s"])
        val.append(row)
    return val


def print_validation(val: list[dict], models: list[str], schedules: list[str]) -> None:
    """Predicted / measured per model, W and schedule for each variant, and how many are within 15%."""
    variants = [("predicted_s", "error", "links only (the model of a real cluster)")]
    if any("error_fabric" in v for v in val):
        variants.append(("predicted_fabric_s", "error_fabric",
                         "links + the duplex fabric cap (netlab/duplex_probe.py)"))
    if any("error_share" in v for v in val):
        variants.append(("predicted_share_s", "error_share",
                         "links + fabric cap + uneven incast sharing (share CV and period from the link "
                         "monitor, per W and transfer class: partitioned or whole-group pushes)"))
    for key, err, what in variants if val else []:
        print(f"\n==== Simulator validation, {what}: predicted vs measured iteration time "
              "(error = pred/meas - 1; target |error| <= 15%) ====")
        for m in models:
            rows: dict = {}
            for v in val:
                if v["model"] == m and err in v:
                    rows.setdefault(v["workers"], {})[v["schedule"]] = v
            if rows:
                print()
                print(table_text(f"{m}: predicted / measured s (error)", rows, schedules,
                                 lambda v, w, c, key=key, err=err: f"{v[key]:.2f}/{v['measured_s']:.2f} "
                                                                   f"({100 * v[err]:+.0f}%)"))
        errs = [abs(v[err]) for v in val if err in v]
        within = sum(e <= 0.15 for e in errs)
        print(f"\n  {within}/{len(errs)} within 15%; median |error| {100 * statistics.median(errs):.0f}%, "
              f"max {100 * max(errs):.0f}%")
