"""The worker's gradient path: the engine (gradient intake, buffers and groups, ``engine``, ``buckets``),
a group in flight (``group``), the comm thread (``comm``) with its host aggregation (``host_exchange``),
which push goes next (``schedule``), the CUDA ordering (``streams``), the overlap with the next forward
(``deferral``, ``gates``, ``read_guard``) and the process's key table (``key_table``).

Imports: ``core``, ``cluster`` and ``plan``. Never ``frontends``, ``server`` or ``tools``.
"""
