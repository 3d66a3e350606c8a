"""``Trainer(strategy="imerge")`` gives Lightning DDP's results; entry points, checkpoints, misuse, the example.

Two launches run every training check (tests/scripts/lightning_checks.py): Lightning's own DDP
over 2 ranks (gloo, no servers) and IMerge with 2 workers + 1 server. The tests compare them.
The IMerge launch's script also raises on the server after its last line: the job still exits 0.
"""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from mpirun import REPO, cost_model_cache, run_mpi

SCRIPTS = Path(__file__).parent / "scripts"
CHECKS = SCRIPTS / "lightning_checks.py"
TOL = 1e-5


class Launch:
    def __init__(self, run, out: Path) -> None:
        self.run, self.out = run, out

    def state(self, name: str) -> dict:
        return torch.load(self.out / f"{name}.pt")

    def result(self, name: str) -> dict:
        return json.loads((self.out / f"{name}.json").read_text())

    def said(self, rank: int, what: str) -> list[str]:
        return self.run.lines(rank, what)


@pytest.fixture(scope="module")
def ddp(tmp_path_factory):
    out = tmp_path_factory.mktemp("ddp")
    return Launch(run_mpi(CHECKS, 2, str(out), "--strategy", "ddp", timeout=120).check(), out)


@pytest.fixture(scope="module")
def imerge(tmp_path_factory):
    out = tmp_path_factory.mktemp("imerge")
    env = {"IMERGE_COST_MODEL_PATH": str(cost_model_cache() / "ps-{workers}w-{servers}s-{hosts}.json")}
    run = run_mpi(CHECKS, 3, str(out), "--strategy", "imerge", "--server-raises", servers=1, timeout=150,
                  env=env).check()  # exit status 0 although the server raised at the end
    return Launch(run, out)


def max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


def close(a: dict, b: dict, keys, tol: float = 1e-9) -> None:
    for k in keys:
        assert abs(a[k] - b[k]) <= tol, (k, a[k], b[k])


def test_every_rank_finishes(imerge, ddp):
    assert imerge.said(0, "done") == ["imerge worker"] and imerge.said(1, "done") == ["imerge worker"]
    assert imerge.said(2, "done") == ["imerge server"]
    assert ddp.said(0, "done") == ["ddp worker"] and ddp.said(1, "done") == ["ddp worker"]


def test_same_weights_and_validation_metric_as_ddp(imerge, ddp):
    assert max_diff(imerge.state("plain"), ddp.state("plain")) <= TOL
    close(imerge.result("plain")["metrics"], ddp.result("plain")["metrics"], ["val_loss", "val_acc", "train_loss"])
    # every worker ends with the same weights
    assert imerge.said(0, "checksum plain") == imerge.said(1, "checksum plain")


def test_accumulation_clipping_checkpoint_and_entry_points(imerge, ddp):
    ours, theirs = imerge.result("full"), ddp.result("full")
    assert max_diff(imerge.state("full"), ddp.state("full")) <= TOL
    # Gradients are averaged before on_before_optimizer_step and clipping; clipping was active.
    assert len(ours["norms"]) == len(theirs["norms"]) == 6  # 2 epochs x (2 full steps + 1 short one)
    assert ours["norms"] == pytest.approx(theirs["norms"], rel=1e-9)
    assert min(ours["norms"]) > 0.05
    close(ours["fit_metrics"], theirs["fit_metrics"], ["val_loss", "val_acc", "train_loss"])
    close(ours["validate"], theirs["validate"], ["val_loss", "val_acc"])
    close(ours["test"], theirs["test"], ["test_loss", "test_acc"])
    # One checkpoint per epoch, written by worker 0 only, reloads to the trained weights.
    assert ours["ckpts"] == ["epoch=0-step=3.ckpt", "epoch=1-step=6.ckpt"]
    assert imerge.said(0, "ckpt-write") == ours["ckpts"]
    assert imerge.said(1, "ckpt-write") == [] and imerge.said(2, "ckpt-write") == []
    for rank in (0, 1):
        assert float(imerge.said(rank, "ckpt-reload-maxdiff")[0]) == 0.0
        assert imerge.said(rank, "predicted") == ["12"]  # each worker predicts its half of 24
    # On the server each entry point returns what it returned on worker 0 (fit: None).
    (worker0,) = imerge.said(0, "validate")
    validated, tested = worker0.split(" test ")
    assert imerge.said(2, "server-returned") == ["fit None", f"validate {validated}", f"test {tested}", "predict 12"]


def test_scripts_run_on_servers_as_on_worker_0(imerge, ddp):
    """Lightning's example scripts use the results on every rank (``print(predictions[0])``,
    ``results[0]["val_loss"]``, ``trainer.callback_metrics[...]``): a server gets worker 0's."""
    (server,) = imerge.said(2, "script")
    (worker0,) = imerge.said(0, "script")
    (worker1,) = imerge.said(1, "script")
    assert server.startswith("server ") and worker0.startswith("worker ")
    assert server.split(" ", 1)[1] == worker0.split(" ", 1)[1]
    assert worker1 != worker0  # worker 1 predicted its own half; the metrics agree
    assert worker1.split(" ")[1:5] == worker0.split(" ")[1:5]
    assert worker0 == ddp.said(0, "script")[0]  # and they are DDP's
    assert imerge.said(2, "done") == ["imerge server"]


def test_a_servers_exception_after_its_last_stage_is_reported_and_the_job_exits_0(imerge):
    """The imerge fixture's script raises on the server at its very end; the job exited 0 (checked
    there), and the server said what failed, naming itself."""
    err = imerge.run.stderr
    assert "RuntimeError: the script's last line fails on the server only" in err
    assert re.search(r"IMerge server 0 \(world rank 2\): uncaught RuntimeError in the script: the script's last line "
                     r"fails on the server only\. This server serves the workers until they finish and exits 0", err)


def test_gan_example_two_optimizers_toggle_optimizer_as_ddp(imerge, ddp):
    """generative_adversarial_net.py's step (manual optimization, toggle_optimizer, two Adams, a
    BatchNorm generator) under the default schedule: DDP's weights, and each worker's buffers as
    under Lightning's DDP (broadcast before the first training step only, in manual optimization)."""
    assert max_diff(imerge.state("gan"), ddp.state("gan")) <= TOL
    for rank in (0, 1):
        assert imerge.said(rank, "checksum gan") == ddp.said(rank, "checksum gan")
        ours, theirs = (float(run.said(rank, "gan-buffers")[0]) for run in (imerge, ddp))
        assert abs(ours - theirs) <= 1e-9, (rank, ours, theirs)


def test_base_finetuning_unfreezing_trains_as_one_process(imerge, ddp):
    """computer_vision_fine_tuning.py's BaseFinetuning: frozen features unfrozen at epochs 1 and 2
    by unfreeze_and_add_param_group, under the default schedule: one process on both workers'
    batches is the reference (under DDP the ranks would drift apart: it never averages the
    parameters frozen when it wrapped the model)."""
    assert imerge.result("tune")["groups"] == ddp.result("tune")["groups"] == [2, 2, 2]
    assert max_diff(imerge.state("tune"), ddp.state("tune")) <= TOL
    assert imerge.said(0, "checksum tune") == imerge.said(1, "checksum tune")


def test_manual_optimization_two_optimizers_and_bf16(imerge, ddp):
    assert max_diff(imerge.state("manual"), ddp.state("manual")) <= TOL
    for rank in (0, 1):
        assert imerge.said(rank, "bf16-loss")[0].endswith("finite")
    assert imerge.said(0, "checksum bf16") == imerge.said(1, "checksum bf16")
    assert max_diff(imerge.state("bf16"), ddp.state("bf16")) <= 1e-4


def test_batchnorm_buffers_follow_worker_0_as_under_ddp(imerge, ddp):
    """broadcast_buffers: before each forward that follows a synchronised one, DDP gives every
    worker worker 0's running statistics; the strategy does the same, so each worker's buffers match."""
    for worker in (0, 1):
        ours, theirs = torch.load(imerge.out / f"bn-w{worker}.pt"), torch.load(ddp.out / f"bn-w{worker}.pt")
        assert max_diff(ours, theirs) <= TOL, worker


def test_manual_accumulation_under_the_default_schedule(imerge, ddp):
    """Two manual_backward per step accumulate as under DDP, and no epoch loses its last step."""
    assert max_diff(imerge.state("macc"), ddp.state("macc")) <= TOL
    close(imerge.result("macc")["metrics"], ddp.result("macc")["metrics"], ["val_loss"])


def test_the_unified_lightning_package_trains_as_ddp(ddp, tmp_path):
    """``import lightning.pytorch`` before ``lightning_plugin``: the strategy is built on that package."""
    run = run_mpi(CHECKS, 3, str(tmp_path), "--strategy", "imerge-name", "--runs", "plain", "--lightning",
                  servers=1, timeout=120, env={"IMERGE_SCHEDULE": "wfbp"}).check()
    assert run.lines(2, "done") == ["imerge-name server"]
    assert max_diff(torch.load(tmp_path / "plain.pt"), ddp.state("plain")) <= TOL


def test_digits_example_reaches_good_accuracy():
    # Trainer(strategy="imerge") from the registry, configured by IMERGE_* env vars
    run = run_mpi(REPO / "examples" / "lightning_digits.py", 3, "--epochs", "4", "--batch-size", "48",
                  "--lr", "1e-2", servers=1, timeout=120, env={"IMERGE_SCHEDULE": "wfbp"}).check()
    result = re.search(r"RESULT strategy=imerge schedule=wfbp workers=2 val_acc=([\d.]+) samples_per_s=([\d.]+)",
                       run.stdout)
    assert result, run.stdout[-2000:]
    assert float(result.group(1)) >= 0.9
    assert float(result.group(2)) > 0
    assert len(re.findall(r"^epoch ", run.stdout, re.M)) == 4  # printed once (worker 0), every epoch


def test_devices_above_one_is_refused_clearly():
    run = run_mpi(SCRIPTS / "lightning_misuse.py", 2, "devices2", servers=1, timeout=120).check()
    for rank in (0, 1):  # the worker and the server are both told, and both exit cleanly
        (error,) = run.lines(rank, "ERROR")
        assert error.startswith("IMergeConfigError")
        assert "one process per device" in error and "devices=1" in error and "mpiexec" in error
        assert run.lines(rank, "exit") == ["devices2"]


def test_single_process_without_mpiexec():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
               OMP_NUM_THREADS="1")
    env.pop("IMERGE_NUM_SERVERS", None)
    proc = subprocess.run([sys.executable, str(SCRIPTS / "lightning_misuse.py"), "single"], capture_output=True,
                          text=True, timeout=120, env=env, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("@0 single"))
    assert "world_size 1 global_zero True strategy IMergeStrategy steps 4" in line
