"""Ring and hierarchical all-reduce on the simulator's cluster: the peers a PS is compared with.

:func:`simulate_allreduce` replays the iterations of DDP (``ddp``: static buckets, gloo's ring),
of Horovod on MPI (``mpi-allreduce``: fuse what is ready whenever the channel is free) or of
Horovod's hierarchical all-reduce (``hierarchical``: the same fusion, each all-reduce inside the
hosts first, see :func:`hierarchical_allreduce_s`) on the same
:class:`~imerge_hooks.simulate.ModelSpec` and :class:`~imerge_hooks.simulate.ClusterSpec` as
:func:`imerge_hooks.simulate.simulate` (the servers of the spec are not used; only
``hierarchical`` reads the workers' hosts). The model:

* **One all-reduce** of ``m`` bytes over W workers is a ring: 2(W-1) steps (reduce-scatter, then
  all-gather), in each of which every worker sends m/W bytes to its successor and receives m/W
  from its predecessor, on its own egress and ingress link, and pays ``step_latency_s``:
  ``2 (W-1) (step_latency_s + m / (W B))``. Every worker's link carries 2(W-1)/W of the
  bytes each way, the all-reduce bound. With ``fabric_Bps`` a step also moves at most that
  rate in all (W flows of m/W). Laid out host by host the ring crosses each NIC once each way;
  its hops inside a host are taken to be free (the benchmarks' reading, which favours it on hosts
  of several workers) unless ``in_host_hops``, where they share the host's ``local_Bps``.
* **Hierarchical all-reduce** (``hierarchical``; Horovod's ``HOROVOD_HIERARCHICAL_ALLREDUCE``,
  NCCL on multi-GPU nodes) of ``m`` bytes over N hosts of G workers: a reduce-scatter inside
  each host over its local link, a ring all-reduce of the shards across the hosts over the NICs,
  an all-gather inside each host (:func:`hierarchical_allreduce_s`). Only the middle phase
  crosses a NIC, 2(N-1)/N of the bytes each way.
* **Buckets.** ``ddp``: DDP's rule on the tensors in ready order (last layer first): a bucket
  closes once it holds at least its cap, the first bucket ``first_bucket_bytes`` (DDP: 1 MiB),
  the others ``bucket_bytes`` (``bucket_cap_mb``, DDP: 25 MiB); a bucket's all-reduce starts
  when its last tensor is ready and the previous one has finished. ``mpi-allreduce`` and
  ``hierarchical``: whenever the channel is free, every gradient ready so far (in ready order, up
  to ``fusion_bytes``, Horovod's 64 MiB; at least one) goes in one all-reduce, after a
  negotiation of ceil(log2 W) latency steps (Horovod's readiness allreduce).
* **Iteration.** Forward of every layer, backward with the all-reduces overlapping it; the
  optimizer steps when the last all-reduce ends, and only then does the next forward start
  (neither peer overlaps communication with the next forward). All workers are symmetric.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Sequence

from ..plan.planner import fill_buckets
from .results import Event, SimResult
from .specs import ClusterSpec, ModelSpec

PEER_SCHEDULES = ("ddp", "mpi-allreduce")  # the all-reduce peers the benchmarks measure
ALLREDUCE_SCHEDULES = (*PEER_SCHEDULES, "hierarchical")
DDP_BUCKET_BYTES = 25 * 1024 * 1024
DDP_FIRST_BUCKET_BYTES = 1024 * 1024
HOROVOD_FUSION_BYTES = 64 * 1024 * 1024
STEP_LATENCY_S = 100e-6  # per ring step: a TCP round on a LAN plus the library's handling
LOCAL_STEP_LATENCY_S = 10e-6  # per step inside a host (shared memory, NVLink): a few us in NCCL


def ring_allreduce_s(nbytes: float, workers: int, bandwidth_Bps: float, step_latency_s: float = STEP_LATENCY_S,
                     fabric_Bps: float | None = None, per_host: int = 1, local_Bps: float | None = None) -> float:
    """Time of one ring all-reduce of ``nbytes`` over ``workers`` hosts with links of ``bandwidth_Bps``.

    ``per_host``/``local_Bps``: the ring is laid out host by host over hosts of ``per_host`` workers, and
    the G-1 hops inside a host share the host's local link of ``local_Bps`` (as the simulator's transfers
    inside a host do), so a step lasts at least (G-1) m/W / ``local_Bps``. None (the default, the
    benchmarks' reading): the hops inside a host cost nothing beyond the NIC's."""
    if workers <= 1 or nbytes <= 0:
        return 0.0
    chunk = nbytes / workers
    step = chunk / bandwidth_Bps
    if fabric_Bps is not None:
        step = max(step, nbytes / fabric_Bps)  # W flows of m/W at once
    if local_Bps is not None and per_host > 1:
        step = max(step, (per_host - 1) * chunk / local_Bps)
    return 2 * (workers - 1) * (step_latency_s + step)


def hierarchical_allreduce_s(nbytes: float, hosts: int, per_host: int, bandwidth_Bps: float, local_Bps: float,
                             reduce_Bps: float, step_latency_s: float = STEP_LATENCY_S,
                             local_latency_s: float = LOCAL_STEP_LATENCY_S, fabric_Bps: float | None = None) -> float:
    """Time of one hierarchical all-reduce of ``nbytes`` (m) over ``hosts`` (N) hosts of ``per_host`` (G)
    workers each.

    ``local_Bps`` is a host's local link, shared by all transfers between its workers, and
    ``reduce_Bps`` the rate at which one worker adds bytes: the simulator's ``ClusterSpec.local_Bps``
    and ``reduce_Bps``, which its PS host aggregation uses. Three phases, one after the other
    (Horovod's hierarchical all-reduce; NCCL inside a node):

    1. reduce-scatter inside each host: G-1 steps in which every worker sends m/G bytes to its in-host
       successor (G transfers of m/G at once on the local link) and adds m/G bytes:
       ``(G-1) (local_latency_s + m/local_Bps + m/(G reduce_Bps))``, (G-1) m bytes on the local link
       in all, what the PS's host aggregation moves there; afterwards each worker holds the host's sum
       of one m/G shard;
    2. across the hosts, each worker all-reduces its shard with the workers holding the same shard on
       the other hosts: G rings of m/G bytes at once, sharing the host's NIC, which together move what
       one ring of m bytes over N hosts moves: :func:`ring_allreduce_s` ``(m, N)``, 2(N-1)/N of the
       bytes each way on every NIC;
    3. all-gather inside each host: ``(G-1) (local_latency_s + m/local_Bps)``.

    With one worker per host it is the ring over the hosts; with one host, phases 1 and 3 alone.
    """
    if hosts < 1 or per_host < 1:
        raise ValueError(f"IMerge hierarchical_allreduce_s: hosts and per_host must be >= 1, got {hosts}, {per_host}")
    if hosts * per_host <= 1 or nbytes <= 0:
        return 0.0
    step_inside = local_latency_s + nbytes / local_Bps  # G transfers of m/G at once on the local link
    inside = (per_host - 1) * (2 * step_inside + nbytes / per_host / reduce_Bps)
    return inside + ring_allreduce_s(nbytes, hosts, bandwidth_Bps, step_latency_s, fabric_Bps)


def workers_per_host(cluster: ClusterSpec) -> tuple[int, int]:
    """(hosts, workers per host) of the cluster's workers; ValueError unless every host has as many."""
    counts = Counter(cluster.rank_hosts[:cluster.workers])
    if len(set(counts.values())) != 1:
        raise ValueError(f"IMerge simulate_allreduce: hierarchical needs the same number of workers on every host, "
                         f"got {sorted(counts.values())}")
    return len(counts), next(iter(counts.values()))


def allreduce_bound_s(total_bytes: float, workers: int, bandwidth_Bps: float) -> float:
    """The bandwidth bound of all-reduce: every link carries 2(W-1)/W of the bytes each way."""
    return 2 * (workers - 1) / workers * total_bytes / bandwidth_Bps if workers > 1 else 0.0


def ddp_buckets(sizes: Sequence[int], order: Sequence[int], bucket_bytes: int,
                first_bucket_bytes: int) -> list[list[int]]:
    """DDP's bucket assignment: tensors in ``order``; a bucket closes once it reaches its cap."""
    return fill_buckets(order, sizes, bucket_bytes, first_cap=first_bucket_bytes)


def _check_args(peer: str, step_latency_s: float, **counts: int) -> None:
    """ValueError for an unknown peer, a count below 1 or a negative or infinite step latency."""
    if peer not in ALLREDUCE_SCHEDULES:
        raise ValueError(f"IMerge simulate_allreduce: unknown peer {peer!r}; "
                         f"choose one of {', '.join(ALLREDUCE_SCHEDULES)}")
    for name, value in counts.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"IMerge simulate_allreduce: {name} must be an int >= 1, got {value!r}")
    if not (math.isfinite(step_latency_s) and step_latency_s >= 0):
        raise ValueError(f"IMerge simulate_allreduce: step_latency_s must be >= 0, got {step_latency_s!r}")


def _ready_times(model: ModelSpec, cluster: ClusterSpec) -> tuple[float, float, list[int], list[float], list[int]]:
    """(forward time, backward time, tensor sizes, each tensor's ready time from the start of the backward,
    the ready order: last layer first, later-registered first inside a layer)."""
    scale = cluster.time_scale
    fwd = sum(layer.forward_s for layer in model.layers) * scale
    sizes = [int(b) for b in model.tensor_bytes]
    ready_at: list[float] = []
    elapsed = 0.0
    per_layer_ready = []
    for layer in reversed(model.layers):
        elapsed += layer.backward_s * scale
        per_layer_ready.append(elapsed)
    per_layer_ready.reverse()
    for index, layer in enumerate(model.layers):
        ready_at += [per_layer_ready[index]] * len(layer.param_bytes)
    bwd = per_layer_ready[0] if model.layers else 0.0
    order = sorted(range(len(sizes)), key=lambda i: (ready_at[i], -i))
    return fwd, bwd, sizes, ready_at, order


def _reduce_time(peer: str, cluster: ClusterSpec, step_latency_s: float,
                 in_host_hops: bool) -> Callable[[float], float]:
    """The time of one all-reduce of ``nbytes`` under ``peer``: hierarchical, or a ring over all workers."""
    if peer == "hierarchical":
        hosts, per_host = workers_per_host(cluster)

        def reduce_s(nbytes: float) -> float:
            return hierarchical_allreduce_s(nbytes, hosts, per_host, cluster.bandwidth_Bps, cluster.local_Bps,
                                            cluster.reduce_Bps, step_latency_s, fabric_Bps=cluster.fabric_Bps)
        return reduce_s
    per_host, local = (workers_per_host(cluster)[1], cluster.local_Bps) if in_host_hops else (1, None)

    def ring_s(nbytes: float) -> float:
        return ring_allreduce_s(nbytes, cluster.workers, cluster.bandwidth_Bps, step_latency_s,
                                cluster.fabric_Bps, per_host, local)
    return ring_s


_Span = tuple[list[int], float, float]  # (tensors, start, end) from the start of the backward


def _ddp_spans(buckets: list[list[int]], sizes: Sequence[int], ready_at: Sequence[float],
               reduce_s: Callable[[float], float]) -> list[_Span]:
    """DDP: each bucket's all-reduce once its last tensor is ready and the previous one has finished."""
    spans: list[_Span] = []
    free = 0.0
    for bucket in buckets:
        start = max(free, max(ready_at[i] for i in bucket))
        free = start + reduce_s(sum(sizes[i] for i in bucket))
        spans.append((bucket, start, free))
    return spans


def _fused_spans(order: Sequence[int], sizes: Sequence[int], ready_at: Sequence[float],
                 reduce_s: Callable[[float], float], fusion_bytes: int, negotiate: float) -> list[_Span]:
    """Horovod: whenever the channel is free, what is ready (up to ``fusion_bytes``, at least one tensor) in
    one all-reduce, after ``negotiate`` seconds."""
    spans: list[_Span] = []
    free = 0.0
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
        spans.append((take, start, free))
    return spans


def _timeline(spans: Sequence[_Span], sizes: Sequence[int], workers: int, iterations: int, fwd: float, bwd: float,
              iteration_s: float) -> list[Event]:
    """Every worker's forward, backward and all-reduces of each iteration (all workers alike)."""
    timeline: list[Event] = []
    for it in range(iterations):
        t0 = it * iteration_s
        for r in range(workers):
            track = f"worker {r}"
            timeline.append(Event(track, "forward", t0, t0 + fwd, "forward"))
            timeline.append(Event(track, "backward", t0 + fwd, t0 + fwd + bwd, "backward"))
            for k, (tensors, start, end) in enumerate(spans):
                nbytes = sum(sizes[i] for i in tensors)
                timeline.append(Event(track, f"all-reduce {k} ({len(tensors)} tensors)", t0 + fwd + start,
                                      t0 + fwd + end, "push", nbytes))
    return timeline


def simulate_allreduce(model: ModelSpec, cluster: ClusterSpec, peer: str = "ddp", *,
                       bucket_bytes: int = DDP_BUCKET_BYTES, first_bucket_bytes: int = DDP_FIRST_BUCKET_BYTES,
                       fusion_bytes: int = HOROVOD_FUSION_BYTES, step_latency_s: float = STEP_LATENCY_S,
                       iterations: int = 3, in_host_hops: bool = False) -> SimResult:
    """Simulate ``iterations`` iterations of ``model`` under ``peer`` (``ddp``, ``mpi-allreduce`` or
    ``hierarchical``, whose hosts are the cluster's ``hosts`` and in-host rates its ``local_Bps`` and
    ``reduce_Bps``; ``step_latency_s`` is the latency of a step across hosts). ``in_host_hops``: the
    rings of ``ddp`` and ``mpi-allreduce`` charge their hops inside a host to its ``local_Bps``
    (:func:`ring_allreduce_s`); False, as the benchmarks: they are free."""
    _check_args(peer, step_latency_s, bucket_bytes=bucket_bytes, first_bucket_bytes=first_bucket_bytes,
                fusion_bytes=fusion_bytes, iterations=iterations)
    model.check()
    fwd, bwd, sizes, ready_at, order = _ready_times(model, cluster)
    reduce_s = _reduce_time(peer, cluster, step_latency_s, in_host_hops)
    if peer == "ddp":
        spans = _ddp_spans(ddp_buckets(sizes, order, bucket_bytes, first_bucket_bytes), sizes, ready_at, reduce_s)
    else:
        negotiate = math.ceil(math.log2(cluster.workers)) * step_latency_s if cluster.workers > 1 else 0.0
        spans = _fused_spans(order, sizes, ready_at, reduce_s, fusion_bytes, negotiate)
    groups = [tensors for tensors, _, _ in spans]
    comm_end = max((end for _, _, end in spans), default=0.0)
    iteration_s = fwd + max(bwd, comm_end)
    timeline = _timeline(spans, sizes, cluster.workers, iterations, fwd, bwd, iteration_s)
    throughput = cluster.workers * model.batch_size / iteration_s if iteration_s > 0 else math.inf
    return SimResult(schedule=peer, iteration_s=iteration_s, throughput=throughput,
                     iteration_times=[iteration_s] * iterations, timeline=timeline, groups=groups, keys=[],
                     workers=cluster.workers, servers=0)
