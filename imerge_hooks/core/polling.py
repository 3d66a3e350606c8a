"""Polling with back-off.

MPICH progresses by polling: a large transfer moves only while both ends keep calling into
MPI. How long to spin before sleeping depends on whether the ranks have a core each:

* ``spin``: every rank on this host has a core of its own (the normal GPU-cluster case).
  Waits spin for up to ``SPIN_S_DEDICATED`` before sleeping, so transfers run at full speed
  and a result is noticed within microseconds.
* ``yield``: ranks outnumber cores (tests, emulated clusters). A spinning rank would steal
  the core the rank it waits for needs, so waits do not spin: they sleep in growing steps from
  ``MIN_SLEEP_S`` (200 us), at first up to ``MAX_SLEEP_S``. (Spinning 200 us after every event
  and capping naps at 250 us cost 8 ranks on 2 cores a fifth more CPU for the same iteration
  time.)

``auto`` (the default) picks ``spin`` when the ranks on this host fit its usable cores.
Every wait also has a deadline elsewhere, so nothing hangs forever.

Naps also grow with how long the wait has lasted: up to ``MAX_SLEEP_S`` (1 ms) while it is
shorter than 20 ms, then ``LATE_FRACTION`` (5%) of it, never above ``MAX_SLEEP_LONG_S`` (2 ms). A
transfer that has taken 40 ms is polled every 2 ms, not every 250 us: past 20 ms, noticing its end
late costs at most 5% of its time (a shorter wait may be noticed up to 1 ms late), and ranks that outnumber
the cores do not spend a large share of one waking up to find nothing (``benchmarks/run.py``
records each rank's CPU time per iteration, ``worker_cpu_s_per_iter``).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

SPIN_S_DEDICATED = 0.02
SPIN_S_SHARED = 0.0
MIN_SLEEP_S = 200e-6  # the first nap of a wait in yield mode
MAX_SLEEP_S = 1e-3
MAX_SLEEP_LONG_S = 2e-3
LATE_FRACTION = 0.05

_spin_s = SPIN_S_SHARED
mode = "yield"


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def configure(polling: str, ranks_on_node: int) -> str:
    """Set the process-wide wait mode ("auto", "spin" or "yield"); returns the mode chosen."""
    global _spin_s, mode
    if polling == "auto":
        polling = "spin" if ranks_on_node <= usable_cores() else "yield"
    mode = polling
    _spin_s = SPIN_S_DEDICATED if polling == "spin" else SPIN_S_SHARED
    return mode


class Backoff:
    """Call ``idle()`` after each poll that found nothing, ``reset()`` after one that did."""

    def __init__(self, spin_s: float | None = None, max_sleep_s: float = MAX_SLEEP_S,
                 sleep: Callable[[float], object] = time.sleep) -> None:
        self.spin_s = _spin_s if spin_s is None else spin_s
        self.max_sleep_s = max_sleep_s
        self._nap = sleep  # e.g. an Event's wait, so new work ends the sleep early
        self.reset()

    def reset(self) -> None:
        self._idle_since: float | None = None
        self._sleep = 0.0

    def idle(self, waited_s: float = 0.0) -> None:
        """One poll found nothing. ``waited_s``: how long the oldest awaited operation has taken
        (the wait's own idle time is used when it is longer)."""
        now = time.perf_counter()
        if self._idle_since is None:
            self._idle_since = now
            return
        idle_s = now - self._idle_since
        if idle_s < self.spin_s:
            return
        cap = max(self.max_sleep_s, min(MAX_SLEEP_LONG_S, LATE_FRACTION * max(idle_s, waited_s)))
        self._sleep = min(cap, max(MIN_SLEEP_S, self._sleep * 2))
        self._nap(self._sleep)


class DeadlineWait(Backoff):
    """A polled wait with a deadline, the shape of every bounded wait of the control plane::

        wait = DeadlineWait(timeout_s)
        while not done:
            if poll_found_something():
                wait.reset()
            elif wait.expired():
                raise IMergeTimeoutError(...)  # naming who is missing
            else:
                wait.idle()
    """

    def __init__(self, limit_s: float, spin_s: float | None = None) -> None:
        super().__init__(spin_s)
        self.limit_s = limit_s
        self.started = time.monotonic()
        self.deadline = self.started + limit_s

    def expired(self, now: float | None = None) -> bool:
        return (time.monotonic() if now is None else now) > self.deadline

    def elapsed(self) -> float:
        return time.monotonic() - self.started
