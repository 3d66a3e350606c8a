"""The process, its place in the job and start-up: who runs where (``topology``, ``rank_layout``),
object collectives with deadlines (``collectives``) and the waits on worker 0 (``messages``), failing
fast (``failure``), GPUs and the torch backend (``devices``, ``backend``), the workers' torch.distributed
world (``rendezvous``, ``torch_world``), this process's session state (``session``) and starting and
stopping the roles (``startup``).

Imports: ``core``; ``session`` holds the worker's comm thread and ``startup`` starts the roles, so those
two also import ``worker.comm`` and ``server``. Never ``frontends`` or ``tools``.
"""
