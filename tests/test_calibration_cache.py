"""The cost-model cache is keyed by what a measured model depends on and checked when loaded: a model
from another W, S, cluster, MPI, transport or IMerge version, or an old one, is measured again."""

from __future__ import annotations

import time

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
