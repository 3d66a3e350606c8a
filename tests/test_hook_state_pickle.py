"""Unpickling an IMergeHookState never starts MPI, and validates what it installs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

CHILD = r"""
import pickle, sys
from imerge_hooks.core.config import Config
from imerge_hooks.frontends.ddp import IMergeHookState
from imerge_hooks.core.errors import IMergeConfigError
from imerge_hooks.cluster import session

state = IMergeHookState.__new__(IMergeHookState)
state.__dict__["cfg"] = Config(schedule="priority")
restored = pickle.loads(pickle.dumps(state))
assert restored.cfg.schedule == "priority" and not restored.attached
assert not session.is_initialized() and "mpi4py.MPI" not in sys.modules, "unpickling started MPI"
bad = IMergeHookState.__new__(IMergeHookState)
bad.__dict__["cfg"] = Config(schedule="imerge")
try:
    pickle.loads(pickle.dumps(bad))
except IMergeConfigError as exc:
    assert "overlaps with the next forward pass" in str(exc)
else:
    raise AssertionError("an unpickled imerge schedule was installed on the DDP hook")
print("ok")
"""


def test_unpickling_does_not_start_mpi_and_validates():
    out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=120,
                         cwd=str(REPO), env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]
