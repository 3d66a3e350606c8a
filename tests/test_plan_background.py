"""A plan search past its CPU budget stops in the foreground and finishes in a background process
with the plan a search to the end chooses."""

from __future__ import annotations

import os
import time

import pytest

from imerge_hooks.core.config import Config
from imerge_hooks.plan.background import BackgroundSearch
from imerge_hooks.plan.choice import choose_plan
from imerge_hooks.plan.costmodel import PSModel
from imerge_hooks.plan.search import SearchBudgetSpent

KiB, MiB = 1 << 10, 1 << 20
GRID = [float(KiB * 4**k) for k in range(9)]


def inputs(workers: int = 8, servers: int = 4) -> dict:
    n = 24
    model = PSModel.fit(workers, servers, GRID, [2e-3 + workers * m / (servers * 1e8) for m in GRID])
    return dict(sizes=[(1 + k % 5) * MiB for k in range(n)], ready=[k * 1e-3 for k in range(n)],
                names=[f"layer{n - 1 - k}.weight" for k in range(n)], cost_model=model,
                cfg=Config(schedule="imerge"), workers=workers, servers=servers)


def test_budget_stops_the_search_and_a_large_budget_does_not():
    args = inputs()
    with pytest.raises(SearchBudgetSpent):
        choose_plan(**args, cpu_budget_s=0.0)
    assert choose_plan(**args, cpu_budget_s=600.0).groups == choose_plan(**args).groups
    off = args | {"cfg": Config(schedule="imerge", plan_search=False)}
    choose_plan(**off, cpu_budget_s=0.0)  # the DP alone is no search: the budget does not apply


def wait_for(search: BackgroundSearch, limit_s: float = 120.0):
    deadline = time.monotonic() + limit_s
    while (got := search.result()) is None:
        assert time.monotonic() < deadline, f"the background search did not finish in {limit_s:.0f} s"
        time.sleep(0.1)
    return got


def test_background_search_chooses_the_foreground_plan_and_a_failure_is_reported():
    args = inputs()
    failing = BackgroundSearch({"sizes": "not a list"})  # both children start at once (fewer seconds)
    search = BackgroundSearch(args)
    folder = search.folder
    expected = choose_plan(**args)
    got = wait_for(search)
    assert got.groups == expected.groups and got.partition_bytes == expected.partition_bytes
    assert got.stagger == expected.stagger and got.note == expected.note
    assert search.seconds is not None and not os.path.exists(folder)
    with pytest.raises(RuntimeError, match="background plan search exited with status"):
        wait_for(failing)


def test_close_stops_a_running_search():
    running = BackgroundSearch(inputs(64, 64))
    running.close()
    assert running.process.poll() is not None and not os.path.exists(running.folder)
