"""The plan cache: the key changes with everything a plan depends on and nothing else, and a kept plan
comes back whole (``plan/cache.py``; the engine's use of it runs in every planned multi-process test,
whose jobs share one cost-model cache folder)."""

from __future__ import annotations

import dataclasses

from imerge_hooks.config import Config
from imerge_hooks.plan.cache import load_plan, plan_key, plan_path, store_plan
from imerge_hooks.plan.costmodel import LinearModel
from imerge_hooks.plan.planner import Plan

TENSORS = [("fc.weight", 4096, "float32", True), ("fc.bias", 64, "float32", True), ("emb", 800, "float32", False)]


def key(**changes) -> str:
    args = dict(tensors=TENSORS, cfg=Config(schedule="imerge"), workers=4, servers=2, hosts=[0, 1, 2, 3, 4, 5],
                aggregate=False, model=LinearModel(1e-4, 1e-9))
    args.update(changes)
    return plan_key(**args)


def test_the_key_follows_what_a_plan_depends_on():
    base = key()
    assert key() == base
    assert key(workers=8) != base and key(servers=4) != base
    assert key(hosts=[0, 0, 1, 1, 2, 3]) != base and key(aggregate=True) != base
    assert key(model=LinearModel(2e-4, 1e-9)) != base
    assert key(cfg=Config(schedule="imerge", partition_bytes=1 << 20)) != base
    assert key(cfg=Config(schedule="adaptive-ps")) != base
    assert key(tensors=TENSORS[:2] + [("emb", 800, "float32", True)]) != base  # unfrozen
    assert key(cfg=Config(schedule="imerge", timeout_s=5.0)) == base  # not read by the search


def test_a_kept_plan_comes_back_whole(tmp_path):
    plan = Plan(groups=[[0, 1], [2]], predicted_end=0.5, method="optimal", group_start=[0.0, 0.1],
                group_end=[0.2, 0.5], note="chosen by simulation", partition_bytes=1 << 20, stagger=False)
    k = key()
    path = plan_path(str(tmp_path / "psmodel-{workers}.json"), k)
    assert load_plan(path, k) is None
    store_plan(path, k, [2, 1, 0], plan, 1)
    order, got, tail = load_plan(path, k)
    assert (order, tail) == ([2, 1, 0], 1) and dataclasses.asdict(got) == dataclasses.asdict(plan)
    assert load_plan(path, key(workers=8)) is None  # a file under another key is not this plan
    with open(path, "w") as f:
        f.write("{not json")
    assert load_plan(path, k) is None
