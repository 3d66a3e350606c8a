"""The tensor collectives' device path (``imerge_hooks.frontends.device_collectives``): which ops take it, and its
numerics against the MPI path's.

CUDA is not needed: ``scripts/device_path.py`` drives the device path's torch.distributed calls with
the workers' gloo group and CPU tensors (2 workers + 1 server, one launch for every case), and
compares every op's result with the MPI path's (``scripts/device_path_cases.py``). The NCCL run on
GPUs is ``tests/gpu/test_nccl_collectives.py``.
"""

from pathlib import Path

import torch
from mpirun import run_mpi

from imerge_hooks.cluster import session
from imerge_hooks.frontends import device_collectives, horovod_api

SCRIPT = Path(__file__).parent / "scripts" / "device_path.py"

# Every case of scripts/device_path_cases.py, and the script's own checks.
CASES = 45


def test_cpu_tensors_take_the_host_path():
    cpu = [torch.ones(3), torch.zeros(2, 2, dtype=torch.int64)]
    assert device_collectives.device_group(cpu) is None
    assert device_collectives.device_group(cpu, reduce=True) is None
    assert device_collectives.device_group([]) is None
    assert not device_collectives.on_this_gpu(torch.ones(1))
    assert not device_collectives.on_this_gpu("not a tensor")


def test_no_process_group_means_the_host_path(monkeypatch):
    """Even tensors on this worker's GPU stay on the host path without the workers' group (it is never created
    here: creating it is a collective)."""
    monkeypatch.setattr(device_collectives, "on_this_gpu", lambda t: True)
    monkeypatch.setattr(session.state, "process_group", None)  # worker_group() was not called
    monkeypatch.setattr(device_collectives.dist, "is_initialized", lambda: False)  # nor init_process_group()
    assert device_collectives.workers_group() is None
    assert device_collectives.device_group([torch.ones(2)]) is None


def test_reductions_need_a_dtype_nccl_reduces(monkeypatch):
    group = object()
    monkeypatch.setattr(device_collectives, "on_this_gpu", lambda t: True)
    monkeypatch.setattr(device_collectives, "workers_group", lambda: group)
    monkeypatch.setattr(device_collectives, "is_nccl", lambda g: g is group)
    assert device_collectives.device_group([torch.ones(2), torch.ones(2, dtype=torch.float16)], reduce=True) is group
    assert device_collectives.device_group([torch.ones(2, dtype=torch.int16)], reduce=True) is None
    assert device_collectives.device_group([torch.ones(2, dtype=torch.int16)]) is group  # bytes move: any dtype
    monkeypatch.setattr(device_collectives, "is_nccl", lambda g: False)  # a gloo group
    assert device_collectives.device_group([torch.ones(2)]) is None


def test_every_worker_must_offer_the_device_path():
    """The agreed metas decide: one worker without the offer, or one waiting in join() (None), means MPI."""
    group = object()
    assert horovod_api._device_route(group, [{"device": True}, {"device": True}]) is group
    assert horovod_api._device_route(group, [{"device": True}, {"device": False}]) is None
    assert horovod_api._device_route(group, [{"device": True}, None]) is None
    assert horovod_api._device_route(None, [{"device": True}, {"device": True}]) is None


def test_device_path_on_gloo_equals_the_mpi_path():
    """Every op (Average, Sum, Min, Max, Product, factors, integer averages, 16-bit floats, in-place, async,
    grouped, autograd; allgather with uneven rows; broadcast from root 1; alltoall with splits;
    reducescatter with uneven rows) gives the MPI path's result without staging a tensor on the host;
    an allreduce while a worker waits in join(), and one a worker does not offer on the device, go over MPI."""
    run = run_mpi(SCRIPT, 3, servers=1, timeout=120).check()
    assert "FAIL" not in run.stdout, run.stdout[-6000:]
    for rank in range(2):
        assert run.lines(rank, "ALL OK") == ["2"], run.stdout[-6000:] + run.stderr[-3000:]
        passed = run.lines(rank, "PASS")
        assert len(passed) == CASES + 3 and {"decision", "join", "mixed offers"} <= set(passed), passed
        assert run.lines(rank, "REDUCESCATTER")[0] in ("gloo", "emulated")
