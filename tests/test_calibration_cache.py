"""The cost-model cache is keyed by what a measured model depends on and checked when loaded: a model
from another W, S, cluster, MPI, transport or IMerge version, an old one, or a file that is not what a
calibration writes is set aside with one warning and measured again."""

from __future__ import annotations

import glob
import json
import logging
import os
import time
from types import SimpleNamespace

import pytest

from imerge_hooks.core.config import Config
from imerge_hooks.plan import calibrate
from imerge_hooks.plan.calibrate import CACHE_MAX_AGE_DAYS, cache_path, cache_problem
from imerge_hooks.plan.costmodel import PSModel

GRID = [1024.0 * 4**k for k in range(5)]


def fingerprint(**changes) -> dict:
    base = {"workers": 4, "servers": 2, "hosts": ["a", "a", "b", "b", "a", "b"], "aggregate": True,
            "mpi": "MPICH Version: 4.3.0", "transport": {"FI_PROVIDER": "tcp"}, "imerge": "0.9.0"}
    return base | changes


def model(fp: dict, created: float | None = None) -> PSModel:
    fitted = PSModel.fit(fp["workers"], fp["servers"], GRID, [1e-4 + m * 1e-9 for m in GRID])
    fitted.cluster, fitted.created = fp, time.time() if created is None else created
    return fitted


def test_a_model_for_this_cluster_is_used():
    fp = fingerprint()
    assert cache_problem(model(fp), fp, time.time()) is None


def test_another_w_s_cluster_mpi_or_version_is_refused():
    fp = fingerprint()
    assert "measured with 4 workers and 2 servers, this job has 8 and 2" in cache_problem(
        model(fp), fingerprint(workers=8), time.time())
    for change in ({"imerge": "1.0.0"}, {"mpi": "Open MPI v5.0.3"}, {"hosts": ["a", "a", "b", "b", "c", "c"]},
                   {"transport": {"FI_PROVIDER": "verbs"}}, {"aggregate": False}):
        problem = cache_problem(model(fp), fingerprint(**change), time.time())
        assert problem is not None and next(iter(change)) in problem, change


def test_an_old_or_unlabelled_model_is_refused():
    fp = fingerprint()
    old = time.time() - (CACHE_MAX_AGE_DAYS + 1) * 86400
    assert "days old" in cache_problem(model(fp, created=old), fp, time.time())
    now = time.time()
    assert "in the future" in cache_problem(model(fp, created=now + 2 * 86400), fp, now)  # its age is unknown
    assert cache_problem(model(fp, created=now + 60), fp, now) is None  # clocks of hosts sharing the folder
    assert "does not say which cluster" in cache_problem(PSModel.fit(4, 2, GRID, [1e-4] * 5), fp, time.time())


def test_the_file_name_follows_the_whole_fingerprint(tmp_path):
    template = str(tmp_path / "psmodel-{workers}w-{servers}s-{hosts}.json")
    fp = fingerprint()
    assert cache_path(template, fp) == cache_path(template, fingerprint())
    assert cache_path(template, fp).startswith(str(tmp_path / "psmodel-4w-2s-"))
    assert cache_path(template, fingerprint(imerge="1.0.0")) != cache_path(template, fp)
    saved = model(fp)
    saved.to_json(cache_path(template, fp))
    again = PSModel.from_json(cache_path(template, fp))
    assert again.cluster == fp and again.created == saved.created


TIMES = [1e-4 + m * 1e-9 for m in GRID]


def written(**changes) -> dict:
    """What a calibration of fingerprint() writes (``measure``, then ``load_or_calibrate``), with ``changes``."""
    fp = fingerprint()
    fresh = PSModel.fit(fp["workers"], fp["servers"], GRID, TIMES, hosts=["a", "b"], measured=3)
    fresh.cluster, fresh.created = fp, time.time()
    return fresh.to_dict() | changes


@pytest.fixture
def job(tmp_path, monkeypatch):
    """``load_or_calibrate`` as worker 0 of a job on fingerprint() runs it, without MPI: the broadcast
    hands worker 0's value on, and a calibration (counted in ``calibrations``) returns a fresh model."""
    fp = fingerprint()
    cfg = Config(cost_model_path=str(tmp_path / "psmodel-{workers}w-{servers}s-{hosts}.json"))
    calibrations: list[float | None] = []

    def measure(sizes=None, budget_s=None) -> PSModel:
        calibrations.append(budget_s)
        return PSModel.fit(fp["workers"], fp["servers"], GRID, [2 * t for t in TIMES], hosts=["a", "b"])

    topology = SimpleNamespace(worker_rank=0, worker_comm=None)
    monkeypatch.setattr(calibrate, "session", SimpleNamespace(config=lambda: cfg, topology=lambda: topology))
    monkeypatch.setattr(calibrate, "collectives", SimpleNamespace(collective=lambda comm, op, value, what: value))
    monkeypatch.setattr(calibrate, "cluster_fingerprint", lambda: fp)
    monkeypatch.setattr(calibrate, "measure", measure)
    return SimpleNamespace(cfg=cfg, path=cache_path(cfg.cost_model_path, fp), calibrations=calibrations)


def write(path: str, content) -> str:
    text = content if isinstance(content, str) else json.dumps(content)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)
    return text


def warnings_of(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "imerge" and r.levelno >= logging.WARNING]


def test_a_cached_model_is_taken_without_calibrating(job, caplog):
    content = written()
    write(job.path, content)
    got = calibrate.load_or_calibrate()
    assert got.to_dict() == content and job.calibrations == [] and not warnings_of(caplog)


DAY = 86400.0
CORRUPT = {  # id: (the file's text or content, what the warning says)
    "created not a number": (written(created="abc"), "created is 'abc', not a finite number"),
    "created null": (written(created=None), "created is None, not a finite number"),
    "created NaN": (written(created=float("nan")), "created is nan, not a finite number"),
    "created in the future": (written(created=time.time() + 2 * DAY), "in the future"),
    "created long ago": (written(created=time.time() - (CACHE_MAX_AGE_DAYS + 1) * DAY), "days old"),
    "created zero": (written(created=0), "does not say when it was measured"),
    "deeply nested": ('{"created": ' + "[" * 100_000 + "]" * 100_000 + "}", "nested too deeply"),
    "not json": ("{not json", "not JSON"),
    "not an object": ([written()], "the file is a list, not an object"),
    "a field missing": ({k: v for k, v in written().items() if k != "measured"}, "lacks measured"),
    "an unknown field": (written(extra=[[[]]]), "unknown fields extra"),
    "another kind": (written(kind="LinearModel"), "kind is 'LinearModel'"),
    "workers a string": (written(workers="4"), "workers is '4', not an integer"),
    "workers a bool": (written(workers=True), "workers is True, not an integer"),
    "servers zero": (written(servers=0), "servers is 0, outside 1.."),
    "another W": (written(workers=8), "measured with 8 workers and 2 servers, this job has 4 and 2"),
    "sizes off the grid": (written(sizes=[1000.0 * 4**k for k in range(5)]), "calibration grid"),
    "sizes nested": (written(sizes=[GRID]), "calibration grid"),
    "times negative": (written(times=[-t for t in TIMES]), "finite, positive"),
    "times zero": (written(times=[0.0] * 5), "finite, positive"),
    "times short": (written(times=TIMES[:4]), "times are not 5 finite, positive numbers"),
    "times strings": (written(times=[str(t) for t in TIMES]), "finite, positive"),
    "measured zero": (written(measured=0), "measured is 0, outside 1..5"),
    "measured beyond the grid": (written(measured=9), "measured is 9, outside 1..5"),
    "startup not the fit": (written(a=1.0), "not the fit of its table"),
    "bandwidth not the fit": (written(bandwidth=1e300), "not the fit of its table"),
    "bandwidth infinite": (written(bandwidth=float("inf")), "bandwidth is inf, not a finite number"),
    "hosts not names": (written(hosts=[1, 2]), "hosts are not a list of host names"),
    "hosts of another job": (written(hosts=["a", "c"]), "not the workers' hosts ['a', 'b']"),
    "cluster not an object": (written(cluster="here"), "cluster is not an object"),
    "another cluster": (written(cluster=fingerprint(imerge="0.1.0")), "another cluster (differs in: imerge)"),
    "a cluster with more in it": (written(cluster=fingerprint() | {"x": 1}), "another cluster (differs in: x)"),
}


@pytest.mark.parametrize("content, reason", CORRUPT.values(), ids=CORRUPT.keys())
def test_a_bad_cost_model_file_is_set_aside_and_measured_again(job, caplog, content, reason):
    text = write(job.path, content)
    model = calibrate.load_or_calibrate()
    warnings = warnings_of(caplog)
    assert len(warnings) == 1 and job.path in warnings[0] and reason in warnings[0], warnings
    aside = glob.glob(job.path + ".invalid-*")
    assert len(aside) == 1 and aside[0] in warnings[0]
    with open(aside[0]) as f:
        assert f.read() == text  # kept for the user to inspect, under a name no reader opens
    assert job.calibrations == [calibrate.STARTUP_BUDGET_S] and model.times == [2 * t for t in TIMES]
    assert calibrate.load_or_calibrate().to_dict() == model.to_dict()  # the new calibration is the cache now
    assert len(job.calibrations) == 1 and len(warnings_of(caplog)) == 1


def test_without_calibration_a_bad_file_is_set_aside_and_the_job_told(job, caplog):
    job.cfg.calibrate = False
    write(job.path, written(created="abc"))
    with pytest.raises(RuntimeError, match="calibrate=False"):
        calibrate.load_or_calibrate()
    assert len(warnings_of(caplog)) == 1 and not os.path.exists(job.path) and glob.glob(job.path + ".invalid-*")
