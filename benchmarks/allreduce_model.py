"""The all-reduce peers on the simulator's model and cluster: ``imerge_hooks.simulate.allreduce``.

The model moved into the library (the ``imerge-whatif`` command needs it); this module keeps the
lab's imports working. Its docstring there describes the model.
"""

from imerge_hooks.simulate import (
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

__all__ = ["ALLREDUCE_SCHEDULES", "DDP_BUCKET_BYTES", "DDP_FIRST_BUCKET_BYTES", "HOROVOD_FUSION_BYTES",
           "PEER_SCHEDULES", "STEP_LATENCY_S", "allreduce_bound_s", "ddp_buckets", "hierarchical_allreduce_s",
           "ring_allreduce_s", "simulate_allreduce"]
