"""Key ids stay within the MPI's tag space: past it they wrap and skip the ids still registered."""

import pytest

from imerge_hooks.core.errors import IMergeConfigError
from imerge_hooks.core.wire import KeySpec
from imerge_hooks.worker import key_table


@pytest.fixture
def small_tag_space(monkeypatch):
    monkeypatch.setattr(key_table, "key_capacity", lambda: 10)
    monkeypatch.setattr(key_table.state, "next_key", 0)
    monkeypatch.setattr(key_table.state, "tables", {})


def spec(key: int) -> KeySpec:
    return KeySpec(key, 4, "float32", 0, ("t",))


def test_ids_wrap_and_skip_registered_ones(small_tag_space):
    assert key_table.allocate_keys(6) == [0, 1, 2, 3, 4, 5]
    key_table.state.tables[0] = [spec(k) for k in (0, 1, 2, 3, 4, 5)]
    assert key_table.allocate_keys(4) == [6, 7, 8, 9]
    key_table.state.tables[0] = [spec(k) for k in (6, 7, 8, 9)]  # the first plan epoch's keys are gone
    assert key_table.allocate_keys(3) == [0, 1, 2]


def test_too_many_keys_are_refused_with_the_reason(small_tag_space):
    key_table.state.tables[0] = [spec(k) for k in range(8)]
    with pytest.raises(IMergeConfigError, match="MPI_TAG_UB"):
        key_table.allocate_keys(3)


def test_capacity_keeps_every_tag_within_the_standard_tag_bound():
    from imerge_hooks.core._mpi import MPI
    from imerge_hooks.core.wire import ROUND_TAGS, key_tag

    if MPI.Is_initialized():
        pytest.skip("MPI is initialised in this process: the capacity follows its own MPI_TAG_UB")
    capacity = key_table.key_capacity()  # without MPI: the 32767 every MPI guarantees
    assert key_tag(capacity - 1, ROUND_TAGS - 1) <= 32767 < key_tag(capacity, 0)
