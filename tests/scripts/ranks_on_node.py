"""Print how many ranks IMerge thinks share this machine, the polling mode it picks, and each rank's host.

``IMERGE_TEST_HOSTS=h0,h0,h1,...`` gives world rank r the host override ``IMERGE_HOST`` = the r-th name
(as one ``-env IMERGE_HOST`` per MPMD block of ``mpiexec`` would); the last rank is a server.
"""

import os

from common import say

from imerge_hooks.cluster.topology import build_topology
from imerge_hooks.core import polling
from imerge_hooks.core._mpi import MPI, ensure_initialized

ensure_initialized()
rank = MPI.COMM_WORLD.Get_rank()
if os.environ.get("IMERGE_TEST_HOSTS"):
    os.environ["IMERGE_HOST"] = os.environ["IMERGE_TEST_HOSTS"].split(",")[rank]
topo = build_topology(1)
mode = polling.configure("auto", topo.ranks_on_node)
say(rank, "RANKS", topo.ranks_on_node, mode)
say(rank, "HOST", topo.host, topo.local_rank, topo.local_size, topo.node_rank, ",".join(topo.worker_hosts))
