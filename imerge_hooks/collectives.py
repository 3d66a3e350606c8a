"""Object collectives with a deadline and an identity: what every IMerge-internal collective step uses.

MPI's blocking collectives hang when a rank never arrives (dead, stopped, or on another code
path); these raise ``IMergeTimeoutError`` naming the ranks that did not arrive. Each carries
what it is (its kind, its description and root), so two ranks in different collectives raise
``IMergeMismatchError`` naming both calls instead of taking each other's values.
"""

from __future__ import annotations

from typing import Any

from ._mpi import MPI
from .errors import IMergeMismatchError, IMergeTimeoutError
from .failure import record_fatal, whoami
from .polling import DeadlineWait
from .wire import TAG_COLLECTIVE

_default_timeout_s = 600.0


def configure(timeout_s: float) -> None:
    """The deadline of collectives that name none (the process's ``timeout_s``)."""
    global _default_timeout_s
    _default_timeout_s = float(timeout_s)


def collective(comm: MPI.Comm, op: str, value: Any, what: str, *, root: int = 0, timeout_s: float | None = None,
               ranks: str = "worker", spin_s: float | None = None, call: str | None = None) -> Any:
    """An object collective over ``comm`` that raises IMergeTimeoutError instead of waiting forever.

    ``op``: ``allgather`` (every rank's value, by rank), ``bcast`` (``root``'s value), ``gather``
    (the list on ``root``, None elsewhere), ``max`` (the largest value) or ``barrier`` (None).
    MPI's blocking collectives hang when a rank never arrives (dead, stopped, or on another code
    path), and MPICH spins a core meanwhile. Here each value goes point to point by synchronous
    send, polled with back-off (``spin_s``: how long to spin first) until ``timeout_s`` (default:
    ``configure``'s); the error names ``what`` and the ``ranks`` (what ``comm``'s ranks are called)
    that did not arrive.

    Every rank sends one message to every other rank, whatever ``op`` is: the value where ``op``
    delivers it, and always this call's identity (``op``, the root, and ``call``: how messages
    name it, by default ``op`` and ``what``). So every rank learns what every other rank called,
    and if any two differ every rank raises IMergeMismatchError naming its own call and the
    others'. No message is left behind (the ranks stay in step) and no collective ever returns
    another's value. Every rank must call the same collectives in the same order.
    """
    if op not in _VERBS:
        raise ValueError(f"IMerge internal: unknown collective {op!r}")
    me, size = comm.Get_rank(), comm.Get_size()
    mine = (op, call if call is not None else _describe(op, what), root if op in ("bcast", "gather") else None)
    others = [r for r in range(size) if r != me]
    with_value = MPI.pickle.dumps((mine, value))  # pickled once, sent to every peer that gets the value
    without = MPI.pickle.dumps((mine, None))
    sends = {r: comm.Issend([with_value if _delivers(op, me, r, root) else without, MPI.BYTE], dest=r,
                            tag=TAG_COLLECTIVE) for r in others}
    got = wait_for(comm, others, sends, TAG_COLLECTIVE, f"{op} of {what}", timeout_s, ranks, spin_s)
    _check_same_call(mine, {r: tuple(identity) for r, (identity, _) in got.items()}, ranks)
    values = {r: v for r, (_, v) in got.items()}
    values[me] = value
    if op == "barrier":
        return None
    if op == "max":
        return max(values.values())
    if op == "bcast":
        return values[root]
    return [values[r] for r in range(size)] if op == "allgather" or me == root else None


_VERBS = {"allgather": "an allgather of", "max": "a max of", "barrier": "a barrier:", "bcast": "a broadcast of",
          "gather": "a gather of"}


def _describe(op: str, what: str) -> str:
    """How messages name a collective: ``a broadcast of worker 0's address``, ``barrier()``."""
    return what if op == "barrier" and "barrier" in what else f"{_VERBS[op]} {what}"


def _delivers(op: str, sender: int, receiver: int, root: int) -> bool:
    """Whether collective ``op`` delivers ``sender``'s value to ``receiver``."""
    if op in ("allgather", "max"):
        return True
    if op == "bcast":
        return sender == root
    return op == "gather" and receiver == root


def _check_same_call(mine: tuple, theirs: dict[int, tuple], ranks: str) -> None:
    """Raise IMergeMismatchError naming this rank's call and every other one if any rank called another."""
    others: dict[tuple, list[int]] = {}
    for r, identity in sorted(theirs.items()):
        if identity != mine:
            others.setdefault(identity, []).append(r)
    if not others:
        return
    detail = any(identity[1] == mine[1] for identity in others)  # same name: tell the kinds and roots apart

    def name(identity: tuple) -> str:
        op, text, root = identity
        return text + (f" ({op}" + (f" rooted at {ranks} {root})" if root is not None else ")") if detail else "")

    peers = "; ".join(f"{ranks} {rs[0]} called {name(identity)}" if len(rs) == 1 else
                      f"{ranks}s {rs} called {name(identity)}" for identity, rs in others.items())
    raise IMergeMismatchError(f"{whoami()}: called {name(mine)}, but {peers}: every {ranks} must run the same "
                              "collectives in the same order")


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
