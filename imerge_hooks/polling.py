"""Polling with back-off.

MPICH progresses by polling. A rank that spins on a blocking call steals a core from the
ranks it waits for when processes outnumber cores, so every IMerge wait polls, then yields
with growing sleeps; each wait also has a deadline so nothing hangs forever.
"""

from __future__ import annotations

import time


class Backoff:
    """Call ``idle()`` after each poll that found nothing, ``reset()`` after one that did."""

    def __init__(self, spin_s: float = 200e-6, max_sleep_s: float = 250e-6) -> None:
        self.spin_s = spin_s
        self.max_sleep_s = max_sleep_s
        self.reset()

    def reset(self) -> None:
        self._idle_since: float | None = None
        self._sleep = 0.0

    def idle(self) -> None:
        now = time.perf_counter()
        if self._idle_since is None:
            self._idle_since = now
            return
        if now - self._idle_since < self.spin_s:
            return
        self._sleep = min(self.max_sleep_s, max(20e-6, self._sleep * 2))
        time.sleep(self._sleep)
