"""Which GPU a worker takes, which backend its torch.distributed group gets, and the CUDA-aware
query, as pure rules (no GPU needed; ``tests/gpu`` runs them on one)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from imerge_hooks.cluster import backend, devices
from imerge_hooks.cluster.rank_layout import check_layout
from imerge_hooks.cluster.topology import Topology
from imerge_hooks.core.errors import IMergeConfigError


def topology(rank: int, hosts: list[str], servers: int, gpus: int) -> Topology:
    workers = len(hosts) - servers
    mates = [r for r in range(workers) if hosts[r] == hosts[rank]]
    local = mates.index(rank) if rank < workers else 0
    return Topology(rank, len(hosts), servers, None, None, local, len(mates), hosts=tuple(hosts),
                    gpus=(gpus,) * len(hosts))


def test_workers_take_their_hosts_gpus_in_local_rank_order_and_servers_none():
    hosts = ["a", "a", "b", "b", "a", "b"]  # 4 workers, then a server on each host
    assert [devices.gpu_index(topology(r, hosts, 2, 2)) for r in range(4)] == [0, 1, 0, 1]
    assert [devices.gpu_index(topology(r, hosts, 2, 1)) for r in range(4)] == [0, 0, 0, 0]  # shared


def test_a_host_with_more_workers_than_gpus_is_refused_with_the_fix_unless_sharing():
    hosts = ["a", "a", "a", "b"]  # 3 workers on a, server on b
    with pytest.raises(IMergeConfigError, match=r"host 'a' runs 3 workers but has 2 GPU\(s\).*share_gpus=True"):
        check_layout(topology(0, hosts, 1, 2))
    check_layout(topology(0, hosts, 1, 2), share_gpus=True)
    check_layout(topology(0, hosts, 1, 3))  # the server takes no GPU


def test_nccl_only_where_no_two_workers_share_a_gpu(monkeypatch):
    monkeypatch.delenv("IMERGE_BACKEND", raising=False)
    monkeypatch.setattr(devices.torch.cuda, "is_available", lambda: True)
    hosts = ["a", "a", "a"]
    assert backend.worker_backend(topology(0, hosts, 1, 2)) == "nccl"
    assert backend.worker_backend(topology(0, hosts, 1, 1)) == "gloo"
    assert backend.workers_share_gpus(topology(0, hosts, 1, 1))
    monkeypatch.setenv("IMERGE_BACKEND", "gloo")
    assert backend.worker_backend(topology(0, hosts, 1, 2)) == "gloo"
    monkeypatch.setattr(devices.torch.cuda, "is_available", lambda: False)
    monkeypatch.delenv("IMERGE_BACKEND")
    assert backend.worker_backend(topology(0, hosts, 1, 0)) == "gloo"


def test_cuda_aware_query_reads_the_loaded_mpi_library(monkeypatch):
    # In a child: loading MPI in this process would change what other tests see (test_key_ids).
    probe = ("from mpi4py import MPI; from imerge_hooks.cluster import devices; "
             "print(devices._loaded_mpi_libraries(), devices._query_cuda_support())")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True)
    libraries, supported = out.stdout.rsplit(" ", 1)
    assert "libmpi" in libraries and supported.strip() in ("True", "False"), out.stdout
    assert devices.cuda_aware_mpi(False) is False
    monkeypatch.setattr(devices.torch.cuda, "is_available", lambda: False)
    assert devices.cuda_aware_mpi(None) is False and devices.cuda_aware_mpi(True) is False  # no CUDA, no device buffers
    monkeypatch.setattr(devices.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(devices, "_query_cuda_support", lambda: True)
    assert devices.cuda_aware_mpi(None) is True
    monkeypatch.setattr(devices, "_query_cuda_support", lambda: False)
    assert devices.cuda_aware_mpi(None) is False
    assert devices.cuda_aware_mpi(True) is True  # asked for: warned, then done as asked
