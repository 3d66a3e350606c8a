"""``import lightning_plugin`` starts no MPI and registers "imerge"; building the strategy runs no collective.

Two fresh interpreters (no mpiexec) go through the stages in order and report each as JSON.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from mpirun import REPO

PRELUDE = """
import json
import os
import sys


def mpi_started():
    mpi = sys.modules.get("mpi4py.MPI")
    return mpi is not None and mpi.Is_initialized()


report = {}
import lightning_plugin
from lightning_plugin._lightning import PACKAGE, StrategyRegistry

report["import"] = {"mpi_started": mpi_started(), "registered": "imerge" in StrategyRegistry,
                    "imerge_hooks_imported": "imerge_hooks" in sys.modules}
"""

BUILD = PRELUDE + """
from imerge_hooks import IMergeConfigError
from imerge_hooks.cluster import session

by_name = StrategyRegistry.get("imerge")
direct = lightning_plugin.IMergeStrategy(schedule="wfbp")
report["build"] = {"by_name": type(by_name).__name__, "direct": type(direct).__name__,
                   "mpi_started": mpi_started(), "imerge_started": session.is_initialized()}

os.environ["IMERGE_NUM_SERVERS"] = "1"
try:
    lightning_plugin.IMergeStrategy(num_servers=2)
    error = None
except IMergeConfigError as e:
    error = str(e)
report["num_servers"] = {"error": error, "same": type(lightning_plugin.IMergeStrategy(num_servers=1)).__name__}
print(json.dumps(report))
"""

TRAINER = PRELUDE + """
Trainer = __import__(PACKAGE, fromlist=["Trainer"]).Trainer
trainer = Trainer(strategy="imerge", accelerator="cpu", devices=1, logger=False)
from imerge_hooks.cluster import session

report["trainer"] = {"strategy": type(trainer.strategy).__name__, "global_zero": trainer.is_global_zero,
                     "imerge_started": session.is_initialized()}
print(json.dumps(report))
"""


@pytest.fixture(scope="module")
def stages() -> dict:
    """Both scripts, each in a fresh interpreter (no mpiexec), run side by side; their reports merged."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("IMERGE_")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    procs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env=env, cwd=REPO) for code in (BUILD, TRAINER)]
    report: dict = {}
    for proc in procs:
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err[-3000:]
        report.update(json.loads(out.strip().splitlines()[-1]))
    return report


def test_import_starts_no_mpi_and_registers_the_strategy(stages):
    assert stages["import"] == {"mpi_started": False, "registered": True, "imerge_hooks_imported": False}


def test_building_the_strategy_starts_neither_mpi_nor_imerge(stages):
    assert stages["build"] == {"by_name": "IMergeStrategy", "direct": "IMergeStrategy", "mpi_started": False,
                               "imerge_started": False}


def test_num_servers_disagreeing_with_the_environment_is_refused(stages):
    error = stages["num_servers"]["error"]
    assert error is not None and "num_servers=2" in error and "IMERGE_NUM_SERVERS=1" in error
    assert stages["num_servers"]["same"] == "IMergeStrategy"


def test_trainer_by_name_runs_no_collective(stages):
    # The Trainer starts MPI (Lightning's MPIEnvironment.detect() does, and the global rank asks MPI);
    # IMerge itself starts at the first entry point (fit, validate, ...).
    assert stages["trainer"] == {"strategy": "IMergeStrategy", "global_zero": True, "imerge_started": False}
