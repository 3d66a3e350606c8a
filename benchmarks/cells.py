"""One cell of a benchmark sweep in a child Python under a timeout, so a cell that runs long or fails
costs only itself (``plan_time.py``, ``host_tables.py``)."""

from __future__ import annotations

import json
import subprocess
import sys


def run_cell(script: str, spec: str, ident: dict, timeout_s: float, timeout_error: str) -> dict:
    """``python script --cell spec``'s last line as JSON; else ``ident`` with an ``error``: ``timeout_error``
    (formatted with ``timeout_s``) or the child's last line of errors."""
    cmd = [sys.executable, script, "--cell", spec]
    try:
        ran = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, check=True)
        return json.loads(ran.stdout.strip().splitlines()[-1])
    except subprocess.TimeoutExpired:
        return {**ident, "error": timeout_error.format(timeout_s=timeout_s)}
    except subprocess.CalledProcessError as failed:
        return {**ident, "error": (failed.stderr.strip().splitlines() or ["failed"])[-1]}
