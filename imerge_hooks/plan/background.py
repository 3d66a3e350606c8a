"""A plan search that finishes in a background process while training goes on.

Worker 0 searches in the foreground for at most ``Config.plan_search_budget_s`` of its CPU. A search
that needs longer (hundreds of workers: each simulated candidate costs seconds) continues here: a
child Python process (``python -m imerge_hooks.plan.background IN OUT``) runs the same
:func:`imerge_hooks.plan.choice.choose_plan` to the end, without a budget, at a lower priority, and
writes the plan to a file. Training meanwhile runs on the DP's plan; the engine's replanner asks
for the result every few iterations (``plan.replan``) and installs it as a later plan epoch, so the
plan installed in the end is the one a foreground search would have chosen.

The child never starts MPI (importing ``imerge_hooks`` does not), sits in the rank's process
group (a launcher that kills the rank kills it too) and exits when its parent does.
"""

from __future__ import annotations

import atexit
import logging
import os
import pickle
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

from .planner import Plan

log = logging.getLogger("imerge")

NICENESS = 10  # the search yields the CPU to training on a busy host


class BackgroundSearch:
    """One plan search in a child process; :meth:`result` polls it without waiting."""

    def __init__(self, inputs: dict[str, Any]) -> None:
        """``inputs``: the keyword arguments of ``choose_plan`` (sizes, ready, names, cost_model, cfg,
        workers, servers, and the optional ones)."""
        self.folder = tempfile.mkdtemp(prefix="imerge-plan-")
        self.inputs_path = os.path.join(self.folder, "inputs.pickle")
        self.output_path = os.path.join(self.folder, "plan.pickle")
        self.errors_path = os.path.join(self.folder, "stderr.txt")
        with open(self.inputs_path, "wb") as f:
            pickle.dump(inputs, f)
        package_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
        env.setdefault("OMP_NUM_THREADS", "1")
        self.started = time.monotonic()
        with open(self.errors_path, "wb") as errors:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "imerge_hooks.plan.background", self.inputs_path, self.output_path,
                 str(os.getpid())], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=errors, env=env)
        self.seconds: float | None = None
        atexit.register(self.close)

    def result(self) -> Plan | None:
        """The searched plan once the child has finished, else None. Raises RuntimeError (with the
        child's error output) if the child failed."""
        code = self.process.poll()
        if code is None:
            return None
        self.seconds = time.monotonic() - self.started
        if code != 0:
            with open(self.errors_path, errors="replace") as f:
                tail = f.read()[-2000:]
            self.close()
            raise RuntimeError(f"the background plan search exited with status {code}: {tail.strip()}")
        with open(self.output_path, "rb") as f:
            chosen = pickle.load(f)
        self.close()
        return chosen

    def close(self) -> None:
        """Stop the child (if it still runs) and remove its files."""
        atexit.unregister(self.close)
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        for path in (self.inputs_path, self.output_path, self.errors_path):
            try:
                os.remove(path)
            except FileNotFoundError:
                pass
        try:
            os.rmdir(self.folder)
        except OSError:
            pass


def _exit_with_parent(parent: int) -> None:
    """The child's watch: a rank that died (or was killed) leaves no search running behind it."""
    while True:
        time.sleep(1.0)
        if os.getppid() != parent:
            os._exit(3)


def main(argv: list[str]) -> int:
    inputs_path, output_path, parent = argv[0], argv[1], int(argv[2])
    threading.Thread(target=_exit_with_parent, args=(parent,), daemon=True).start()
    try:
        os.nice(NICENESS)
    except OSError:
        pass
    from .choice import choose_plan

    with open(inputs_path, "rb") as f:
        inputs = pickle.load(f)
    chosen = choose_plan(**inputs)
    temporary = output_path + ".tmp"
    with open(temporary, "wb") as f:
        pickle.dump(chosen, f)
    os.replace(temporary, output_path)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
