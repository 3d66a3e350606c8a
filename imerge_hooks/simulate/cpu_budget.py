"""A cap on the CPU seconds one computation may take: ``with cpu_limit(30): ...`` raises
:class:`CpuBudgetSpent` inside the block once the process has used 30 more CPU seconds.

It is a profiling timer (``ITIMER_PROF``, ``SIGPROF``), so it stops code that has no deadline of its
own, such as a simulation's plan search. Where there is no such timer (not POSIX) or the block runs
outside the main thread (signals go to the main thread), the block runs without a cap.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager


class CpuBudgetSpent(BaseException):  # noqa: N818 - read as "the budget is spent"
    """The block's CPU budget ran out. A BaseException, like KeyboardInterrupt, so that no
    ``except Exception`` in the code it interrupts can swallow it."""


def can_limit() -> bool:
    """Whether :func:`cpu_limit` can stop a block here (a POSIX main thread)."""
    return hasattr(signal, "setitimer") and threading.current_thread() is threading.main_thread()


@contextmanager
def cpu_limit(seconds: float | None) -> Iterator[None]:
    """Run the block with at most ``seconds`` of the process's CPU time (None: no cap)."""
    if seconds is None or not can_limit():
        yield
        return

    def spent(_signum, _frame) -> None:
        raise CpuBudgetSpent(f"more than {seconds:.1f} s of CPU")

    previous = signal.signal(signal.SIGPROF, spent)
    signal.setitimer(signal.ITIMER_PROF, max(float(seconds), 1e-3))
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_PROF, 0)
        signal.signal(signal.SIGPROF, previous)
