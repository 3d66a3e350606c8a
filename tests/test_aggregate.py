"""The server's per-key average, driven directly (no MPI): rounds, scaling, joins, 16-bit wire."""

import pytest
import torch

from imerge_hooks.core.wire import KeySpec
from imerge_hooks.server.aggregate import KeyAggregate


def push(agg: KeyAggregate, source: int, values, round_number: int = 0) -> None:
    assert agg.round_problem(round_number, agg.arrived) is None
    first = agg.count == 0
    agg.target(first).copy_(torch.as_tensor(values, dtype=agg.target(first).dtype))
    agg.add(source, first)


def test_three_pushes_give_their_average_and_close_the_round():
    agg = KeyAggregate(KeySpec(1, 16, "float32", 0, ("w",)), workers=3)
    for source, values in enumerate(([1, 2, 3, 4], [4, 5, 6, 7], [7, 8, 9, 10])):
        assert not agg.complete(set())
        push(agg, source, values)
    assert agg.complete(set())
    dests, round_number = agg.finish()
    assert dests == [0, 1, 2] and round_number == 0
    assert torch.allclose(agg.out, torch.tensor([4.0, 5.0, 6.0, 7.0]))
    assert agg.count == 0 and agg.open_round is None and agg.last_round == 0


def test_a_push_of_another_step_is_refused_with_the_workers_it_differs_from():
    agg = KeyAggregate(KeySpec(1, 8, "float32", 0, ("w",)), workers=2)
    push(agg, 0, [1, 1], round_number=2)
    problem = agg.round_problem(3, agg.arrived)
    assert "1 step(s) ahead of worker(s) [0]" in problem
    push(agg, 1, [3, 3], round_number=2)
    agg.finish()
    assert "already completed" in agg.round_problem(2, set())  # a worker repeating the step it did
    assert agg.round_problem(3, set()) is None  # the next step opens the next round


@pytest.mark.parametrize("divisor,expected", [("workers", 1.0), ("active", 2.0)])
def test_joined_workers_count_as_zeros_or_are_left_out(divisor, expected):
    agg = KeyAggregate(KeySpec(1, 8, "float32", 0, ("w",)), workers=2, join_divisor=divisor)
    push(agg, 0, [2, 2])
    assert agg.complete({1}) and not agg.complete(set())
    dests, _ = agg.finish()
    assert dests == [0] and agg.out.tolist() == [expected, expected]


def test_16_bit_pushes_are_summed_in_float32():
    agg = KeyAggregate(KeySpec(1, 4, "float16", 0, ("w",)), workers=2)
    assert agg.acc.dtype == torch.float32 and agg.out.dtype == torch.float16
    push(agg, 0, [1.0, 2049.0])  # 2049 is not a float16; 2048 and 2050 are
    push(agg, 1, [1.0, 2051.0])
    agg.finish()
    assert agg.out.tolist() == [1.0, 2050.0]
