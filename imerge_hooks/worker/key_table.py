"""The key table shared by every engine of this process: key ids within MPI's tag space, and plan
epochs installed on every server (collective over the workers)."""

from __future__ import annotations

import hashlib

from ..cluster import messages, session
from ..core._mpi import MPI
from ..core.errors import IMergeConfigError, IMergeMismatchError
from ..core.wire import KEY_TAG_BASE, ROUND_TAGS, TAG_CONTROL, TAG_REPLY, KeySpec, table_to_wire


class Tables:
    """Every live client's keys and tensors, the next key id to try and the current plan epoch."""

    def __init__(self) -> None:
        self.tables: dict[int, list[KeySpec]] = {}  # client id -> its keys
        self.tensor_tables: dict[int, list[tuple]] = {}  # client id -> (name, shape, dtype) per tensor
        self.next_key = 0
        self.epoch = 0


state = Tables()


def allocate_keys(count: int) -> list[int]:
    """Key ids not used by any registered table (identical on all workers as long as they
    allocate in the same order).

    Ids count up; a key's tags must stay within the MPI's ``MPI_TAG_UB`` (the standard promises
    only 32767), so past ``key_capacity()`` the count wraps and skips the ids that registered
    tables still use: every plan epoch allocates anew, and a long job would otherwise run out.
    """
    capacity = key_capacity()
    in_use = {k.key for table in state.tables.values() for k in table}
    if count > capacity - len(in_use):
        raise IMergeConfigError(f"IMerge: {count} more keys do not fit in this MPI's tag space ({capacity} keys, "
                                f"{len(in_use)} in use; MPI_TAG_UB); raise partition_bytes or fuse more")
    ids, key = [], state.next_key
    while len(ids) < count:
        key = 0 if key >= capacity else key
        if key not in in_use:
            ids.append(key)
        key += 1
    state.next_key = key
    return ids


def key_capacity() -> int:
    """How many key ids this MPI's tag space holds (each key uses ``ROUND_TAGS`` tags)."""
    tag_ub = MPI.COMM_WORLD.Get_attr(MPI.TAG_UB) if MPI.Is_initialized() else 32767
    return (int(tag_ub) - KEY_TAG_BASE + 1) // ROUND_TAGS


def register_keys(client: int, keys: list[KeySpec], tensors: list[tuple[str, tuple, str]] | None = None) -> int:
    """Install ``client``'s keys as part of a new numbered plan epoch on every server.

    Collective over workers: every worker registers the same change at the same point.
    ``tensors`` is the client's (name, shape, dtype) per tensor, in its order: the servers
    compare it across workers too (shapes and order that the keys' byte counts cannot show).
    Returns the new epoch. Raises IMergeMismatchError naming the tensor, worker and server
    if workers disagree.
    """
    topo = session.topology()
    state.tables[client] = keys
    state.tensor_tables[client] = list(tensors or [])
    state.epoch += 1
    if topo.num_servers == 0:
        return state.epoch
    table = [k for c in sorted(state.tables) for k in state.tables[c]]
    described = [t for c in sorted(state.tensor_tables) for t in state.tensor_tables[c]]
    wire = table_to_wire(table)
    request = {"op": "register", "epoch": state.epoch, "keys": wire, "worker": topo.worker_rank,
               "tensors": described, "digest": hashlib.sha1(repr((wire, described)).encode()).hexdigest()}
    comm = topo.data_comm
    for server in range(topo.num_servers):
        comm.send(request, dest=topo.server_world_rank(server), tag=TAG_CONTROL)
    errors = []
    for server in range(topo.num_servers):
        reply = messages.recv_with_timeout(comm, topo.server_world_rank(server), TAG_REPLY,
                                          f"the answer of server {server} to plan epoch {state.epoch}")
        if reply.get("op") == "error":
            errors.append(reply["message"])
    if errors:
        state.tables.pop(client, None)  # refused: later registrations must not carry it
        state.tensor_tables.pop(client, None)
        raise IMergeMismatchError(f"IMerge worker {topo.worker_rank}: " + "; ".join(dict.fromkeys(errors)))
    return state.epoch


def unregister_keys(client: int) -> None:
    """``client`` is retired: the servers free its keys (collective over workers, a plan epoch)."""
    register_keys(client, [])
    state.tables.pop(client, None)
    state.tensor_tables.pop(client, None)
