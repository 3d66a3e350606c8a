"""Run a pytest module on every rank of an MPI job, as Horovod's suites run (``mpiexec -n W+S pytest FILE``).

Usage: python pytest_job.py SUITE [PYTEST ARGS...]
Each rank runs the whole module; a rank that reaches the end prints ``@<rank> EXIT <pytest's code>`` (a
server's process ends inside the suite once its workers are done, so servers never print it).
"""

import os
import sys

import pytest

rank = os.environ.get("PMI_RANK", os.environ.get("OMPI_COMM_WORLD_RANK", "?"))
code = pytest.main(["-q", "-p", "no:cacheprovider", "--noconftest", "-s", "-o", "addopts=", *sys.argv[1:]])
print(f"\n@{rank} EXIT {int(code)}", flush=True)
sys.exit(int(code))
