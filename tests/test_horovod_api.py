"""``import imerge_hooks as hvd`` runs Horovod scripts: tensor collectives, info, Compression, DistributedOptimizer.

One launch per (workers, servers) cell runs every multi-worker check (``scripts/horovod_api.py``
asserts inside, on every worker); one single-process job; the rest needs no MPI.
"""

import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from mpirun import run_mpi

import imerge_hooks as hvd
from imerge_hooks.core.compression import compression_name
from imerge_hooks.core.errors import IMergeConfigError
from imerge_hooks.frontends import horovod_api

SCRIPT = Path(__file__).parent / "scripts" / "horovod_api.py"


def assert_all_passed(run, workers: int, servers: int) -> None:
    assert "FAIL" not in run.stdout, run.stdout[-6000:] + run.stderr[-3000:]
    for rank in range(workers):
        assert run.lines(rank, "ALL OK") == [f"{workers} {servers}"], run.stdout[-6000:] + run.stderr[-3000:]


def test_two_workers_and_a_missing_worker_is_named():
    """Every check on 2 workers + 1 server; then worker 0 runs an allreduce worker 1 never joins."""
    run = run_mpi(SCRIPT, 3, "--lonely", servers=1, timeout=60)
    assert_all_passed(run, 2, 1)
    # the server's process ended inside init(): a test runner catching SystemExit would not run on there
    assert "SERVER WENT ON" not in run.stdout, run.stdout[-3000:]
    timeout = run.lines(0, "TIMEOUT")
    assert len(timeout) == 1 and "allreduce of tensor 'lonely'" in timeout[0], run.stdout[-3000:]
    assert "worker(s) [1] did not arrive" in timeout[0]
    assert run.returncode != 0  # the timeout is fatal: worker 0's exit aborts the job instead of hanging


def test_three_workers_and_an_uncaught_mismatch_ends_the_job():
    """Every check on 3 workers + 1 server; then worker 0 calls barrier() while workers 1 and 2
    broadcast an object, uncaught: every worker raises naming both calls, and the job exits non-zero."""
    run = run_mpi(SCRIPT, 4, "--uncaught-mismatch", servers=1, timeout=60)
    assert_all_passed(run, 3, 1)
    for rank in range(3):
        said = run.lines(rank, "MISMATCH")
        assert len(said) == 1 and "barrier()" in said[0] and "broadcast of object 'last' from worker 0" in said[0], \
            run.stdout[-3000:]
        assert f"worker {rank} (world rank {rank})" in said[0]
    assert "uncaught IMergeMismatchError" in run.stderr, run.stderr[-3000:]
    assert run.returncode != 0


def test_single_process_job_returns_local_values():
    run = run_mpi(SCRIPT, 1, servers=0, timeout=60).check()
    assert_all_passed(run, 1, 0)


# ---------------------------------------------------------------------- no MPI
def test_names_are_horovods():
    assert (hvd.Average, hvd.Sum, hvd.Adasum, hvd.Min, hvd.Max, hvd.Product) == (0, 1, 2, 3, 4, 5)
    for name in ("allreduce", "allreduce_", "allreduce_async", "allreduce_async_", "grouped_allreduce", "allgather",
                 "allgather_object", "broadcast", "broadcast_", "broadcast_async", "broadcast_async_", "alltoall",
                 "reducescatter", "barrier", "synchronize", "poll", "join", "init", "shutdown", "is_initialized",
                 "size", "rank", "local_size", "local_rank", "cross_size", "cross_rank", "broadcast_parameters",
                 "broadcast_optimizer_state", "broadcast_object", "DistributedOptimizer"):
        assert callable(getattr(hvd, name)), name
    assert hvd.mpi_built() and hvd.mpi_threads_supported() and not hvd.gloo_built() and not hvd.nccl_built()
    assert hvd.cuda_built() == torch.backends.cuda.is_built() and not hvd.rocm_built()


def test_compression_fp16_as_horovods_test():
    for dtype in (torch.float32, torch.float64):
        tensor = torch.ones(5, 5, 5, dtype=dtype)
        compressed, ctx = hvd.Compression.fp16.compress(tensor)
        assert compressed.dtype == torch.float16
        restored = hvd.Compression.fp16.decompress(compressed, ctx)
        assert restored.dtype == dtype and torch.equal(restored, tensor)
    for dtype in (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64):
        tensor = torch.ones(5, 5, 5, dtype=dtype)
        compressed, ctx = hvd.Compression.fp16.compress(tensor)
        assert compressed.dtype == dtype
        assert torch.equal(hvd.Compression.fp16.decompress(compressed, ctx), tensor)


def test_compression_objects_roundtrip_and_map_to_config_names():
    tensor = torch.tensor([1.5, -2.25, 3.0])
    compressed, ctx = hvd.Compression.bf16.compress(tensor)
    assert compressed.dtype == torch.bfloat16
    assert hvd.Compression.bf16.decompress(compressed, ctx).dtype == torch.float32
    compressed, ctx = hvd.Compression.none.compress(tensor)
    assert compressed is tensor and hvd.Compression.none.decompress(compressed, ctx) is tensor
    for member, name in ((hvd.Compression.none, "none"), (hvd.Compression.fp16, "fp16"),
                         (hvd.Compression.bf16, "bf16")):
        assert member.name == name
        assert compression_name(member) == compression_name(member()) == compression_name(name) == name
    assert compression_name(None) is None

    class Custom:
        @staticmethod
        def compress(tensor):
            return tensor, None

        @staticmethod
        def decompress(tensor, ctx):
            return tensor

    with pytest.raises(IMergeConfigError, match="custom"):
        compression_name(Custom)


def test_ops_and_average_alias():
    with pytest.raises(IMergeConfigError, match="Adasum is not supported.*Average"):
        horovod_api.reduce_op(hvd.Adasum)
    with pytest.raises(IMergeConfigError, match="unknown reduction op"):
        horovod_api.reduce_op(17)
    assert horovod_api.resolve_op(None, None) is hvd.Average
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert horovod_api.resolve_op(None, False) is hvd.Sum
    assert caught and issubclass(caught[0].category, DeprecationWarning)
    with pytest.raises(ValueError, match="supersedes average"):
        horovod_api.resolve_op(hvd.Sum, True)


def test_reducescatter_split_is_horovods():
    assert horovod_api.scatter_rows(7, 3) == [3, 2, 2]
    assert horovod_api.scatter_rows(2, 3) == [1, 1, 0]
    assert horovod_api.scatter_rows(6, 3) == [2, 2, 2]


@pytest.mark.parametrize("kwargs,match", [
    ({"op": hvd.Adasum}, "Adasum is not supported"),
    ({"op": hvd.Product}, "Product"),
    ({"groups": 2}, "planner chooses the fusion groups"),
    ({"num_groups": 4}, "planner chooses the fusion groups"),
    ({"op": hvd.Sum, "gradient_predivide_factor": 2.0}, "op != Average"),
    ({"gradient_predivide_factor": -1.0}, "> 0"),
    ({"process_set": object()}, "process sets are not supported"),
])
def test_distributed_optimizer_refuses_before_starting_mpi(kwargs, match):
    model = torch.nn.Linear(2, 2)
    optimizer = SimpleNamespace(param_groups=[{"params": list(model.parameters())}])  # never reached
    with pytest.raises(IMergeConfigError, match=match):
        hvd.DistributedOptimizer(optimizer, model.named_parameters(), **kwargs)


def test_horovods_exception_names():
    """Horovod code names these in ``except`` clauses; argument errors are ValueErrors as Horovod's."""
    from imerge_hooks.core import errors

    assert hvd.HorovodInternalError is errors.IMergeError
    assert issubclass(hvd.IMergeMismatchError, hvd.HorovodInternalError)
    assert issubclass(hvd.IMergeTimeoutError, hvd.HorovodInternalError)
    assert hvd.HostsUpdatedInterrupt is errors.IMergeHostsUpdated
    assert issubclass(hvd.HostsUpdatedInterrupt, RuntimeError)
    assert hvd.HostsUpdatedInterrupt(skip_sync=True).skip_sync is True
    assert issubclass(hvd.IMergeArgumentError, ValueError) and issubclass(hvd.IMergeArgumentError,
                                                                           hvd.IMergeUsageError)


def test_a_collective_mismatch_names_both_calls():
    from imerge_hooks.cluster import collectives
    from imerge_hooks.core.errors import IMergeMismatchError

    mine = ("barrier", "barrier()", None)
    collectives._check_same_call(mine, {1: mine, 2: mine}, "worker")  # all alike: nothing raised
    bcast = ("bcast", collectives._describe("bcast", "object 'cfg' from worker 0"), 0)
    with pytest.raises(IMergeMismatchError, match=r"called barrier\(\), but workers \[1, 3\] called a broadcast of "
                       r"object 'cfg' from worker 0; worker 2 called allreduce of tensor 'x': every worker must"):
        collectives._check_same_call(mine, {1: bcast, 2: ("allgather", "allreduce of tensor 'x'", None), 3: bcast},
                                     "worker")
    other_root = ("bcast", bcast[1], 1)  # same name, another root: the roots tell them apart
    with pytest.raises(IMergeMismatchError, match=r"rooted at worker 0\).*rooted at worker 1\)"):
        collectives._check_same_call(bcast, {1: other_root}, "worker")


@pytest.mark.parametrize("splits,rows,problem", [
    (None, 5, "not divisible"), ([1, 1], 1, "at most dim 0"), ([1, -1], 2, "non-negative"),
    ([1], 2, "2 non-negative"), (torch.ones(2), 2, "float32"), ([0.5, 1.5], 2, "integers"),
])
def test_bad_alltoall_splits_are_named(splits, rows, problem):
    counts, why = horovod_api._split_rows(torch.zeros(rows, 3), splits, 2)
    assert why is not None and problem in why, why


def test_good_alltoall_splits():
    assert horovod_api._split_rows(torch.zeros(4, 3), None, 2) == ([2, 2], None)
    assert horovod_api._split_rows(torch.zeros(4, 3), torch.tensor([3, 0], dtype=torch.int32), 2) == ([3, 0], None)
    assert horovod_api._split_rows(torch.zeros(4, 3), [1, 2], 2) == ([1, 2], None)  # fewer rows than dim 0


def test_unsupported_horovod_features_are_refused_clearly():
    with pytest.raises(IMergeConfigError, match="IMERGE_TIMELINE"):
        hvd.start_timeline("/tmp/timeline.json")
    with pytest.raises(IMergeConfigError, match="process sets"):
        hvd.add_process_set([0, 1])
    horovod_api.check_process_set(None, "x")
    horovod_api.check_process_set(hvd.global_process_set, "x")
