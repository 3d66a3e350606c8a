"""Two emulated hosts of two workers each (``IMERGE_HOST`` per rank, one machine): with host
aggregation every schedule and every front end still gives single-process full-batch parameters,
and join() with uneven data too. Servers stand one on each host (colocated, the layout most users
have). A worker that stops during its host's reduction is named with its host by
``test_fault_matrix.py`` (its ranks share one host, so they aggregate too).
"""

from __future__ import annotations

from pathlib import Path

import torch
from common import reference_train
from mpirun import cost_model_cache, run_mpi

SCRIPTS = Path(__file__).parent / "scripts"
HOSTS = ["h0", "h0", "h1", "h1", "h0", "h1"]  # world ranks: 4 workers, then 2 servers
SCHEDULES = ("default", "wfbp", "priority", "threshold", "mgwfbp", "adaptive-ps", "imerge")
TOL = 1e-5
ENV = {"IMERGE_PROFILE_STEPS": "3", "IMERGE_FUSION_THRESHOLD_BYTES": "4000", "IMERGE_TIMEOUT_S": "120",
       "IMERGE_PARTITION_BYTES": "2000"}
CACHE = {"IMERGE_COST_MODEL_PATH": str(cost_model_cache() / "ps-{workers}w-{servers}s-{hosts}.json")}


def max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


def test_every_schedule_matches_full_batch_on_two_hosts(tmp_path):
    """Both front ends in one launch, a fresh model per run: DistributedOptimizer with every schedule,
    then DDP with ps_hook with every schedule but imerge (a DDP hook cannot overlap the forward)."""
    out = tmp_path / "{schedule}.pt"
    runs = list(SCHEDULES) + [f"{s}+hook" for s in SCHEDULES[:-1]]
    run = run_mpi(SCRIPTS / "train_optimizer.py", 6, str(out), "--schedule", ",".join(runs), "--steps", "6",
                  "--optimizer", "sgd", servers=2, hosts=HOSTS, timeout=300, env={**ENV, **CACHE}).check()
    assert [run.lines(r, "AGGREGATE")[0] for r in range(4)] == ["True h0", "True h0", "True h1", "True h1"]
    for spec in runs:
        got = torch.load(str(out).format(schedule=spec))
        assert max_diff(got, reference_train("sgd", 6)) <= TOL, spec


def test_lightning_every_schedule_matches_full_batch_on_two_hosts(tmp_path):
    """``Trainer(strategy=IMergeStrategy(schedule=...))``: automatic optimization for every schedule,
    manual optimization with ``imerge`` (zoo models, ``scripts/zoo_lightning.py``), one launch."""
    import zoo_models

    fits = [f"transformer-auto:{s}" for s in SCHEDULES] + ["gpt-manual:imerge"]
    run = run_mpi(SCRIPTS / "zoo_lightning.py", 6, str(tmp_path), "--runs", ",".join(fits), servers=2, hosts=HOSTS,
                  timeout=300, env={**ENV, **CACHE})
    names = [(f"transformer-auto-{s}", "transformer", "adam") for s in SCHEDULES]
    for name, model, optimizer in names + [("gpt-manual-imerge", "gpt", "sgd")]:
        path = tmp_path / f"{name}.pt"
        assert path.exists(), f"{name}: no result\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}" \
            f"\n{''.join(p.read_text() for p in tmp_path.glob(name + '.err.*'))[-3000:]}"
        ref = zoo_models.reference_train(model, optimizer)
        assert max_diff(torch.load(path), ref) <= TOL, name


def test_join_with_uneven_data_on_two_hosts(tmp_path):
    """Workers run out of data at different steps; joined ones shadow their hosts' rounds with zeros."""
    from test_uneven import SCRIPT as UNEVEN
    from test_uneven import reference

    counts = [5, 3, 4, 2]
    out = tmp_path / "final-{rank}.pt"
    run = run_mpi(UNEVEN, 6, str(out), "imerge", *map(str, counts), servers=2, hosts=HOSTS, timeout=150,
                  env={"IMERGE_JOIN_DIVISOR": "active", "IMERGE_PLAN_SEARCH": "0", "IMERGE_PROFILE_STEPS": "100"}
                  ).check()
    ref = reference(counts, "active")
    for rank in range(4):
        got = torch.load(str(out).format(rank=rank))
        assert max((got[k] - ref[k]).abs().max().item() for k in ref) <= 1e-5, rank
    assert all("last to join: 0" in run.ranks[r] for r in range(4))
