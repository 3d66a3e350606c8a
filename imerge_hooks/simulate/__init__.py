"""Discrete-event simulator of IMerge training iterations (pure Python, no MPI): what-if at scale.

Given per-layer compute times (a :class:`ModelSpec`, e.g. from ``benchmarks/profiles/*.json``)
and a cluster (:class:`ClusterSpec`), :func:`simulate` replays ``iterations`` training
iterations of every worker under one schedule and returns the steady-state iteration time,
the throughput and a timeline (:meth:`SimResult.to_chrome_trace` writes it for Perfetto)::

    from imerge_hooks.simulate import ClusterSpec, ModelSpec, simulate
    model = ModelSpec.from_profile_json("benchmarks/profiles/resnet50-cpu.json")
    cluster = ClusterSpec(workers=16, servers=4, bandwidth_Bps=1.25e9, startup_s=50e-6)
    for schedule in ("wfbp", "adaptive-ps", "imerge"):
        print(schedule, simulate(model, cluster, schedule).throughput)

What is modelled (and how; each choice mirrors the runtime in ``engine``/``scheduler``/``server``):

* **Compute.** Each worker runs the forward of layers 0..L-1, then the backward of layers
  L-1..0, one after another; times are the spec's times times ``ClusterSpec.time_scale``.
  A tensor's gradient is ready when its layer's backward ends; the gradient-ready order is
  reverse registration order (ties inside a layer: later-registered first, as the profiler).
* **Plan.** Groups come from :func:`imerge_hooks.plan.planner.plan` on the tensors in ready order,
  with ready times measured from the start of backward (``none`` for default/wfbp/priority:
  one group per tensor). ``mgwfbp`` and ``optimal`` need a cost model: ``cost_model`` or, when
  None, :func:`calibrate_model` (what ``python -m imerge_hooks.plan.calibrate`` would measure on
  the simulated cluster); ``mgwfbp`` gets the alpha-beta line fitted to a PSModel's table,
  as ``replan`` does. ``optimal`` (adaptive-ps, imerge) also searches, as the engine does
  (:mod:`imerge_hooks.plan.search`): each candidate plan is simulated on this model and
  cluster and the fastest is kept (``plan_search=False``: the DP's plan alone).
* **Keys and placement.** ``priority``/``imerge`` cut each group into keys of at most
  ``partition_bytes`` (by bytes; the runtime cuts by elements, the same for 4-byte floats and
  a power-of-two partition size); every group of at least S x 64 KiB is also spread over
  the S servers in equal keys. Keys are placed in plan order, each on the server with the
  fewest bytes so far (``layout.Placement``).
* **Worker send queue** (``CommThread``). ``default`` submits every group, in plan order,
  after the whole backward; other schedules submit a group as soon as all its tensors are
  ready. A submitted group's keys enter a ready queue: FIFO, or lowest ``priority`` first
  (the group's smallest tensor index = its front-most layer) when the schedule has priority.
  With ``stagger`` worker r rotates each group's key sequence to start at server r % S.
  Partitioned schedules keep at most ``credit_bytes`` of pushes in flight (always at least
  one; head-of-line: the next key waits until it fits); credit returns when a push has been
  delivered to the server. Non-partitioned schedules have no credit limit. A started push is
  queued on its connection (below), so priority reorders only what waits for credit.
  With ``ClusterSpec.worker_message_s`` > 0 the worker's comm thread is a serial resource:
  posting a push and handling a result each take it that long, in the order they come (a push
  flows only once posted; a result counts only once handled). Keys wait in the runtime's own
  :class:`~imerge_hooks.worker.schedule.ReadyQueue` under its :class:`~imerge_hooks.worker.schedule.Credit`.
* **Network: fluid, max-min fair (processor sharing).** Every host has an egress and an
  ingress link of ``bandwidth_Bps`` (workers: push out / pull in; servers: push in / result
  out). A message in flight is a flow through its sender's egress and its receiver's
  ingress; the rates of all flows are the max-min fair allocation over all links,
  recomputed whenever a flow starts or ends (like TCP through netlab's shaped ports). Between
  one sender and one receiver messages go in order, one at a time (one MPI connection per
  pair: MPI's non-overtaking rule), so at most one flow per (sender, receiver) pair.
  No propagation latency (fold it into ``startup_s``).
  **Uneven incast sharing** (``ClusterSpec.share_cv > 0``): TCP flows from many senders into one
  shaped port do not get equal shares: the workers' push rates into a saturated server spread
  unevenly, and a share persists for up to about a second, while results (one sender, many
  receivers) share evenly (``benchmarks/netlab/linkmon.py`` measures both; ``benchmarks/run.py``
  feeds them to the validation). So every push connection (worker, server) gets a weight,
  log-normal with mean 1 and that CV, drawn afresh every ``share_period_s`` (deterministic per
  connection and period, from ``share_seed``), and rates are the *weighted* max-min fair
  allocation. It matters
  because a key completes only when its slowest push has arrived. With ``ClusterSpec.fabric_Bps`` every
  flow also crosses one shared link of that rate: what a cluster moves with every link busy both
  ways at once (``benchmarks/netlab/duplex_probe.py``), a little less than its links' goodput.
* **Server.** Each push, once delivered, costs ``startup_s`` of the server's single thread
  (the Python loop's per-message probe/receive/sum work), FIFO over all workers' pushes, so a
  W-way incast pays W startups in a row. When a key has all W pushes the server sends the sum
  to all W workers at once (W flows sharing its egress). Results cost no server time.
* **Completion and the next iteration.** A group is done at a worker when all its keys'
  results arrived there. Without overlap the worker's next forward starts when all its groups
  are done; with overlap (``imerge``) the forward of each layer waits only for the groups
  holding that layer's tensors (front layers first). Update and optimizer time are ignored.

``SimResult.iteration_s`` is the time between consecutive starts of layer 0's forward (the
latest worker) in the steady state: never the first iteration (it starts with no communication
pending); a run whose last two iterations differ by more than 1% runs again with twice the
iterations (up to 24), and the mean of the last half counts (``SimResult.iteration_times`` has
them all); with ``iterations=1`` it is that single iteration.

The all-reduce peers (DDP's and Horovod's ring, Horovod's hierarchical all-reduce) run on the same
model and cluster with :func:`simulate_allreduce` (``allreduce``); the ``imerge-whatif`` command
(``imerge_hooks.tools.whatif``) sets them beside IMerge for a cluster described on its command line.
"""

from .allreduce import (
    ALLREDUCE_SCHEDULES,
    DDP_BUCKET_BYTES,
    DDP_FIRST_BUCKET_BYTES,
    HOROVOD_FUSION_BYTES,
    PEER_SCHEDULES,
    STEP_LATENCY_S,
    allreduce_bound_s,
    ddp_buckets,
    hierarchical_allreduce_s,
    ring_allreduce_s,
    simulate_allreduce,
)
from .loop import connection_weight
from .results import Event, KeyInfo, SimResult
from .run import calibrate_model, fold_factor, search_by_simulation, simulate
from .specs import EVENT_KINDS, FOLD_ABOVE, FOLD_WORKERS, ClusterSpec, LayerSpec, ModelSpec

__all__ = ["ALLREDUCE_SCHEDULES", "DDP_BUCKET_BYTES", "DDP_FIRST_BUCKET_BYTES", "EVENT_KINDS", "FOLD_ABOVE",
           "FOLD_WORKERS", "HOROVOD_FUSION_BYTES", "PEER_SCHEDULES", "STEP_LATENCY_S", "ClusterSpec", "Event",
           "KeyInfo", "LayerSpec", "ModelSpec", "SimResult", "allreduce_bound_s", "calibrate_model",
           "connection_weight", "ddp_buckets", "fold_factor", "hierarchical_allreduce_s", "ring_allreduce_s",
           "search_by_simulation", "simulate", "simulate_allreduce"]
