"""The simulator's measured error: how far its predictions were from measurement on the emulated
cluster, per schedule. Package data (``measured_error.json``), written by
``benchmarks/measured_error.py`` from ``benchmarks/results``; ``imerge-whatif`` prints it beside its
predictions so that a reader knows what a prediction is worth."""

from __future__ import annotations

import json
from importlib import resources
from typing import Any

FILE = "measured_error.json"


def load() -> dict[str, Any]:
    """Per schedule: ``cells``, ``max_abs_error``, ``median_abs_error``, ``min_error``, ``max_error``,
    ``where``, ``rows``; empty where the file is missing (a build without package data)."""
    try:
        text = resources.files(__package__).joinpath(FILE).read_text()
    except (FileNotFoundError, OSError):
        return {}
    return json.loads(text).get("schedules", {})


def short(errors: dict[str, Any], schedule: str) -> str:
    """A table cell: ``within 39% (31 cells)``, or ``not measured``."""
    s = errors.get(schedule)
    if not s:
        return "not measured"
    return f"within {100 * s['max_abs_error']:.0f}% ({s['cells']} cells)"


def sentence(errors: dict[str, Any], schedule: str) -> str:
    """What was measured for ``schedule``, in one sentence."""
    s = errors.get(schedule)
    if not s:
        return f"{schedule}: no measured cell; the simulator's prediction for it is unchecked"
    if s["max_error"] < 0:
        sign = "faster than measured in every cell"
    elif s["min_error"] > 0:
        sign = "slower than measured in every cell"
    else:
        sign = f"from {100 * s['min_error']:+.0f}% to {100 * s['max_error']:+.0f}%"
    return (f"{schedule}: simulator within {100 * s['max_abs_error']:.0f}% of measurement (median "
            f"{100 * s['median_abs_error']:.0f}%, {sign}) on {s['where']}")
