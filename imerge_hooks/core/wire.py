"""The wire protocol over mpi4py.

All IMerge traffic runs on ``Topology.data_comm`` (a duplicate of COMM_WORLD):

* ``TAG_CONTROL`` worker -> server, pickled dict: ``register`` (a numbered key table),
  ``stage_end``, ``shutdown``.
* ``TAG_REPLY`` server -> worker, pickled dict: ``ack`` / ``error`` answers to ``register``.
* ``TAG_ERROR`` server -> worker, pickled dict: an asynchronous error (bad push, stall).
* ``TAG_TIMELINE`` server -> worker 0 at shutdown, pickled timeline events (``IMERGE_TIMELINE``).
* ``TAG_DECISION`` worker 0 -> the other workers (on the workers' communicator), a pickled
  decision such as the fusion plan (``handoff.from_worker0``).
* ``TAG_COLLECTIVE`` rank -> rank (on the workers' communicator, or COMM_WORLD during ``init``),
  a pickled value of a collective with a deadline (``collectives.collective``).
* ``TAG_HOST_SHUTDOWN`` worker -> the other workers of its host (host aggregation, on the host's
  communicator): this worker shut down; a local worker still waiting for its gradients stops at once.
* ``key_tag(key, round)``: raw bytes of one key, worker -> server (push) and the averaged
  result (sum / W, scaled by the server as it adds) server -> worker (pull). The tag carries
  the round (the worker's step number) modulo ``ROUND_TAGS``: the server refuses a push
  whose round differs from the other pushes of the key's open round, or repeats the last
  completed one (a worker that skipped or repeated a step is named at once). The worker
  posts the ``Irecv`` for the result before the ``Isend`` of the push. One outstanding push
  per (worker, key); MPI's non-overtaking rule keeps successive iterations of a key apart.
  With host aggregation the same tags carry a key between the workers of a host, on the host's
  communicator: a worker's gradient to the key's owner there, and the result back.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ._mpi import MPI

TAG_CONTROL = 1
TAG_REPLY = 2
TAG_ERROR = 3
TAG_TIMELINE = 4
TAG_DECISION = 5
TAG_COLLECTIVE = 6
TAG_HOST_SHUTDOWN = 7
KEY_TAG_BASE = 16

SUPPORTED_DTYPES = {
    torch.float32: "float32",
    torch.float64: "float64",
    torch.float16: "float16",
    torch.bfloat16: "bfloat16",
}
DTYPE_BY_NAME = {name: dtype for dtype, name in SUPPORTED_DTYPES.items()}


@dataclass(frozen=True)
class KeySpec:
    """One key: a contiguous partition of one group's flat gradient buffer."""

    key: int
    nbytes: int
    dtype: str  # dtype on the wire
    server: int
    names: tuple[str, ...]  # the tensors whose gradients (or parts of them) it carries

    def describe(self) -> str:
        shown = ", ".join(self.names[:4]) + (f", ... ({len(self.names)} tensors)" if len(self.names) > 4 else "")
        return f"key {self.key} ({self.nbytes} bytes {self.dtype}: {shown})"


ROUND_TAGS = 4  # a push's tag carries its round (step) modulo this, so misaligned workers are caught


def key_tag(key: int, round_number: int) -> int:
    """Tag of one key's push and result in one round (the step it belongs to)."""
    return KEY_TAG_BASE + key * ROUND_TAGS + round_number % ROUND_TAGS


def split_key_tag(tag: int) -> tuple[int, int]:
    """(key, round modulo ROUND_TAGS) of a key tag."""
    return divmod(tag - KEY_TAG_BASE, ROUND_TAGS)


def as_mpi_buffer(tensor: torch.Tensor) -> list:
    """A contiguous tensor as an MPI byte buffer, zero-copy (works for bfloat16 too). CUDA tensors
    go as themselves (mpi4py reads their DLPack / CUDA array interface): only for a CUDA-aware MPI."""
    if not tensor.is_contiguous():
        raise ValueError("IMerge internal: MPI buffers must be contiguous")
    flat = tensor.reshape(-1).view(torch.uint8)
    if tensor.device.type == "cuda":
        return [flat, MPI.BYTE]
    if tensor.device.type != "cpu":
        raise ValueError(f"IMerge internal: MPI buffers must be in host or CUDA memory, not {tensor.device}")
    return [flat.numpy(), MPI.BYTE]


def table_to_wire(keys: list[KeySpec]) -> list[tuple]:
    return [(k.key, k.nbytes, k.dtype, k.server, k.names) for k in keys]


def table_from_wire(rows: list[tuple]) -> list[KeySpec]:
    return [KeySpec(key, nbytes, dtype, server, tuple(names)) for key, nbytes, dtype, server, names in rows]


