"""The transport check (``imerge-transport-check``) as a lab benchmark: the same run, saved to
``benchmarks/results/transport.json`` (or ``--json``) with the lab's record of the machine.

    mpiexec -n 2 python benchmarks/transport.py [--min 4KiB] [--max 64MiB] [--iters N] [--sweeps 3]
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # run as a script
    sys.path.insert(0, str(REPO))

from benchmarks.machine import machine_info  # noqa: E402
from imerge_hooks.tools.transport_check import main  # noqa: E402

DEFAULT_JSON = REPO / "benchmarks" / "results" / "transport.json"

if __name__ == "__main__":
    argv = sys.argv[1:]
    if not any(a == "--json" or a.startswith("--json=") for a in argv):
        argv += ["--json", str(DEFAULT_JSON)]
    sys.exit(main(argv, extra_info=machine_info))
