"""How both caches on disk (fusion plans, ``plan/cache.py``; the PS cost model, ``plan/calibrate.py``)
read a file: validate it, or set it aside.

A cache file is checked against what IMerge itself writes: every field's type and range, and that it
was kept for this job. A file that fails (not JSON, nested too deeply, a field of the wrong type or out of
range, kept for another job, too old) gets one warning on the rank that read it, naming the file and
why, and is renamed to ``<name>.invalid-<time>``: the user can inspect it, and no reader opens it again
(they open the exact name). The job then goes on as if there were no file. Only worker 0 reads either
cache, and what it found reaches the other workers from it, so every worker installs the same plan and
model.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from collections.abc import Callable, Collection
from typing import Any, TypeVar

log = logging.getLogger("imerge")

T = TypeVar("T")


class UnusableCacheFile(ValueError):
    """Raised by a cache's check: why its file cannot be used (the reason the warning gives)."""


def require(ok: bool, reason: str) -> None:
    """Raise :class:`UnusableCacheFile` with ``reason`` unless ``ok``."""
    if not ok:
        raise UnusableCacheFile(reason)


def is_int(value: Any) -> bool:
    """An integer as JSON gives one (``True`` is not one)."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    """A finite int or float as JSON gives one (not a bool, not NaN or infinity)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def integer(value: Any, name: str, low: int, high: int | None = None) -> int:
    """``value`` if it is an integer in ``low..high`` (``high`` None: no upper limit)."""
    require(is_int(value), f"{name} is {value!r}, not an integer")
    require(low <= value and (high is None or value <= high),
            f"{name} is {value}, outside {low}..{'' if high is None else high}")
    return value


def number(value: Any, name: str) -> float:
    """``value`` if it is a finite number."""
    require(is_number(value), f"{name} is {value!r}, not a finite number")
    return float(value)


def record(value: Any, name: str, fields: Collection[str]) -> dict[str, Any]:
    """``value`` if it is a JSON object with exactly ``fields``."""
    require(isinstance(value, dict), f"{name} is a {type(value).__name__}, not an object")
    missing, unknown = sorted(set(fields) - set(value)), sorted(set(value) - set(fields))
    require(not missing, f"{name} lacks {', '.join(missing)}")
    require(not unknown, f"{name} has unknown fields {', '.join(unknown)}")
    return value


def read_checked(path: str, what: str, check: Callable[[Any], T], instead: str) -> T | None:
    """``check`` of the JSON in ``path``; None where there is no file, or where reading or checking it
    fails: then one warning names the file and the reason and the file is set aside.

    ``check`` raises :class:`UnusableCacheFile` with the reason; ``what`` names the cache in the warning
    and ``instead`` says what the job does without it (``"searching for a plan"``).
    """
    identity = None
    try:
        with open(path, "rb") as f:
            identity = _identity(os.fstat(f.fileno()))
            content = json.load(f)
    except FileNotFoundError:
        return None
    except Exception as exc:  # any file we cannot read is not a cache, never a crash of worker 0
        reason = _reason(exc)
    else:
        try:
            return check(content)
        except Exception as exc:  # the checks and the constructors they call see data from disk
            reason = _reason(exc)
    log.warning("IMerge: not using the %s %s: %s; %s; %s", what, path, reason, _set_aside(path, identity), instead)
    return None


def _identity(stat: os.stat_result) -> tuple[int, ...]:
    return stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns


def _reason(exc: BaseException) -> str:
    if isinstance(exc, UnusableCacheFile):
        return str(exc)
    if isinstance(exc, RecursionError):
        return "its JSON is nested too deeply"
    if isinstance(exc, (json.JSONDecodeError, UnicodeDecodeError)):
        return f"it is not JSON ({exc})"
    return f"{type(exc).__name__}: {exc}"


def _set_aside(path: str, identity: tuple[int, ...] | None) -> str:
    """Rename the file that was read (not one another job wrote there since) so no reader opens it again."""
    aside = f"{path}.invalid-{time.strftime('%Y%m%dT%H%M%S')}"
    try:
        if identity is not None and _identity(os.stat(path)) != identity:
            return "another process has replaced it since, so that file stays"
        os.replace(path, aside)
    except OSError as exc:
        return f"could not move it aside ({exc})"
    return f"moved it to {aside}"
