"""A plan search past its CPU budget stops in the foreground and finishes in a background process
with the plan a search to the end chooses."""

from __future__ import annotations

import os
import time

import pytest

from imerge_hooks.config import Config
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


def test_background_search_chooses_the_foreground_plan():
    args = inputs()
    expected = choose_plan(**args)
    search = BackgroundSearch(args)
    folder = search.folder
    deadline = time.monotonic() + 120
    while (got := search.result()) is None:
        assert time.monotonic() < deadline, "the background search did not finish in 120 s"
        time.sleep(0.1)
    assert got.groups == expected.groups and got.partition_bytes == expected.partition_bytes
    assert got.stagger == expected.stagger and got.note == expected.note
    assert search.seconds is not None and not os.path.exists(folder)


def test_background_search_failure_and_close():
    search = BackgroundSearch({"sizes": "not a list"})
    deadline = time.monotonic() + 120
    with pytest.raises(RuntimeError, match="background plan search exited with status"):
        while search.result() is None:
            assert time.monotonic() < deadline
            time.sleep(0.1)
    running = BackgroundSearch(inputs(64, 64))
    running.close()
    assert running.process.poll() is not None and not os.path.exists(running.folder)
