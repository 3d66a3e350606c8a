"""Object collectives with a deadline: what every IMerge-internal collective step uses.

MPI's blocking collectives hang when a rank never arrives (dead, stopped, or on another code
path); these raise ``IMergeTimeoutError`` naming the ranks that did not arrive.
"""

from __future__ import annotations

from typing import Any

from ._mpi import MPI
from .errors import IMergeTimeoutError
from .failure import record_fatal, whoami
from .polling import DeadlineWait
from .wire import TAG_COLLECTIVE

_default_timeout_s = 600.0


def configure(timeout_s: float) -> None:
    """The deadline of collectives that name none (the process's ``timeout_s``)."""
    global _default_timeout_s
    _default_timeout_s = float(timeout_s)


def collective(comm: MPI.Comm, op: str, value: Any, what: str, *, root: int = 0, timeout_s: float | None = None,
               ranks: str = "worker", spin_s: float | None = None) -> Any:
    """An object collective over ``comm`` that raises IMergeTimeoutError instead of waiting forever.

    ``op``: ``allgather`` (every rank's value, by rank), ``bcast`` (``root``'s value), ``gather``
    (the list on ``root``, None elsewhere), ``max`` (the largest value) or ``barrier`` (None).
    MPI's blocking collectives hang when a rank never arrives (dead, stopped, or on another code
    path), and MPICH spins a core meanwhile. Here each value goes point to point by synchronous
    send, polled with back-off (``spin_s``: how long to spin first) until ``timeout_s`` (default:
    ``configure``'s); the error names ``what`` and the ``ranks`` (what ``comm``'s ranks are called)
    that did not arrive. Every rank must call the same collectives in the same order.
    """
    me, size = comm.Get_rank(), comm.Get_size()
    sources, dests = _collective_peers(op, me, size, root)
    payload = MPI.pickle.dumps(None if op == "barrier" else value)  # pickled once, sent to every peer
    sends = {r: comm.Issend([payload, MPI.BYTE], dest=r, tag=TAG_COLLECTIVE) for r in dests}
    got = wait_for(comm, sources, sends, TAG_COLLECTIVE, f"{op} of {what}", timeout_s, ranks, spin_s)
    got[me] = value
    if op == "barrier":
        return None
    if op == "max":
        return max(got.values())
    if op == "bcast":
        return got[root]
    return [got[r] for r in range(size)] if op == "allgather" or me == root else None


def _collective_peers(op: str, me: int, size: int, root: int) -> tuple[list[int], list[int]]:
    """The ranks this rank receives from and the ranks it sends to in collective ``op``."""
    others = [r for r in range(size) if r != me]
    if op in ("allgather", "max", "barrier"):
        return others, others
    if op == "bcast":
        return ([], others) if me == root else ([root], [])
    if op == "gather":
        return (others, []) if me == root else ([], [root])
    raise ValueError(f"IMerge internal: unknown collective {op!r}")


def wait_for(comm: MPI.Comm, sources: list[int], sends: dict[int, MPI.Request], tag: int, what: str,
           timeout_s: float | None, ranks: str, spin_s: float | None = None) -> dict[int, Any]:
    """One pickled message from each of ``sources`` and the end of each send (by destination),
    polled with back-off; at the deadline IMergeTimeoutError naming the ranks still missing."""
    wait = DeadlineWait(_default_timeout_s if timeout_s is None else timeout_s, spin_s)
    waiting, got = list(sources), {}
    while waiting or sends:
        if _receive_arrived(comm, waiting, tag, got) | _retire_sends(sends):
            wait.reset()
        elif wait.expired():
            missing = sorted(set(waiting) | set(sends))
            raise record_fatal(IMergeTimeoutError(
                f"{whoami()}: {what} did not complete within {wait.limit_s:.0f} s: {ranks}(s) {missing} did not "
                "arrive (dead, stuck, or on another code path)"))
        else:
            wait.idle()
    return got


def _receive_arrived(comm: MPI.Comm, waiting: list[int], tag: int, got: dict[int, Any]) -> bool:
    """Receive what has arrived from the ranks in ``waiting`` (and drop them from it); any?"""
    arrived = False
    for source in list(waiting):
        message = comm.improbe(source=source, tag=tag)
        if message is not None:
            got[source] = message.recv()
            waiting.remove(source)
            arrived = True
    return arrived


def _retire_sends(sends: dict[int, MPI.Request]) -> bool:
    """Drop the finished sends (a synchronous send finishes when its receiver took it); any?"""
    done = [dest for dest, request in sends.items() if request.Test()]
    for dest in done:
        del sends[dest]
    return bool(done)
