"""Object collectives with a deadline and an identity: what every IMerge-internal collective step uses.

MPI's blocking collectives hang when a rank never arrives (dead, stopped, or on another code
path); these raise ``IMergeTimeoutError`` naming the ranks that did not arrive. Each carries
what it is (its kind, its description and root), so two ranks in different collectives raise
``IMergeMismatchError`` naming both calls instead of taking each other's values.

A worker waiting in ``join()`` answers the collectives the others start meanwhile
(``answer_pending``), so every worker that called one raises the same error (or, for an
allreduce, goes on with the joined workers' zeros, as in Horovod) instead of waiting for it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..core._mpi import MPI
from ..core.errors import IMergeMismatchError, IMergeTimeoutError, IMergeUsageError
from ..core.polling import DeadlineWait
from ..core.wire import TAG_COLLECTIVE
from .failure import record_fatal, whoami

_default_timeout_s = 600.0
_joins = 0  # join() waits this process completed; its collective messages carry the count
_told: set[int] = set()  # ranks this rank's collectives found in join() since its last join() ended
_early: dict[tuple[int, int], list[Any]] = {}  # (comm, source) -> collective messages received before their call
JOINED = ("joined", "join()", None)  # the identity a worker waiting in join() takes part in a collective with
_lock = threading.Lock()  # one collective at a time per process: join() answers from a thread (answer_pending)


def configure(timeout_s: float) -> None:
    """The deadline of collectives that name none (the process's ``timeout_s``)."""
    global _default_timeout_s
    _default_timeout_s = float(timeout_s)


def collective(comm: MPI.Comm, op: str, value: Any, what: str, *, root: int = 0, timeout_s: float | None = None,
               ranks: str = "worker", spin_s: float | None = None, call: str | None = None,
               joined_part: ZerosPart | None = None) -> Any:
    """An object collective over ``comm`` that raises IMergeTimeoutError instead of waiting forever.

    ``op``: ``allgather`` (every rank's value, by rank), ``bcast`` (``root``'s value), ``gather``
    (the list on ``root``, None elsewhere), ``max`` (the largest value) or ``barrier`` (None).
    MPI's blocking collectives hang when a rank never arrives (dead, stopped, or on another code
    path), and MPICH spins a core meanwhile. Here messages go point to point by synchronous send
    over a binomial tree rooted at rank 0, polled with back-off (``spin_s``: how long to spin first)
    until ``timeout_s`` (default: ``configure``'s); the error names ``what`` and the ``ranks`` (what
    ``comm``'s ranks are called) that did not arrive.

    Up the tree every rank sends its parent this call's identity (``op``, the root, and ``call``:
    how messages name it, by default ``op`` and ``what``) for itself and its subtree, with the values
    the op needs at rank 0; down the tree rank 0 sends the verdict and the result. So a rank sends
    and receives O(log W) messages in O(log W) steps, every rank learns whether all called the same
    collective, and if any two differ every rank raises IMergeMismatchError naming its own call and
    the others'. The tree is the same whatever the op and root, so a rank in another collective
    still exchanges with the right peers. No message is left behind (the ranks stay in step) and no
    collective ever returns another's value. Every rank must call the same collectives in the same order.

    Workers waiting in ``join()`` take part too (``answer_pending``): then every rank that called
    this raises the same IMergeUsageError naming them, unless all offered the same ``joined_part``
    (an ``allgather`` whose allreduce the joined workers join with zeros): then the result has None
    for the joined ranks.
    """
    if op not in _VERBS:
        raise ValueError(f"IMerge internal: unknown collective {op!r}")
    if joined_part is not None and op != "allgather":
        raise ValueError("IMerge internal: only an allgather agrees on a joined part")
    me = comm.Get_rank()
    mine = (op, call if call is not None else _describe(op, what), root if op in ("bcast", "gather") else None)
    with _lock:
        verdict, result = _exchange(comm, mine, value, joined_part, f"{op} of {what}", timeout_s, ranks, spin_s)
    if isinstance(verdict, dict):
        _check_same_call(mine, {r: identity for identity, who in verdict.items() for r in who if r != me}, ranks)
    if isinstance(verdict, tuple):
        _, joined, part = verdict
        _told.update(joined)
        if part is None:
            raise IMergeUsageError(_joined_message(mine[1], joined, ranks))
        return result
    if op == "gather":
        return result if me == root else None
    return result


def answer_pending(comm: MPI.Comm, timeout_s: float | None = None, ranks: str = "worker") -> bool:
    """From ``join()``: take part in the collective a rank that has not joined started, if one waits
    for this rank on ``comm``; whether one did.

    Every rank that called it learns which ranks wait in ``join()`` and raises the same error, or,
    where all offered the same ``ZerosPart``, goes on to its allreduce, which this rank joins with
    zeros. A mismatch among the callers is theirs to raise; this rank goes on waiting. A collective
    from a rank that completed more ``join()`` waits than this one is the one after the join this
    rank waits in: its message waits for that call.
    """
    with _lock:
        pending = _first_pending(comm)
        if pending is None or pending > _joins:
            return False
        what = "the collective another worker started while this one waits in join()"
        verdict, _ = _exchange(comm, JOINED, None, None, what, timeout_s, ranks, None)
        if isinstance(verdict, tuple) and verdict[2] is not None:
            verdict[2].contribute(comm, timeout_s)
        return True


def _first_pending(comm: MPI.Comm) -> int | None:
    """The ``join()`` count of the sender of the first collective message waiting for this rank on
    ``comm``, if any; the message is kept for its call (``_receive_arrived``)."""
    key = comm.py2f()
    for (handle, _), messages in _early.items():
        if handle == key and messages:
            return messages[0][-1]
    status = MPI.Status()
    message = comm.improbe(source=MPI.ANY_SOURCE, tag=TAG_COLLECTIVE, status=status)
    if message is None:
        return None
    payload = message.recv()
    _early.setdefault((key, status.Get_source()), []).append(payload)
    return payload[-1]


def count_join() -> None:
    """This worker's ``join()`` wait ended (every worker joined): its collectives say so from now on."""
    global _joins
    _joins += 1


def last_joiner(comm: MPI.Comm, last: int, ranks: str = "worker") -> int:
    """The rank that joined last, the same on every rank (a collective, after ``count_join``).

    The servers' ``last`` is the last join they received. A rank answers collectives from the start of
    its ``join()``, before its join reaches them (it may first finish an iteration that needs the
    others), so one that learned there that ``last`` had joined may reach them first: then the last
    is the highest rank no collective found waiting in ``join()`` before it joined.
    """
    global _told
    told = collective(comm, "allgather", sorted(_told), f"the {ranks}s found waiting in join()")
    _told = set()
    earlier = {r for found in told for r in found}
    if last not in earlier:
        return last
    return max(r for r in range(len(told)) if r not in earlier)


@dataclass(frozen=True)
class ZerosPart:
    """What a worker waiting in ``join()`` adds to the allreduce a collective agrees on: zeros (Horovod's
    joined ranks do the same). ``agreed``: the fields every caller agreed on, so that equal parts mean
    that the callers go on to the allreduce; ``buffers``: (shape, numpy dtype) of each reduced buffer,
    in the callers' order; ``mpi_op``: the MPI op's name (``SUM``)."""

    agreed: Any
    mpi_op: str
    buffers: tuple[tuple[tuple[int, ...], str], ...]

    def contribute(self, comm: MPI.Comm, timeout_s: float | None = None) -> None:
        """This rank's part of the allreduce: zeros, waited for until the deadline."""
        buffers = [np.zeros(shape, dtype=dtype) for shape, dtype in self.buffers]
        outputs = [np.empty_like(b) for b in buffers]
        requests = [comm.Iallreduce(b, out, op=getattr(MPI, self.mpi_op)) for b, out in zip(buffers, outputs)]
        wait = DeadlineWait(_default_timeout_s if timeout_s is None else timeout_s)
        while not MPI.Request.Testall(requests):
            if wait.expired():
                raise record_fatal(IMergeTimeoutError(
                    f"{whoami()}: the allreduce the other workers started while this one waits in join() did not "
                    f"complete within {wait.limit_s:.0f} s (a worker died or stopped calling MPI)"))
            wait.idle(wait.elapsed())


def _exchange(comm: MPI.Comm, mine: tuple, value: Any, part: ZerosPart | None, label: str,
              timeout_s: float | None, ranks: str, spin_s: float | None) -> tuple[Any, Any]:
    """The tree protocol of ``collective`` for one rank: returns (verdict, result).

    The verdict is None (every rank made the same call), the calls by identity (they differ), or
    ``("joined", joined ranks, the part every caller offered or None)`` when ranks in ``join()``
    answered; then the result is every caller's value by rank (None for the joined ranks).
    """
    me, size = comm.Get_rank(), comm.Get_size()
    op, _, root = mine
    parent, children = tree_links(me, size)
    # First a notice to each child: a worker waiting in join() (or elsewhere) sees that a collective
    # started above it at once, instead of its parent waiting for it until the deadline.
    notice = MPI.pickle.dumps(("collective", _joins))
    notices = {child: comm.Issend([notice, MPI.BYTE], dest=child, tag=TAG_COLLECTIVE) for child in children}
    # Up: {identity: [ranks]}, {rank: value} (only where rank 0 needs it) and {rank: part} of this subtree.
    calls: dict[tuple, list[int]] = {mine: [me]}
    values: dict[int, Any] = {me: value} if mine != JOINED and _carries(op, me, root) else {}
    parts: dict[int, ZerosPart | None] = {} if mine == JOINED else {me: part}
    if children:
        got = wait_for(comm, children, {}, TAG_COLLECTIVE, label, timeout_s, ranks, spin_s,
                       subtree=lambda c: subtree(c, size))
        for child in children:
            their_calls, their_values, their_parts, _ = got[child]
            for identity, who in their_calls.items():
                calls.setdefault(tuple(identity), []).extend(who)
            values.update(their_values)
            parts.update(their_parts)
    if parent is not None:
        _send_and_wait(comm, parent, (calls, values, parts, _joins), label, timeout_s, ranks, spin_s)
        wait_for(comm, [parent], {}, TAG_COLLECTIVE, label, timeout_s, ranks, spin_s)  # the parent's notice
        verdict, result = wait_for(comm, [parent], {}, TAG_COLLECTIVE, label, timeout_s, ranks, spin_s)[parent]
    else:
        verdict, result = _decide(calls, values, parts, size)
    # Down: the verdict, and the result where the subtree needs it (gather: only towards its root).
    # (MPI keeps one sender's messages in order: each child takes its notice before this.)
    sends = {}
    for child in children:
        share = result if op != "gather" or root in subtree(child, size) or verdict is not None else None
        sends[child] = comm.Issend([MPI.pickle.dumps((verdict, share)), MPI.BYTE], dest=child, tag=TAG_COLLECTIVE)
    if sends:
        wait_for(comm, [], sends, TAG_COLLECTIVE, label, timeout_s, ranks, spin_s)
        wait_for(comm, [], notices, TAG_COLLECTIVE, label, timeout_s, ranks, spin_s)
    return verdict, result


def _decide(calls: dict[tuple, list[int]], values: dict[int, Any], parts: dict[int, ZerosPart | None],
            size: int) -> tuple[Any, Any]:
    """Rank 0's verdict and result (``_exchange``), from every rank's identity, value and part."""
    live = [identity for identity in calls if identity != JOINED]
    if len(live) != 1:
        return calls, None
    joined = sorted(calls.get(JOINED, []))
    if joined:
        offered = list(parts.values())
        part = offered[0] if all(p is not None and p == offered[0] for p in offered) else None
        return ("joined", joined, part), [values.get(r) for r in range(size)]
    op, _, root = live[0]
    return None, _result(op, values, root, size)


def _joined_message(call: str, joined: list[int], ranks: str) -> str:
    who = f"IMerge {ranks} {joined[0]} waits" if len(joined) == 1 else f"IMerge {ranks}s {joined} wait"
    return (f"{whoami()}: called {call}, but {who} in join() (out of data): while a {ranks} has joined, the "
            "others may run allreduces (op Average or Sum: a joined worker adds zeros, as in Horovod) but no other "
            "collective, plan change or calibration; every worker that called this raises this error. Make "
            "profile_steps smaller than the shortest worker's number of steps")


def tree_links(rank: int, size: int) -> tuple[int | None, list[int]]:
    """``rank``'s parent (None for rank 0) and children in the binomial tree over ``size`` ranks."""
    parent, children, mask = None, [], 1
    while mask < size:
        if rank & mask:
            parent = rank - mask
            break
        if rank + mask < size:
            children.append(rank + mask)
        mask <<= 1
    return parent, children


def subtree(rank: int, size: int) -> list[int]:
    """The ranks of ``rank``'s subtree in the binomial tree (itself and below)."""
    low = rank & -rank if rank else 1 << max(0, (size - 1).bit_length())
    return list(range(rank, min(size, rank + low)))


def _carries(op: str, rank: int, root: int) -> bool:
    """Whether ``rank``'s value travels up to rank 0 for collective ``op``."""
    return op in ("allgather", "gather", "max") or (op == "bcast" and rank == root)


def _result(op: str, values: dict[int, Any], root: int, size: int) -> Any:
    if op == "barrier":
        return None
    if op == "max":
        return max(values.values())
    if op == "bcast":
        return values[root]
    return [values[r] for r in range(size)]


def _send_and_wait(comm: MPI.Comm, dest: int, payload: Any, label: str, timeout_s: float | None, ranks: str,
                   spin_s: float | None) -> None:
    request = comm.Issend([MPI.pickle.dumps(payload), MPI.BYTE], dest=dest, tag=TAG_COLLECTIVE)
    wait_for(comm, [], {dest: request}, TAG_COLLECTIVE, label, timeout_s, ranks, spin_s)


_VERBS = {"allgather": "an allgather of", "max": "a max of", "barrier": "a barrier:", "bcast": "a broadcast of",
          "gather": "a gather of"}


def _describe(op: str, what: str) -> str:
    """How messages name a collective: ``a broadcast of worker 0's address``, ``barrier()``."""
    return what if op == "barrier" and "barrier" in what else f"{_VERBS[op]} {what}"


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
             timeout_s: float | None, ranks: str, spin_s: float | None = None,
             subtree: Callable[[int], list[int]] | None = None) -> dict[int, Any]:
    """One pickled message from each of ``sources`` and the end of each send (by destination),
    polled with back-off; at the deadline IMergeTimeoutError naming the ranks still missing
    (``subtree(r)``: the ranks a missing message from ``r`` stands for, e.g. a tree child's subtree)."""
    wait = DeadlineWait(_default_timeout_s if timeout_s is None else timeout_s, spin_s)
    waiting, got = list(sources), {}
    while waiting or sends:
        if _receive_arrived(comm, waiting, tag, got) | _retire_sends(sends):
            wait.reset()
        elif wait.expired():
            missing = sorted({m for r in set(waiting) | set(sends) for m in (subtree(r) if subtree else [r])})
            raise record_fatal(IMergeTimeoutError(
                f"{whoami()}: {what} did not complete within {wait.limit_s:.0f} s: {ranks}(s) {missing} did not "
                "arrive (dead, stuck, or on another code path)"))
        else:
            wait.idle()
    return got


def _receive_arrived(comm: MPI.Comm, waiting: list[int], tag: int, got: dict[int, Any]) -> bool:
    """Receive what has arrived from the ranks in ``waiting`` (and drop them from it); any?
    (Collective messages ``answer_pending`` received early come first.)"""
    arrived = False
    for source in list(waiting):
        early = _early.get((comm.py2f(), source)) if tag == TAG_COLLECTIVE and _early else None
        if early:
            got[source] = early.pop(0)
        else:
            message = comm.improbe(source=source, tag=tag)
            if message is None:
                continue
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


def root_problem(root_rank: Any, size: int) -> str | None:
    """What is wrong with ``root_rank`` as the root of a collective over ``size`` workers, or None."""
    if isinstance(root_rank, bool) or not isinstance(root_rank, int) or not 0 <= root_rank < size:
        return f"root_rank {root_rank!r} is not a worker rank (0 .. {size - 1})"
    return None
