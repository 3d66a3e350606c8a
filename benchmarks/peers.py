"""The all-reduce peers IMerge is compared with: what users run today instead of a PS.

* ``ddp``: ``torch.nn.parallel.DistributedDataParallel`` over the workers' gloo group
  (``imerge_hooks.worker_group()``), default buckets (25 MiB, first bucket 1 MiB).
* ``ddp-tuned``: the same with ``bucket_cap_mb`` tuned: worker_replay times the caps of
  :func:`ddp_caps` (small buckets, DDP's default, one bucket for the whole model) in the launch
  itself and keeps the fastest, as a user tuning DDP would.
* ``mpi-allreduce``: Horovod's data plane on MPI (:class:`FusedAllreduce`): gradients are fused
  in ready order into buffers of at most 64 MiB (Horovod's ``HOROVOD_FUSION_THRESHOLD``) and
  averaged with ``MPI_Allreduce`` over the workers, overlapping the backward. As in Horovod,
  the workers first agree on what is ready (one small ``MPI_Allreduce`` of the count per fused
  buffer, Horovod's negotiation), so every worker fuses the same tensors.

The server ranks of a launch take no part (they wait in ``imerge_hooks.init()``). The
simulator's model of both is ``imerge_hooks/simulate/allreduce.py``.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import torch

from imerge_hooks.internals import MPI, Backoff

DDP_CAPS_MB = (4, 25)
HOROVOD_FUSION_BYTES = 64 * 1024 * 1024
_MiB = 1024 * 1024


def ddp_caps(total_bytes: int) -> list[float]:
    """The bucket caps ``ddp-tuned`` tries: :data:`DDP_CAPS_MB` below the model, plus one bucket for it all."""
    caps = [float(c) for c in DDP_CAPS_MB if c * _MiB < total_bytes]
    return caps + [float(-(-total_bytes // _MiB))]


def wrap_ddp(model: torch.nn.Module, bucket_cap_mb: float) -> torch.nn.Module:
    """``model`` under DDP on the workers' gloo group (built on first use, bounded by timeout_s)."""
    from torch.nn.parallel import DistributedDataParallel

    import imerge_hooks as imh

    return DistributedDataParallel(model, process_group=imh.worker_group(), bucket_cap_mb=bucket_cap_mb)


class FusedAllreduce:
    """Average gradients over ``comm`` with fused ``MPI_Allreduce`` s as they become ready (Horovod).

    ``step()`` waits for the last fused buffer, then steps ``optimizer``. Every parameter must
    get a gradient in every backward (true of the replayed models this is used with); a backward
    that leaves one out raises in ``step()`` naming it.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, params: list[torch.nn.Parameter], comm: MPI.Comm,
                 fusion_bytes: int = HOROVOD_FUSION_BYTES, timeout_s: float = 600.0) -> None:
        self.optimizer = optimizer
        self.params = list(params)
        self.comm = comm
        self.size = comm.Get_size()
        self.fusion_bytes = fusion_bytes
        self.timeout_s = timeout_s
        dtype = self.params[0].dtype
        odd = next((i for i, p in enumerate(self.params) if p.dtype != dtype or p.device.type != "cpu"), None)
        if odd is not None:
            raise ValueError(f"mpi-allreduce: parameter {odd} is {self.params[odd].dtype} on "
                             f"{self.params[odd].device}; every parameter must be {dtype} on the CPU")
        self._itemsize = self.params[0].element_size()
        largest = max(p.numel() for p in self.params)
        self._fused = torch.empty(max(fusion_bytes // self._itemsize, largest), dtype=dtype)
        self._ready: list[int] = []  # parameter indices in the order their gradients became ready
        self._done = 0  # of _ready, how many are averaged
        self._cond = threading.Condition()
        self._error: BaseException | None = None
        self._stop = False
        self._handles = [p.register_post_accumulate_grad_hook(self._make_hook(i)) for i, p in enumerate(self.params)]
        self._thread = threading.Thread(target=self._run, name="allreduce", daemon=True)
        self._thread.start()

    def _make_hook(self, index: int):
        def hook(_param: torch.Tensor) -> None:
            with self._cond:
                self._ready.append(index)
                self._cond.notify()
        return hook

    # ------------------------------------------------------------------ optimizer surface
    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def step(self) -> None:
        self.synchronize()
        self.optimizer.step()
        with self._cond:
            self._ready, self._done = [], 0

    def synchronize(self) -> None:
        deadline = time.monotonic() + self.timeout_s
        with self._cond:
            while self._done < len(self.params) and self._error is None:
                if not self._cond.wait(timeout=max(0.0, deadline - time.monotonic())):
                    missing = sorted(set(range(len(self.params))) - set(self._ready))
                    raise TimeoutError(f"mpi-allreduce: gradients not averaged after {self.timeout_s:.0f} s; "
                                       f"parameters without a gradient: {missing[:8]}")
        if self._error is not None:
            raise self._error

    def close(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify()
        self._thread.join(10.0)
        for h in self._handles:
            h.remove()

    # ------------------------------------------------------------------ the background thread
    def _run(self) -> None:
        try:
            while True:
                with self._cond:
                    while not self._stop and len(self._ready) == self._done:
                        self._cond.wait()
                    if self._stop:
                        return
                    ready = self._ready[self._done:]
                take = self._fusable(ready)
                agreed = self._agree(take)
                self._reduce(ready[:agreed])
                with self._cond:
                    self._done += agreed
                    self._cond.notify_all()
        except BaseException as exc:  # noqa: BLE001 - re-raised in step()
            with self._cond:
                self._error = exc
                self._cond.notify_all()

    def _fusable(self, ready: list[int]) -> int:
        """How many of the ready gradients fit in one fusion buffer (at least one)."""
        total, n = 0, 0
        for i in ready:
            total += self.params[i].numel() * self._itemsize
            if n and total > self.fusion_bytes:
                break
            n += 1
        return n

    def _agree(self, count: int) -> int:
        """Horovod's negotiation: the workers fuse what is ready on all of them (the minimum)."""
        send, recv = np.array([count], dtype=np.int64), np.zeros(1, dtype=np.int64)
        self._wait(self.comm.Iallreduce(send, recv, op=MPI.MIN))
        return int(recv[0])

    def _reduce(self, indices: list[int]) -> None:
        views, offset = [], 0
        for i in indices:
            g = self.params[i].grad
            n = g.numel()
            self._fused[offset:offset + n].copy_(g.reshape(-1))
            views.append((g, offset, n))
            offset += n
        buf = self._fused[:offset]
        self._wait(self.comm.Iallreduce(MPI.IN_PLACE, buf.numpy(), op=MPI.SUM))
        buf.div_(self.size)
        for g, start, n in views:
            g.copy_(self._fused[start:start + n].view_as(g))

    def _wait(self, request: MPI.Request) -> None:
        backoff = Backoff()
        deadline = time.monotonic() + self.timeout_s
        while not request.Test():
            if time.monotonic() > deadline:
                raise TimeoutError(f"mpi-allreduce: an MPI_Allreduce over {self.size} workers did not finish "
                                   f"within {self.timeout_s:.0f} s (a worker is dead or stuck)")
            backoff.idle()
