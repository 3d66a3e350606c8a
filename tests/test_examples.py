"""The examples run as their docstrings say (with small sizes), and load checkpoints safely."""

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from mpirun import run_mpi

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = REPO / "examples"


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    return {"IMERGE_COST_MODEL_PATH": str(tmp_path_factory.mktemp("cm") / "ps-{workers}w-{servers}s-{hosts}.json")}


def result_line(run) -> str:
    return next(line for line in run.stdout.splitlines() if line.startswith("RESULT"))


def test_horovod_style_learns_digits_and_resumes(env, tmp_path):
    """Horovod's patterns: fp16 compression, backward_passes_per_step, metric allreduce, then a
    second launch that resumes from worker 0's checkpoint by broadcasting epoch and state."""
    ckpt = str(tmp_path / "ckpt.pt")
    common = ("--checkpoint", ckpt, "--fp16-allreduce", "--batches-per-allreduce", "2")
    run_mpi(EXAMPLES / "horovod_style.py", 3, "--epochs", "1", *common, servers=1, env=env, timeout=150).check()
    run = run_mpi(EXAMPLES / "horovod_style.py", 3, "--epochs", "2", *common, servers=1, env=env,
                  timeout=150).check()
    assert "resumed at epoch 1" in run.stdout and "epoch 0:" not in run.stdout
    assert float(result_line(run).split("val_acc=")[1]) > 0.8


def test_ddp_hook_learns_digits_across_a_checkpoint(env, tmp_path):
    """One epoch, a checkpoint holding the hook state's settings as plain data (it loads with
    ``weights_only=True``, here and in the example), a new launch that resumes with them."""
    ckpt = str(tmp_path / "ckpt.pt")
    run_mpi(EXAMPLES / "ddp_hook.py", 3, "--epochs", "1", "--checkpoint", ckpt, "--schedule", "priority", servers=1,
            env=env, timeout=150).check()
    saved = torch.load(ckpt, weights_only=True)
    assert saved["hook_state"]["schedule"] == "priority" and "num_servers" not in saved["hook_state"]
    run = run_mpi(EXAMPLES / "ddp_hook.py", 3, "--epochs", "2", "--checkpoint", ckpt, servers=1, env=env,
                  timeout=150).check()  # the example's default schedule is wfbp: the checkpoint's wins
    assert "resumed after epoch 0 (schedule priority)" in run.stdout
    assert "epoch 0:" not in run.stdout
    assert float(result_line(run).split("val_acc=")[1]) > 0.8


def _unsafe_python_loads(path: Path) -> list[str]:
    """``torch.load`` calls in a Python file that do not pass ``weights_only=True``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and ast.unparse(node.func) == "torch.load":
            safe = any(k.arg == "weights_only" and isinstance(k.value, ast.Constant) and k.value.value is True
                       for k in node.keywords)
            if not safe:
                found.append(f"{path.relative_to(REPO)}:{node.lineno}")
    return found


def _unsafe_doc_loads(path: Path) -> list[str]:
    """``torch.load(...)`` in a document's text without ``weights_only=True`` inside the call."""
    text = path.read_text()
    return [f"{path.relative_to(REPO)}:{text.count(chr(10), 0, m.start()) + 1}"
            for m in re.finditer(r"torch\.load\(([^()]*)\)", text) if "weights_only=True" not in m.group(1)]


def test_every_torch_load_in_examples_and_docs_passes_weights_only():
    """A checkpoint is data: with ``weights_only=False`` (torch < 2.6's default, or
    ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1``) a crafted file runs code when loaded."""
    unsafe = [hit for path in sorted(EXAMPLES.glob("*.py")) for hit in _unsafe_python_loads(path)]
    docs = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    unsafe += [hit for path in docs for hit in _unsafe_doc_loads(path)]
    assert not unsafe, f"torch.load without weights_only=True: {unsafe}"


def test_the_load_check_sees_an_unsafe_load(tmp_path, monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "REPO", tmp_path)
    (tmp_path / "a.py").write_text("import torch\nx = torch.load('c.pt', map_location='cpu')\n"
                                   "y = torch.load('c.pt', weights_only=True)\n")
    (tmp_path / "a.md").write_text("Resume with `torch.load(path)`, or `torch.load(path, weights_only=True)`.\n")
    assert _unsafe_python_loads(tmp_path / "a.py") == ["a.py:2"]
    assert _unsafe_doc_loads(tmp_path / "a.md") == ["a.md:1"]


class _Payload:
    """Pickled as a call that leaves a file behind: what a crafted checkpoint runs when unpickled."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (Path(self.marker),))


def test_horovod_style_refuses_a_crafted_checkpoint(env, tmp_path):
    """Even where torch would not load weights-only by default, the example's resume runs no code."""
    ckpt, marker = tmp_path / "ckpt.pt", tmp_path / "payload-ran"
    torch.save({"model": _Payload(str(marker)), "epoch": 0}, ckpt)
    run = subprocess.run([sys.executable, str(EXAMPLES / "horovod_style.py"), "--epochs", "1", "--checkpoint",
                          str(ckpt)], capture_output=True, text=True, cwd=REPO, timeout=120,
                         env={**os.environ, **env, "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD": "1"})  # worker 0 alone
    assert run.returncode != 0 and not marker.exists(), run.stderr[-3000:]
    assert "Weights only load failed" in run.stderr, run.stderr[-3000:]
