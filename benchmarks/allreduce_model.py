"""Ring all-reduce on the simulator's cluster: the peers a PS is compared with.

:func:`simulate_allreduce` replays the iterations of DDP (``ddp``: static buckets, gloo's ring)
or of Horovod on MPI (``mpi-allreduce``: fuse what is ready whenever the channel is free) on
the same :class:`~imerge_hooks.simulate.ModelSpec` and :class:`~imerge_hooks.simulate.ClusterSpec`
as :func:`imerge_hooks.simulate.simulate` (the servers of the spec are not used). The model:

* **One all-reduce** of ``m`` bytes over W workers is a ring: 2(W-1) steps (reduce-scatter, then
  all-gather), in each of which every worker sends m/W bytes to its successor and receives m/W
  from its predecessor, on its own egress and ingress link, and pays ``step_latency_s``:
  ``2 (W-1) (step_latency_s + m / (W B))``. Every worker's link carries 2(W-1)/W of the
  bytes each way, the all-reduce bound. With ``fabric_Bps`` a step also moves at most that
  rate in all (W flows of m/W).
* **Buckets.** ``ddp``: DDP's rule on the tensors in ready order (last layer first): a bucket
  closes once it holds at least its cap, the first bucket ``first_bucket_bytes`` (DDP: 1 MiB),
  the others ``bucket_bytes`` (``bucket_cap_mb``, DDP: 25 MiB); a bucket's all-reduce starts
  when its last tensor is ready and the previous one has finished. ``mpi-allreduce``: whenever
  the channel is free, every gradient ready so far (in ready order, up to ``fusion_bytes``,
  Horovod's 64 MiB; at least one) goes in one all-reduce, after a negotiation of
  ceil(log2 W) latency steps (Horovod's readiness allreduce).
* **Iteration.** Forward of every layer, backward with the all-reduces overlapping it; the
  optimizer steps when the last all-reduce ends, and only then does the next forward start
  (neither peer overlaps communication with the next forward). All workers are symmetric.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from imerge_hooks.simulate import ClusterSpec, Event, ModelSpec, SimResult

PEER_SCHEDULES = ("ddp", "mpi-allreduce")
DDP_BUCKET_BYTES = 25 * 1024 * 1024
DDP_FIRST_BUCKET_BYTES = 1024 * 1024
HOROVOD_FUSION_BYTES = 64 * 1024 * 1024
STEP_LATENCY_S = 100e-6  # per ring step: a TCP round on a LAN plus the library's handling


def ring_allreduce_s(nbytes: float, workers: int, bandwidth_Bps: float, step_latency_s: float = STEP_LATENCY_S,
                     fabric_Bps: float | None = None) -> float:
    """Time of one ring all-reduce of ``nbytes`` over ``workers`` hosts with links of ``bandwidth_Bps``."""
    if workers <= 1 or nbytes <= 0:
        return 0.0
    chunk = nbytes / workers
    step = chunk / bandwidth_Bps
    if fabric_Bps is not None:
        step = max(step, nbytes / fabric_Bps)  # W flows of m/W at once
    return 2 * (workers - 1) * (step_latency_s + step)


def allreduce_bound_s(total_bytes: float, workers: int, bandwidth_Bps: float) -> float:
    """The bandwidth bound of all-reduce: every link carries 2(W-1)/W of the bytes each way."""
    return 2 * (workers - 1) / workers * total_bytes / bandwidth_Bps if workers > 1 else 0.0


def ddp_buckets(sizes: Sequence[int], order: Sequence[int], bucket_bytes: int,
                first_bucket_bytes: int) -> list[list[int]]:
    """DDP's bucket assignment: tensors in ``order``; a bucket closes once it reaches its cap."""
    buckets: list[list[int]] = []
    current: list[int] = []
    filled = 0
    for i in order:
        current.append(i)
        filled += sizes[i]
        cap = first_bucket_bytes if not buckets else bucket_bytes
        if filled >= cap:
            buckets.append(current)
            current, filled = [], 0
    if current:
        buckets.append(current)
    return buckets


def simulate_allreduce(model: ModelSpec, cluster: ClusterSpec, peer: str = "ddp", *,
                       bucket_bytes: int = DDP_BUCKET_BYTES, first_bucket_bytes: int = DDP_FIRST_BUCKET_BYTES,
                       fusion_bytes: int = HOROVOD_FUSION_BYTES, step_latency_s: float = STEP_LATENCY_S,
                       iterations: int = 3) -> SimResult:
    """Simulate ``iterations`` iterations of ``model`` under ``peer`` (``ddp`` or ``mpi-allreduce``)."""
    if peer not in PEER_SCHEDULES:
        raise ValueError(f"IMerge simulate_allreduce: unknown peer {peer!r}; choose one of {', '.join(PEER_SCHEDULES)}")
    for name, value in (("bucket_bytes", bucket_bytes), ("first_bucket_bytes", first_bucket_bytes),
                        ("fusion_bytes", fusion_bytes), ("iterations", iterations)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"IMerge simulate_allreduce: {name} must be an int >= 1, got {value!r}")
    if not (math.isfinite(step_latency_s) and step_latency_s >= 0):
        raise ValueError(f"IMerge simulate_allreduce: step_latency_s must be >= 0, got {step_latency_s!r}")
    model.check()
    scale = cluster.time_scale
    fwd = sum(layer.forward_s for layer in model.layers) * scale
    sizes = [int(b) for b in model.tensor_bytes]
    ready_at: list[float] = []  # from the start of the backward
    elapsed = 0.0
    per_layer_ready = []
    for layer in reversed(model.layers):
        elapsed += layer.backward_s * scale
        per_layer_ready.append(elapsed)
    per_layer_ready.reverse()
    for index, layer in enumerate(model.layers):
        ready_at += [per_layer_ready[index]] * len(layer.param_bytes)
    bwd = per_layer_ready[0] if model.layers else 0.0
    order = sorted(range(len(sizes)), key=lambda i: (ready_at[i], -i))  # ready order: last layer first

    def reduce_s(nbytes: float) -> float:
        return ring_allreduce_s(nbytes, cluster.workers, cluster.bandwidth_Bps, step_latency_s, cluster.fabric_Bps)

    spans: list[tuple[list[int], float, float]] = []  # (tensors, start, end) from the start of the backward
    free = 0.0
    if peer == "ddp":
        groups = ddp_buckets(sizes, order, bucket_bytes, first_bucket_bytes)
        for bucket in groups:
            start = max(free, max(ready_at[i] for i in bucket))
            free = start + reduce_s(sum(sizes[i] for i in bucket))
            spans.append((bucket, start, free))
    else:
        groups = []
        negotiate = math.ceil(math.log2(cluster.workers)) * step_latency_s if cluster.workers > 1 else 0.0
        pos = 0
        while pos < len(order):
            start = max(free, ready_at[order[pos]])
            take, filled = [], 0
            while pos < len(order) and ready_at[order[pos]] <= start:
                nbytes = sizes[order[pos]]
                if take and filled + nbytes > fusion_bytes:
                    break
                take.append(order[pos])
                filled += nbytes
                pos += 1
            free = start + negotiate + reduce_s(filled)
            groups.append(take)
            spans.append((take, start, free))
    comm_end = max((end for _, _, end in spans), default=0.0)
    iteration_s = fwd + max(bwd, comm_end)
    timeline: list[Event] = []
    for it in range(iterations):
        t0 = it * iteration_s
        for r in range(cluster.workers):
            track = f"worker {r}"
            timeline.append(Event(track, "forward", t0, t0 + fwd, "forward"))
            timeline.append(Event(track, "backward", t0 + fwd, t0 + fwd + bwd, "backward"))
            for k, (tensors, start, end) in enumerate(spans):
                nbytes = sum(sizes[i] for i in tensors)
                timeline.append(Event(track, f"all-reduce {k} ({len(tensors)} tensors)", t0 + fwd + start,
                                      t0 + fwd + end, "push", nbytes))
    throughput = cluster.workers * model.batch_size / iteration_s if iteration_s > 0 else math.inf
    return SimResult(schedule=peer, iteration_s=iteration_s, throughput=throughput,
                     iteration_times=[iteration_s] * iterations, timeline=timeline, groups=groups, keys=[],
                     workers=cluster.workers, servers=0)
