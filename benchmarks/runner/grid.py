"""What the runner measures and simulates: models, schedules, paths, the models' facts, each
schedule's physical bound, and the small helpers every step uses (logging, formatting, the ranks'
tagged output)."""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent.parent
WORKER = REPO / "benchmarks" / "worker_replay.py"
PROFILES = REPO / "benchmarks" / "profiles"
DEFAULT_OUT = REPO / "benchmarks" / "results"
MODELS = ("resnet18", "vgg16", "alexnet", "resnet50", "synthetic")
FUSION = ("threshold", "mgwfbp", "adaptive-ps")
SCHEDULES = ("default", "wfbp", "priority", "mgwfbp", "imerge")
PEERS = ("ddp", "ddp-tuned", "mpi-allreduce")  # all-reduce over the workers (benchmarks/peers.py)
PLANNED = ("threshold", "mgwfbp", "adaptive-ps", "imerge")
RUN_ORDER = ("ddp", "ddp-tuned", "mpi-allreduce", "default", "wfbp", "priority", "mgwfbp", "imerge", "threshold",
             "adaptive-ps")
FALLBACK_STARTUP_S = 200e-6  # per-push server work when no calibrated model exists (--sim-startup-us)


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def parse_list(text: str, kind: Callable[[str], Any] = str) -> list:
    return [kind(v.strip()) for v in text.split(",") if v.strip()]


def fmt_list(values: list[float]) -> str:
    return "/".join(f"{v:.2f}" for v in values)


def fmt_s(seconds: float) -> str:
    seconds = max(0.0, seconds)
    if seconds < 90:
        return f"{seconds:.0f} s"
    return f"{seconds / 60:.1f} min"


def load_profile(model: str) -> dict:
    with open(PROFILES / f"{model}-cpu.json") as f:
        return json.load(f)


def model_facts(model: str, time_scale: float) -> dict:
    p = load_profile(model)
    fwd = sum(layer["forward_s"] for layer in p["layers"]) * time_scale
    bwd = sum(layer["backward_s"] for layer in p["layers"]) * time_scale
    nbytes = sum(prm["bytes"] for layer in p["layers"] for prm in layer["params"])
    return {"compute_s": fwd + bwd, "forward_s": fwd, "backward_s": bwd, "bytes": nbytes,
            "batch_size": int(p["batch_size"]), "tensors": sum(len(layer["params"]) for layer in p["layers"])}


def servers_for(spec: str, workers: int) -> int:
    """S for W from ``--servers``: an int, or ``W`` (a server per worker) or ``W/2`` (at least 1)."""
    spec = str(spec).strip().upper()
    if spec == "W":
        return workers
    if spec == "W/2":
        return max(1, workers // 2)
    return int(spec)


def physical_bound(facts: dict, workers: int, servers: int, bandwidth_Bps: float, schedule: str = "imerge") -> dict:
    """The schedule's own bound. A PS: max(compute, max(W/S, 1) * bytes / B) (a server port must
    take W/S of all pushes, a worker port must carry its own bytes; for W >= S the issue's
    W * bytes / (S * B)). An all-reduce peer: max(compute, 2 (W-1)/W * bytes / B) (every worker's
    link carries 2 (W-1)/W of the bytes each way in a ring)."""
    if schedule in PEERS:
        from imerge_hooks.simulate import allreduce_bound_s

        comm = allreduce_bound_s(facts["bytes"], workers, bandwidth_Bps)
    else:
        comm = max(workers / servers, 1.0) * facts["bytes"] / bandwidth_Bps
    return {"compute_s": facts["compute_s"], "comm_s": comm, "bound_s": max(facts["compute_s"], comm)}


_TAGGED = re.compile(r"(RESULT|RANKINFO) (?=\{)")


def tagged_json(line: str) -> list[tuple[str, dict]]:
    """``RESULT {...}`` / ``RANKINFO {...}`` records in one line of merged rank output.

    Ranks share the launcher's stdout, so two records can end up on one line; each is decoded
    on its own and anything that is not a complete JSON object is skipped.
    """
    found = []
    for m in _TAGGED.finditer(line):
        try:
            doc, _ = json.JSONDecoder().raw_decode(line, m.end())
        except json.JSONDecodeError:
            continue
        if isinstance(doc, dict):
            found.append((m.group(1), doc))
    return found
