"""A rank that records its process id (and its launcher proxy's) and sleeps: for tests/test_mpirun.py.

Usage: python sleep_rank.py DIR SECONDS
"""

import os
import sys
import time

rank = os.environ.get("PMI_RANK") or os.environ.get("OMPI_COMM_WORLD_RANK") or "0"
path = os.path.join(sys.argv[1], f"pids.{rank}")
with open(path + ".tmp", "w") as f:
    f.write(f"{os.getpid()} {os.getppid()}\n")
os.replace(path + ".tmp", path)  # whole or absent: the test reads it while this sleeps
time.sleep(float(sys.argv[2]))
