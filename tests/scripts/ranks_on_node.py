"""Print how many ranks IMerge thinks share this machine and the polling mode it picks."""

from common import say

from imerge_hooks import polling
from imerge_hooks._mpi import MPI, ensure_initialized
from imerge_hooks.topology import build_topology

ensure_initialized()
topo = build_topology(1)
mode = polling.configure("auto", topo.ranks_on_node)
say(MPI.COMM_WORLD.Get_rank(), "RANKS", topo.ranks_on_node, mode)
