"""The ways in, all on one engine: Horovod's ``DistributedOptimizer`` (``optimizer``) and tensor API
(``horovod_api``, its device path ``device_collectives``), the DDP communication hook (``ddp``), the
process-level calls (``process_api``: ``init``, ``rank``, ...), ``join()`` (``worker_join``), broadcasts
(``state_broadcast``) and names for unnamed parameters (``naming``). ``imerge_hooks`` re-exports them.

Imports: ``core``, ``cluster``, ``worker``. Never ``server`` (a server rank's life is ``cluster.startup``'s)
or ``tools``.
"""
