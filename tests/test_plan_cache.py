"""The plan cache: the key changes with everything a plan depends on and nothing else, a kept plan
comes back whole, and a file that is not a plan the planner could have chosen for this job is set aside
with one warning, as if there were none (``plan/cache.py``; the engine's use of it runs in every planned
multi-process test, whose jobs share one cost-model cache folder)."""

from __future__ import annotations

import copy
import dataclasses
import glob
import json
import logging
import os

import pytest

from imerge_hooks.core.config import Config
from imerge_hooks.plan.cache import load_plan, plan_fit, plan_key, plan_path, store_plan
from imerge_hooks.plan.choice import choose_plan
from imerge_hooks.plan.costmodel import LinearModel
from imerge_hooks.plan.planner import Plan
from imerge_hooks.worker.schedule import tail_group

# Registration order; the head is float16 and ready first, the embedding is frozen.
TENSORS = [("fc.weight", 4096, "float32", True), ("fc.bias", 64, "float32", True), ("emb", 800, "float32", False),
           ("head.weight", 256, "float16", True)]
ORDER = [3, 1, 0]  # the trainable tensors in ready order
PLAN = Plan(groups=[[0], [1, 2]], predicted_end=0.5, method="optimal", group_start=[0.0, 0.2],
            group_end=[0.2, 0.5], note="chosen by simulation", partition_bytes=1 << 20, stagger=False)


def key(**changes) -> str:
    args = dict(tensors=TENSORS, cfg=Config(schedule="imerge"), workers=4, servers=2, hosts=[0, 1, 2, 3, 4, 5],
                aggregate=False, model=LinearModel(1e-4, 1e-9))
    args.update(changes)
    return plan_key(**args)


def fit(schedule: str = "imerge"):
    return plan_fit(TENSORS, Config(schedule=schedule))


def test_the_key_follows_what_a_plan_depends_on():
    base = key()
    assert key() == base
    assert key(workers=8) != base and key(servers=4) != base
    assert key(hosts=[0, 0, 1, 1, 2, 3]) != base and key(aggregate=True) != base
    assert key(model=LinearModel(2e-4, 1e-9)) != base
    assert key(cfg=Config(schedule="imerge", partition_bytes=1 << 20)) != base
    assert key(cfg=Config(schedule="adaptive-ps")) != base
    assert key(tensors=TENSORS[:2] + [("emb", 800, "float32", True)] + TENSORS[3:]) != base  # unfrozen
    assert key(cfg=Config(schedule="imerge", timeout_s=5.0)) == base  # not read by the search


def test_a_kept_plan_comes_back_whole(tmp_path, caplog):
    k = key()
    path = plan_path(str(tmp_path / "psmodel-{workers}.json"), k)
    assert load_plan(path, k, fit()) is None
    store_plan(path, k, ORDER, PLAN, 1)
    order, got, tail = load_plan(path, k, fit())
    assert (order, tail) == (ORDER, 1) and dataclasses.asdict(got) == dataclasses.asdict(PLAN)
    assert load_plan(path, k) is not None  # no parameter table: the file is checked for its own consistency
    assert not caplog.records


@pytest.mark.parametrize("schedule", ["imerge", "adaptive-ps", "mgwfbp", "threshold"])
def test_a_plan_the_planner_chose_is_taken(tmp_path, caplog, schedule):
    """What the planner returns (searched partition size and stagger, tail group) passes the checks."""
    cfg = Config(schedule=schedule)
    sizes, ready = [TENSORS[i][1] for i in ORDER], [0.0, 0.001, 0.002]
    chosen = choose_plan(sizes, ready, [TENSORS[i][0] for i in ORDER], LinearModel(1e-4, 1e-9), cfg, 4, 2,
                         dtypes=[TENSORS[i][2] for i in ORDER])
    tail = tail_group(chosen.groups, ready, LinearModel(1e-4, 1e-9), cfg.credit_bytes) \
        if cfg.traits.tail_credit else None
    k = key(cfg=cfg)
    path = plan_path(str(tmp_path / "psmodel.json"), k)
    store_plan(path, k, ORDER, chosen, tail)
    assert load_plan(path, k, fit(schedule)) == (ORDER, chosen, tail)
    assert not caplog.records


def test_a_plan_without_the_tail_credit_is_kept_without_a_tail_group(tmp_path, caplog):
    k = key()
    path = plan_path(str(tmp_path / "psmodel.json"), k)
    untailed = dataclasses.replace(PLAN, tail_credit=False)
    store_plan(path, k, ORDER, untailed, None)
    assert load_plan(path, k, fit()) == (ORDER, untailed, None)
    assert not caplog.records


def saved(**changes) -> dict:
    """What store_plan writes for ORDER, PLAN and tail group 1 under key(), with ``changes``
    (``plan.x``: a field of the plan)."""
    content = {"key": key(), "order": list(ORDER), "plan": dataclasses.asdict(PLAN), "tail": 1}
    for name, value in changes.items():
        where, field = (content["plan"], name[5:]) if name.startswith("plan_") else (content, name)
        where[field] = value
    return content


def without(field: str) -> dict:
    content = saved()
    (content["plan"] if field.startswith("plan_") else content).pop(field.removeprefix("plan_"))
    return content


CORRUPT = {  # id: (the file's text or content, schedule, what the warning says)
    "not json": ("{not json", "imerge", "not JSON"),
    "deeply nested": ("[" * 100_000 + "]" * 100_000, "imerge", "nested too deeply"),
    "not an object": ([1, 2], "imerge", "not an object"),
    "a field missing": (without("tail"), "imerge", "lacks tail"),
    "an unknown field": (saved(extra=1), "imerge", "unknown fields extra"),
    "a plan field missing": (without("plan_groups"), "imerge", "plan lacks groups"),
    "another key": (saved(key=key(workers=8)), "imerge", "another key"),
    "groups miss a position": (saved(plan_groups=[[0], [1]]), "imerge", "cover 2 of the 3 positions"),
    "groups out of range": (saved(plan_groups=[[0], [1, 5]]), "imerge", "position 5, outside 0..2"),
    "groups negative": (saved(plan_groups=[[-1], [1, 2]]), "imerge", "position -1, outside 0..2"),
    "groups duplicated": (saved(plan_groups=[[0], [1, 1], [2]]), "imerge", "once each"),
    "groups reordered": (saved(plan_groups=[[1, 2], [0]]), "imerge", "once each"),
    "groups not ints": (saved(plan_groups=[[0], [1, "2"]]), "imerge", "holds '2', not a position"),
    "groups not ints (float)": (saved(plan_groups=[[0], [1, 2.0]]), "imerge", "holds 2.0, not a position"),
    "groups nested too deep": (saved(plan_groups=[[[0]], [1, 2]]), "imerge", "holds [0], not a position"),
    "groups flat": (saved(plan_groups=[0, 1, 2]), "imerge", "groups[0] is not a non-empty list"),
    "groups not a list": (saved(plan_groups={"0": [0]}), "imerge", "plan.groups is not a list"),
    "an empty group": (saved(plan_groups=[[0], [], [1, 2]]), "imerge", "groups[1] is not a non-empty list"),
    "groups mix dtypes": (saved(plan_groups=[[0, 1], [2]]), "imerge", "mixes dtypes float16, float32"),
    "order repeats": (saved(order=[3, 1, 1]), "imerge", "trainable parameter indices once"),
    "order out of range": (saved(order=[3, 1, 9]), "imerge", "trainable parameter indices once"),
    "order has a frozen tensor": (saved(order=[3, 1, 0, 2]), "imerge", "trainable parameter indices once"),
    "order not ints": (saved(order=[3, 1, "0"]), "imerge", "order is not a list of integers"),
    "tail outside the groups": (saved(tail=2), "imerge", "tail is 2, outside 0..1"),
    "tail negative": (saved(tail=-1), "imerge", "tail is -1, outside 0..1"),
    "tail not an int": (saved(tail="1"), "imerge", "tail is '1', not an integer"),
    "tail missing where the schedule has one": (saved(tail=None), "imerge", "tail is None, not an integer"),
    "tail where the schedule has none": (saved(tail=1, plan_partition_bytes=None, plan_stagger=None), "adaptive-ps",
                                         "no tail group"),
    "partition 1 byte": (saved(plan_partition_bytes=1), "imerge", "partition_bytes is 1, outside 262144.."),
    "partition zero": (saved(plan_partition_bytes=0), "imerge", "partition_bytes is 0, outside"),
    "partition negative": (saved(plan_partition_bytes=-4096), "imerge", "partition_bytes is -4096, outside"),
    "partition huge": (saved(plan_partition_bytes=1 << 40), "imerge", f"partition_bytes is {1 << 40}, outside"),
    "partition not an int": (saved(plan_partition_bytes="4MiB"), "imerge", "not an integer"),
    "partition a bool": (saved(plan_partition_bytes=True), "imerge", "not an integer"),
    "partition where the schedule has none": (saved(tail=None, plan_stagger=None), "adaptive-ps",
                                              "does not partition"),
    "stagger a string": (saved(plan_stagger="no"), "imerge", "plan.stagger is 'no', not true, false or null"),
    "stagger a number": (saved(plan_stagger=0), "imerge", "plan.stagger is 0"),
    "stagger where the schedule has none": (saved(tail=None, plan_partition_bytes=None, plan_stagger=True),
                                            "adaptive-ps", "does not stagger"),
    "server window below a partition": (saved(plan_server_credit_bytes=1), "imerge",
                                        "plan.server_credit_bytes is 1, outside"),
    "server window past the search's": (saved(plan_server_credit_bytes=64 << 20), "imerge",
                                        "plan.server_credit_bytes is 67108864, outside"),
    "server window without a partition": (saved(tail=None, plan_partition_bytes=None, plan_stagger=None,
                                                plan_server_credit_bytes=1 << 20), "adaptive-ps",
                                          "server_credit_bytes is set without plan.partition_bytes"),
    "waves false": (saved(plan_waves=False), "imerge", "plan.waves is False, not true or null"),
    "waves without stagger": (saved(plan_waves=True), "imerge", "plan.waves is set but the plan does not stagger"),
    "tail credit true": (saved(plan_tail_credit=True), "imerge", "plan.tail_credit is True, not false or null"),
    "tail credit off with a tail": (saved(plan_tail_credit=False), "imerge", "tail is 1 but this plan's"),
    "tail credit off where the schedule has none": (saved(tail=None, plan_partition_bytes=None, plan_stagger=None,
                                                          plan_tail_credit=False), "adaptive-ps",
                                                    "plan.tail_credit is set but this schedule has no tail"),
    "method unknown": (saved(plan_method="fastest"), "imerge", "plan.method is 'fastest', not optimal"),
    "method of another planner": (saved(plan_method="threshold"), "imerge", "plan.method is 'threshold'"),
    "times missing one": (saved(plan_group_end=[0.2]), "imerge", "group_end is not a list of 2 finite numbers"),
    "times not numbers": (saved(plan_group_start=[0.0, "0.2"]), "imerge", "group_start is not a list of 2"),
    "times infinite": (saved(plan_predicted_end=float("inf")), "imerge", "predicted_end is inf, not a finite"),
    "times out of order": (saved(plan_group_start=[0.3, 0.1]), "imerge", "not in FIFO order"),
    "predicted end elsewhere": (saved(plan_predicted_end=0.1), "imerge", "not the last group's end"),
    "note not a string": (saved(plan_note=7), "imerge", "plan.note is not a string"),
}


@pytest.mark.parametrize("content, schedule, reason", CORRUPT.values(), ids=CORRUPT.keys())
def test_a_bad_plan_file_is_set_aside_with_one_warning(tmp_path, caplog, content, schedule, reason):
    k = key(cfg=Config(schedule=schedule))
    if isinstance(content, dict) and content.get("key") == key():
        content = {**copy.deepcopy(content), "key": k}
    path = plan_path(str(tmp_path / "psmodel-{workers}.json"), k)
    os.makedirs(os.path.dirname(path))
    with open(path, "w") as f:
        f.write(content if isinstance(content, str) else json.dumps(content))
    with caplog.at_level(logging.WARNING, logger="imerge"):
        assert load_plan(path, k, fit(schedule)) is None  # no cache: the replanner searches
    warnings = [r.getMessage() for r in caplog.records if r.name == "imerge" and r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and path in warnings[0] and reason in warnings[0], warnings
    aside = glob.glob(path + ".invalid-*")
    assert not os.path.exists(path) and len(aside) == 1 and aside[0] in warnings[0]
    with open(aside[0]) as f:
        assert f.read() == (content if isinstance(content, str) else json.dumps(content))  # kept to inspect
    searched, tail = (PLAN, 1) if schedule == "imerge" else (dataclasses.replace(PLAN, partition_bytes=None,
                                                                                   stagger=None), None)
    store_plan(path, k, ORDER, searched, tail)  # the new search's plan is kept at the same place, taken next time
    assert load_plan(path, k, fit(schedule)) == (ORDER, searched, tail) and len(caplog.records) == 1
