"""Model zoo: every schedule gives the parameters of single-process training on the full batch.

Three launches train every cell (tests/scripts/zoo_models.py has the matrices): W=2 workers +
1 server through DistributedOptimizer, W=3 + 2 servers for a few cells, and W=2 + 1 through
``Trainer(strategy="imerge")`` (automatic and manual optimization). Profiling lasts 3
iterations, so the planned schedules train with their plan and ``imerge`` defers updates into
the next forward. Each cell is one test, compared with ``zoo_models.reference_train``.
"""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch
import zoo_models
from mpirun import MPIRun, cost_model_cache, run_mpi
from zoo_models import LIGHTNING_RUNS, MATRIX_W2, MATRIX_W3, Cell

SCRIPTS = Path(__file__).parent / "scripts"
TOL = 1e-5
PLANNED = ("threshold", "mgwfbp", "adaptive-ps", "imerge")
NEVER_PLANNED = ("freeze",)  # the profiling restarts after each trainable change (steps 2 and 4 of 6)


class Launch:
    """One mpiexec job's output folder and output."""

    def __init__(self, run: MPIRun, out: Path, workers: int) -> None:
        self.run, self.out, self.workers = run, out, workers

    def state(self, name: str) -> dict[str, torch.Tensor]:
        """The final state_dict of a cell, or a failure that says why there is none."""
        path = self.out / f"{name}.pt"
        if path.exists():
            return torch.load(path)
        errors = sorted(self.out.glob(f"{name}.err.*"))
        if errors:
            text = errors[0].read_text().strip().splitlines()
            pytest.fail(f"{name} raised on {[e.name.rsplit('.', 1)[1] for e in errors]}:\n"
                        + "\n".join(text[-12:]), pytrace=False)
        pytest.fail(f"{name}: no result (launch exited {self.run.returncode})\n--- stdout ---\n"
                    f"{self.run.stdout[-3000:]}\n--- stderr ---\n{self.run.stderr[-3000:]}", pytrace=False)

    def checksums(self, name: str) -> list[float]:
        return [float(v) for rank in range(self.workers) for k, v in
                (line.split() for line in self.run.lines(rank, "checksum")) if k == name]

    def info(self, name: str, what: str = "cell-info") -> dict[str, str]:
        for line in self.run.lines(0, what):
            cell, *pairs = line.split()
            if cell == name:
                return dict(p.split("=") for p in pairs)
        return {}


ENV = {"IMERGE_PROFILE_STEPS": "3", "IMERGE_FUSION_THRESHOLD_BYTES": "4000", "IMERGE_TIMEOUT_S": "120",
       "IMERGE_STALL_WARNING_S": "30"}


@pytest.fixture(scope="module")
def zoo_cost_model() -> dict[str, str]:
    """The process-wide cost-model cache (``mpirun.cost_model_cache``): each topology is calibrated once."""
    return {"IMERGE_COST_MODEL_PATH": str(cost_model_cache() / "ps-{workers}w-{servers}s-{hosts}.json")}


def launch(tmp_path_factory, zoo_cost_model, script: str, workers: int, servers: int, *args: str,
           timeout: float) -> Launch:
    out = tmp_path_factory.mktemp(script.split(".")[0])
    run = run_mpi(SCRIPTS / script, workers + servers, str(out), *args, servers=servers, timeout=timeout,
                  env={**ENV, **zoo_cost_model})
    return Launch(run, out, workers)


@pytest.fixture(scope="module")
def w2(tmp_path_factory, zoo_cost_model) -> Launch:
    return launch(tmp_path_factory, zoo_cost_model, "zoo_train.py", 2, 1, "--matrix", "w2", timeout=400)


@pytest.fixture(scope="module")
def w3(tmp_path_factory, zoo_cost_model) -> Launch:
    return launch(tmp_path_factory, zoo_cost_model, "zoo_train.py", 3, 2, "--matrix", "w3", timeout=300)


@pytest.fixture(scope="module")
def lightning(tmp_path_factory, zoo_cost_model) -> Launch:
    return launch(tmp_path_factory, zoo_cost_model, "zoo_lightning.py", 2, 1, timeout=300)


@functools.cache
def reference_train(model: str, optimizer: str) -> dict[str, torch.Tensor]:
    """Cells that share a model and an optimizer share their reference (one thread: no oversubscription)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return zoo_models.reference_train(model, optimizer)
    finally:
        torch.set_num_threads(threads)


def max_diff(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> tuple[float, str]:
    assert got.keys() == ref.keys()
    return max(((got[k] - ref[k]).abs().max().item(), k) for k in ref)


def check_cell(result: Launch, cell: Cell) -> None:
    got = result.state(cell.id)
    diff, where = max_diff(got, reference_train(cell.model, cell.optimizer))
    assert diff <= TOL, f"{cell.id}: max |param - reference| = {diff:.3g} at {where}"
    sums = result.checksums(cell.id)
    assert len(sums) == result.workers and max(sums) - min(sums) <= 1e-9 * max(sums), (cell.id, sums)
    info = result.info(cell.id)
    if cell.schedule in PLANNED and cell.model not in NEVER_PLANNED:
        assert info.get("planned") == "True", (cell.id, info)
    if cell.schedule == "imerge" and cell.model not in NEVER_PLANNED:
        assert int(info.get("deferred", 0)) >= 2, (cell.id, info)  # updates were applied in a forward


@pytest.mark.parametrize("cell", MATRIX_W2, ids=lambda c: c.id)
def test_two_workers_one_server(w2, cell):
    check_cell(w2, cell)


@pytest.mark.parametrize("cell", MATRIX_W3, ids=lambda c: c.id)
def test_three_workers_two_servers(w3, cell):
    check_cell(w3, cell)


@pytest.mark.parametrize("run", list(LIGHTNING_RUNS), ids=str)
def test_lightning(lightning, run):
    model, optimizer, _manual = LIGHTNING_RUNS[run]
    got = lightning.state(run)
    diff, where = max_diff(got, reference_train(model, optimizer))
    assert diff <= TOL, f"{run}: max |param - reference| = {diff:.3g} at {where}"
    sums = lightning.checksums(run)
    assert len(sums) == 2 and max(sums) - min(sums) <= 1e-9 * max(sums), (run, sums)
    info = lightning.info(run, "run-info")
    assert int(info.get("deferred", 0)) >= 2, (run, info)  # schedule imerge: updates applied in the next forward
