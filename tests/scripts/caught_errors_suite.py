"""A pytest module run on the workers of one launch, as Horovod's suites run: a caught error leaves
the workers in step.

Usage: IMERGE_NUM_SERVERS=1 mpiexec -n 3 python caught_errors_suite.py [--fail-after-agreement]
(pytest on 2 workers; the server's process ends in ``hvd.init()``). Each test makes one worker raise (a collective while
another worker waits in ``join()``, a bad argument on one worker only), catches the error with
``pytest.raises`` and then checks that allreduce, broadcast and allgather still give the right
values. ``tests/test_caught_errors.py`` runs it and asserts that every test passed on every worker.
``--fail-after-agreement``: no pytest; worker 1 fails between an allreduce's agreement and its data
(``fail_after_agreement``).
"""

from __future__ import annotations

import sys

import pytest
import torch

import imerge_hooks as hvd
from imerge_hooks.core.errors import IMergeConfigError, IMergeMismatchError, IMergeUsageError


@pytest.fixture(autouse=True)
def workers() -> tuple[int, int]:
    """(rank, size) of the workers; ``init()`` ends a server's process here (the first test's)."""
    hvd.init()
    if hvd.size() < 2:
        pytest.skip("needs two workers or more")
    return hvd.rank(), hvd.size()


def in_step(rank: int, size: int, tag: int) -> None:
    """Every kind of collective gives every worker the right values (``tag`` tells the calls apart)."""
    assert hvd.allreduce(torch.full((3,), float(rank + tag)), op=hvd.Sum, name=f"sum.{tag}").tolist() == \
        [float(sum(range(size)) + size * tag)] * 3
    assert hvd.broadcast(torch.tensor([rank, tag]), root_rank=size - 1, name=f"bcast.{tag}").tolist() == \
        [size - 1, tag]
    assert hvd.allgather(torch.tensor([[rank, tag]]), name=f"gather.{tag}").tolist() == \
        [[r, tag] for r in range(size)]
    assert hvd.allgather_object((rank, tag)) == [(r, tag) for r in range(size)]
    hvd.barrier()


def test_a_collective_while_a_worker_joined_raises_on_its_callers(workers):
    """Horovod's test_horovod_join_allgather/_broadcast: the joined worker goes on waiting; the
    others' allgather or broadcast raises; they join; join() returns the last joiner everywhere."""
    rank, size = workers
    tensor = torch.ones(4, 3)
    for first in range(size):
        for op in ("allgather", "broadcast"):
            if rank == first:
                last = hvd.join()
            else:
                with pytest.raises(IMergeUsageError, match=rf"worker {first} waits in join\(\)"):
                    if op == "allgather":
                        hvd.allgather(tensor)
                    else:
                        hvd.broadcast(tensor, rank, name="join.broadcast")
                last = hvd.join()
            assert last != first
            assert hvd.allgather_object(last) == [last] * size
            in_step(rank, size, first)


def test_an_allreduce_while_a_worker_joined_counts_it_as_zeros(workers):
    """Horovod's test_horovod_join_allreduce: the joined worker adds zeros (Average divides by every worker)."""
    rank, size = workers
    for first in range(size):
        for dtype in (torch.int32, torch.float64):
            a, b = torch.arange(6, dtype=dtype).reshape(2, 3) * 4, torch.full((5,), 8, dtype=dtype)
            if rank == first:
                last = hvd.join()
            else:
                averaged = hvd.allreduce(a, name="join.a", op=hvd.Average)
                summed = hvd.grouped_allreduce([a, b], name="join.ab", op=hvd.Sum)
                last = hvd.join()
                expected = a * (size - 1) // size if dtype == torch.int32 else a * (size - 1) / size
                assert averaged.dtype == dtype and torch.equal(averaged, expected)
                assert all(torch.equal(s, t * (size - 1)) for s, t in zip(summed, (a, b)))
            assert hvd.allgather_object(last) == [last] * size
            in_step(rank, size, first)


def test_an_allreduce_min_while_a_worker_joined_raises_on_its_callers(workers):
    """Zeros are no Min: refused alike on every worker that called it."""
    rank, size = workers
    if rank == 0:
        hvd.join()
    else:
        with pytest.raises(IMergeUsageError, match=r"worker 0 waits in join\(\)"):
            hvd.allreduce(torch.ones(2), op=hvd.Min)
        hvd.join()
    in_step(rank, size, 7)


def test_join_answers_the_others_while_it_finishes_an_iteration(workers):
    """join() first pushes what a backward left without its step; that round needs the others' pushes,
    and they may run collectives before they join: those are answered meanwhile."""
    rank, size = workers
    model = torch.nn.Linear(4, 2)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(), schedule="wfbp")
    model(torch.full((3, 4), float(rank))).sum().backward()  # no step()
    if rank == 0:
        last = hvd.join()
    else:
        with pytest.raises(IMergeUsageError, match=r"worker 0 waits in join\(\)"):
            hvd.allgather(torch.ones(1))
        assert hvd.allreduce(torch.ones(2), op=hvd.Sum).tolist() == [size - 1.0] * 2
        last = hvd.join()
    assert hvd.allgather_object(last) == [last] * size
    opt._imerge_engine.close()  # retired: the next join() has no iteration of it to finish
    in_step(rank, size, 5)


@pytest.mark.parametrize("bad,error,match", [
    ({"op": hvd.Adasum}, IMergeConfigError, "Adasum is not supported"),
    ({"op": hvd.Sum, "average": True}, ValueError, "supersedes average"),
    ({"compression": "zip"}, IMergeConfigError, "unknown compression"),
    ({"process_set": object()}, IMergeConfigError, "process sets are not supported"),
])
def test_a_bad_argument_on_one_worker_raises_on_every_worker(workers, bad, error, match):
    """Worker 1's own argument check fails before the op's agreement: every worker raises it, with its class."""
    rank, size = workers
    with pytest.raises(error, match=rf"worker 1: .*{match}"):
        hvd.allreduce(torch.ones(2), name="bad.argument", **(bad if rank == 1 else {}))
    in_step(rank, size, 11)


def test_bad_arguments_of_other_ops_on_one_worker_raise_on_every_worker(workers):
    rank, size = workers
    odd = rank == size - 1
    with pytest.raises(IMergeConfigError, match="process sets"):
        hvd.barrier(process_set=object() if odd else hvd.global_process_set)
    with pytest.raises(IMergeConfigError, match="process sets"):
        hvd.allgather_object(rank, process_set=object() if odd else None)
    with pytest.raises(IMergeConfigError, match="Adasum"):
        hvd.reducescatter(torch.ones(size, 2), op=hvd.Adasum if odd else hvd.Sum)
    with pytest.raises(IMergeConfigError, match=r"op=Product is not supported"):
        hvd.sparse_allreduce_async(torch.eye(2).to_sparse(), "sparse", hvd.Product if odd else hvd.Sum)
    in_step(rank, size, 13)


def test_mismatched_shapes_raise_on_every_worker(workers):
    rank, size = workers
    with pytest.raises(IMergeMismatchError, match="shapes"):
        hvd.allreduce(torch.ones(rank + 1), name="shapes")
    with pytest.raises(IMergeMismatchError, match="called barrier"):
        if rank == 0:
            hvd.barrier()
        else:
            hvd.allreduce(torch.ones(1), name="not.a.barrier")
    in_step(rank, size, 17)


def test_a_parameter_table_that_differs_on_one_worker_raises_on_every_worker(workers):
    """broadcast_parameters: worker 1 names one tensor differently; every worker raises, naming it."""
    rank, size = workers
    params = {"weight" if rank != 1 else "weight_renamed": torch.ones(2, 2), "bias": torch.zeros(2)}
    with pytest.raises(ValueError, match=r"the tensors of worker\(s\) \[1\] differ from worker 0's"):
        hvd.broadcast_parameters(params, root_rank=0)
    in_step(rank, size, 19)


def fail_after_agreement() -> None:
    """Worker 1 fails to stage its tensor after every worker agreed on the allreduce: the others
    wait for its data, so the job must end at once, naming it."""
    from imerge_hooks.frontends import horovod_api

    hvd.init()
    if hvd.rank() == 1:
        def broken(tensor: torch.Tensor) -> torch.Tensor:
            raise MemoryError("no host memory left for the staging copy")

        horovod_api._host = broken
    try:
        hvd.allreduce(torch.ones(3), name="staged")
    except MemoryError:
        print(f"worker {hvd.rank()} went on after the failure", flush=True)


if __name__ == "__main__":
    if sys.argv[1:] == ["--fail-after-agreement"]:
        fail_after_agreement()
    else:
        sys.exit(pytest.main([__file__, "-q", "-p", "no:cacheprovider"]))
