"""Smoke tests of ``benchmarks/run.py`` (the benchmark runner); no timing is asserted.

* ``test_simulated_tables_only``: ``--no-measure`` (no netlab, no root, always runs): the
  simulated fusion, schedule and speed-up tables land in the JSON, with the PNG plots.
* ``test_quick_measured_run``: ``--quick`` on the emulated cluster (alexnet, W=2, S=1,
  default + imerge, two timed iterations, plus one ``--timeline`` launch): skipped unless root and ``ip netns`` work
  (``benchmarks.netlab.netlab_available``). Uses its own netlab prefix and output folder.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "benchmarks" / "run.py"
PREFIX = "imlabbench"  # never the benchmarks' default "imlab"


def _env() -> dict:
    return dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p))


def _run(cmd: list[str], timeout: float) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=str(REPO), env=_env())
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"benchmarks/run.py did not finish in {timeout:.0f} s\n--- stdout ---\n{exc.stdout}"
                    f"\n--- stderr ---\n{exc.stderr}")


def _output(proc: subprocess.CompletedProcess) -> str:
    return f"exit code {proc.returncode}\n--- stdout ---\n{proc.stdout[-6000:]}\n--- stderr ---\n{proc.stderr[-4000:]}"


def test_simulated_tables_only(tmp_path):
    pytest.importorskip("matplotlib")
    proc = _run([sys.executable, str(SCRIPT), "--no-measure", "--models", "alexnet,resnet18", "--sim-workers", "4,8",
                 "--servers", "2", "--out-dir", str(tmp_path), "--name", "sim"], timeout=240)
    out = _output(proc)
    assert proc.returncode == 0, out
    data = json.loads((tmp_path / "sim.json").read_text())
    sim = data["tables"]["simulated"]
    for table in ("fusion", "schedules", "speedup"):
        assert set(sim[table]) == {"alexnet", "resnet18"}, out
    assert set(sim["fusion"]["alexnet"]) == {"4", "8"}
    assert set(sim["fusion"]["alexnet"]["8"]) == {"threshold", "mgwfbp", "adaptive-ps"}
    assert set(sim["schedules"]["resnet18"]["4"]) == {"ddp", "ddp-tuned", "mpi-allreduce", "default", "wfbp",
                                                      "priority", "mgwfbp", "imerge"}
    assert all(v > 0 for row in sim["schedules"]["alexnet"].values() for v in row.values())
    sp = sim["speedup"]["alexnet"]
    assert sp["one_worker_samples_per_s"] > 0 and sp["rows"]["8"]["linear"]["speedup"] == 8.0
    assert 0 < sp["rows"]["8"]["imerge"]["speedup"] <= 8.0 + 1e-9
    assert not data["measured"]["runs"]
    for p in data["plots"]:
        assert Path(p).exists() and Path(p).stat().st_size > 0
    for title in ("Table 1 - fusion schemes, alexnet", "Table 2 - schedules, resnet18", "Table 3 - speed-up"):
        assert title in proc.stdout, out


def _netlab_skip() -> str | None:
    # A measured run on the emulated cluster is a benchmark (minutes, 10+ processes on 2 cores):
    # opt in with IMERGE_NETLAB_TESTS=1. tests/test_netlab.py checks the emulated links in CI.
    if os.environ.get("IMERGE_NETLAB_TESTS") != "1":
        return "set IMERGE_NETLAB_TESTS=1 to run the measured emulated-cluster smoke run"
    if os.geteuid() != 0:
        return "needs root"
    try:
        from benchmarks.netlab import netlab as nl
    except ImportError as exc:  # pragma: no cover
        return f"netlab import failed: {exc}"
    return nl.netlab_available(prefix=PREFIX + "p")


_SKIP = _netlab_skip()


@pytest.mark.skipif(_SKIP is not None, reason=f"netlab unavailable: {_SKIP}")
def test_quick_measured_run(tmp_path):
    pytest.importorskip("mpi4py")
    pytest.importorskip("matplotlib")
    cmd = [sys.executable, str(SCRIPT), "--quick", "--models", "alexnet", "--workers", "2", "--servers", "1",
           "--schedules", "default,imerge", "--fusion-schedules", "", "--iters", "2", "--warmup", "1",
           "--profile-steps", "1", "--time-scale", "0.2", "--sim-workers", "4", "--validate-workers", "2",
           "--timeline", "alexnet:2:imerge", "--prefix", PREFIX, "--out-dir", str(tmp_path), "--name", "quick",
           "--job-timeout", "150"]
    try:
        proc = _run(cmd, timeout=240)
    finally:
        from benchmarks.netlab import netlab as nl

        nl.down(prefix=PREFIX)
    out = _output(proc)
    data = json.loads((tmp_path / "quick.json").read_text())
    assert proc.returncode == 0, out
    runs = data["measured"]["runs"]
    assert {r["schedule"] for r in runs} == {"default", "imerge"}, out
    for r in runs:
        assert r["workers"] == 2 and r["servers"] == 1 and r["samples_per_s"] > 0, out
        assert r["bound_s"] > 0 and r["efficiency"] > 0, out
    launch = data["measured"]["launches"][0]
    assert launch["rc"] == 0 and min(launch["veth_rx_bytes"]) > 244e6, out  # gradients crossed the veths
    meas = data["tables"]["measured"]
    assert meas["fusion"]["alexnet"] == {"2": {}}, out  # no fusion scheme asked for: an empty table
    assert set(meas["schedules"]["alexnet"]["2"]) == {"default", "imerge"}, out
    assert meas["speedup"]["alexnet"]["one_worker_samples_per_s"] > 0, out
    assert data["tables"]["simulated"]["schedules"]["alexnet"]["4"]["imerge"] > 0
    assert {v["schedule"] for v in data["validation"]} == {"default", "imerge"}, out
    assert data["measured"]["baseline"]["alexnet"]["schedule"] == "local", out
    tl = data["timeline"]
    assert Path(tl["measured_trace"]).exists() and Path(tl["simulated_trace"]).exists(), out
    assert json.loads(Path(tl["simulated_trace"]).read_text())["traceEvents"], out
    assert json.loads(Path(tl["measured_trace"]).read_text())["traceEvents"], out
    assert tl["report"]["workers"] == 2 and tl["report"]["iterations"], out  # timeline_report, links aligned
    # aligned with the link samples (a 0.1 s iteration may fall between two samples: phases may be missing)
    assert {p["phase"] for p in tl["report"]["links"]} <= {"backward", "forward"}, out
    assert "Table 2 - schedules, alexnet" in proc.stdout and "efficiency" in proc.stdout, out
    assert nl.list_namespaces(PREFIX) == []


def test_share_model_per_transfer_class():
    """The simulator's sharing CV is the median of the monitored runs of the same W and transfer
    class (partitioned or whole-group pushes); whole launches, then --share-cv, are the fallbacks."""
    from types import SimpleNamespace

    sys.path.insert(0, str(REPO))
    from benchmarks.runner.emulator_check import measured_shares, transfer_class

    assert transfer_class("imerge") == transfer_class("priority") == "partitioned"
    assert {transfer_class(s) for s in ("default", "wfbp", "threshold", "mgwfbp", "adaptive-ps")} == {"whole"}

    def links(cv: float, period: float | None = 1.0, windows: int = 10) -> dict:
        return {"connection_share_cv": cv, "share_period_s": period, "dispersion_windows": windows}

    runs = [{"workers": 8, "schedule": "imerge", "links": links(0.2, 0.4)},
            {"workers": 8, "schedule": "priority", "links": links(0.4, 0.6)},
            {"workers": 8, "schedule": "priority", "links": links(0.9, 0.6, windows=2)},  # too few windows
            {"workers": 8, "schedule": "default", "links": links(0.8, 2.0)},
            {"workers": 8, "schedule": "wfbp", "links": links(0.7, None)},  # no period measured
            {"workers": 4, "schedule": "wfbp", "links": links(0.5, 1.5)}]
    launches = [{"workers": 4, "links": links(0.45, 1.2)}]
    args = SimpleNamespace(share_cv=0.6, share_period=1.0)
    got = measured_shares(runs, launches, [4, 8, 16], args)
    assert got[(8, "partitioned")][:2] == pytest.approx((0.3, 0.5))
    assert got[(8, "whole")][:2] == pytest.approx((0.8, 2.0))
    assert got[(4, "whole")][:2] == pytest.approx((0.5, 1.5))
    assert got[(4, "partitioned")][:2] == pytest.approx((0.45, 1.2)) and "launches" in got[(4, "partitioned")][2]
    assert got[(16, "whole")] == (0.6, 1.0, "--share-cv/--share-period")
    assert (16, "whole") not in measured_shares(runs, launches, [16], SimpleNamespace(share_cv=None, share_period=1.0))


CALIBRATION = {"2": {"a_s": 2e-3, "bandwidth_Bps_per_server": 7e7, "startup_per_push_s": 1e-3,
                     "table": {"bytes": [1024.0, 4096.0, 16384.0], "time_s": [3.0e-3, 3.1e-3, 3.5e-3]}}}


def test_stored_calibration_stands_in_for_a_missing_cache():
    """A JSON's own ``calibration`` gives back the PS models it was made with (a fresh clone has no cache)."""
    sys.path.insert(0, str(REPO))
    from benchmarks.runner.predict import stored_psmodels

    got = stored_psmodels({**CALIBRATION, "8": {"table": None}}, lambda workers: 2)
    assert set(got) == {2}  # an unreadable entry is skipped
    model = got[2]
    assert (model.workers, model.servers, model.a, model.bandwidth) == (2, 2, 2e-3, 7e7)
    assert model.sizes == CALIBRATION["2"]["table"]["bytes"] and model.times == CALIBRATION["2"]["table"]["time_s"]


def test_resume_with_fewer_models_keeps_the_others(tmp_path):
    """``--resume --models M`` on a file that also holds other models' runs (as when one model's
    timeline is added to a grid) keeps those runs and computes their bound, instead of failing; with
    no cached PS model the file's own calibration is used."""
    runs = [{"model": m, "schedule": "default", "workers": 2, "servers": 2, "batch_size": 8, "iters": 2,
             "iteration_s": s, "samples_per_s": 16 / s} for m, s in (("alexnet", 4.0), ("resnet18", 2.0))]
    config = {"servers": 2, "bandwidth": "1gbit", "time_scale": 1.0, "iters": 2, "warmup": 1, "profile_steps": 2,
              "rank_env": {}}
    (tmp_path / "res.json").write_text(json.dumps({"config": config, "measured": {"runs": runs},
                                                   "calibration": CALIBRATION}))
    proc = _run([sys.executable, str(SCRIPT), "--resume", "--no-measure", "--models", "alexnet", "--workers", "2",
                 "--servers", "2",
                 "--sim-workers", "4", "--validate-workers", "2", "--fusion-schedules", "", "--schedules", "default",
                 "--out-dir", str(tmp_path), "--name", "res"], timeout=240)
    out = _output(proc)
    assert proc.returncode == 0, out
    doc = json.loads((tmp_path / "res.json").read_text())
    kept = {r["model"]: r for r in doc["measured"]["runs"]}
    assert set(kept) == {"alexnet", "resnet18"}, out
    assert all(r["bound_s"] > 0 and r["efficiency"] > 0 for r in kept.values()), out
    assert doc["calibration"]["2"]["a_s"] == CALIBRATION["2"]["a_s"], out
    assert {v["startup_source"] for v in doc["validation"]} == {"calibrated W=2"}, out


def test_validation_simulates_the_installed_plan():
    """A run that reports the plan its engine installed is validated with that plan; older runs
    fall back to the engine's search re-derived on the calibrated model, or the schedule's own."""
    sys.path.insert(0, str(REPO))
    from benchmarks.runner.predict import simulate_one, validation_plan
    from imerge_hooks.simulate import ModelSpec

    installed = {"groups": [list(range(15, 16)), list(range(0, 15))], "partition_bytes": 1 << 20}
    run = {"model": "alexnet", "workers": 4, "schedule": "imerge", "plan": installed}
    assert validation_plan(run, 2, 1.0, None) == (installed, "installed")
    assert validation_plan({**run, "plan": None}, 2, 1.0, None) == (None, "the schedule's")  # no cost model
    assert validation_plan({**run, "schedule": "wfbp", "plan": None}, 2, 1.0, None) == (None, "the schedule's")
    spec = ModelSpec.from_profile_json(REPO / "benchmarks" / "profiles" / "alexnet-cpu.json")
    assert len(spec.tensor_bytes) == 16
    res = simulate_one("alexnet", 4, 2, "imerge", 125e6, 1e-4, 0.1, plan=installed)
    assert res.groups == installed["groups"]
    assert max(k.nbytes for k in res.keys) <= 1 << 20  # the installed partition size, not the default 4 MiB


def test_installed_plan_reports_groups_and_partition():
    from types import SimpleNamespace

    sys.path.insert(0, str(REPO))
    from benchmarks.worker_replay import installed_plan

    def engine(partition_limit: int | None, tail_keys: int = 0, tail_credit: int | None = 1 << 20) -> SimpleNamespace:
        policy = SimpleNamespace(stagger=True, waves=True, credit_bytes=8 << 20, server_credit_bytes=4 << 20,
                                 tail_credit_bytes=tail_credit)
        return SimpleNamespace(groups=[SimpleNamespace(members=[3, 2], tail_keys=tail_keys),
                                       SimpleNamespace(members=(1, 0), tail_keys=0)],
                               partition_limit=partition_limit, policy=policy)

    assert installed_plan(engine(2 << 20)) == {"groups": [[3, 2], [1, 0]], "partition_bytes": 2 << 20,
                                               "stagger": True, "waves": True, "credit_bytes": 8 << 20,
                                               "server_credit_bytes": 4 << 20, "tail_credit": False}
    assert installed_plan(engine(None))["partition_bytes"] is None
    assert installed_plan(engine(None, tail_keys=2))["tail_credit"] is True
    assert installed_plan(engine(None, tail_credit=None))["tail_credit"] is None
