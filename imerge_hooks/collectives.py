"""Object collectives with a deadline and an identity: what every IMerge-internal collective step uses.

MPI's blocking collectives hang when a rank never arrives (dead, stopped, or on another code
path); these raise ``IMergeTimeoutError`` naming the ranks that did not arrive. Each carries
what it is (its kind, its description and root), so two ranks in different collectives raise
``IMergeMismatchError`` naming both calls instead of taking each other's values.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable
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
    """
    if op not in _VERBS:
        raise ValueError(f"IMerge internal: unknown collective {op!r}")
    me, size = comm.Get_rank(), comm.Get_size()
    mine = (op, call if call is not None else _describe(op, what), root if op in ("bcast", "gather") else None)
    parent, children = tree_links(me, size)
    label = f"{op} of {what}"
    # First a notice to each child: a worker waiting in join() (or elsewhere) sees that a collective
    # started above it at once, instead of its parent waiting for it until the deadline.
    notices = {child: comm.Issend([_NOTICE, MPI.BYTE], dest=child, tag=TAG_COLLECTIVE) for child in children}
    # Up: {identity: [ranks]} and {rank: value} of this subtree (values only where rank 0 needs them).
    calls: dict[tuple, list[int]] = {mine: [me]}
    values: dict[int, Any] = {me: value} if _carries(op, me, root) else {}
    if children:
        got = wait_for(comm, children, {}, TAG_COLLECTIVE, label, timeout_s, ranks, spin_s,
                       subtree=lambda c: subtree(c, size))
        for child in children:
            their_calls, their_values = got[child]
            for identity, who in their_calls.items():
                calls.setdefault(tuple(identity), []).extend(who)
            values.update(their_values)
    if parent is not None:
        _send_and_wait(comm, parent, (calls, values), label, timeout_s, ranks, spin_s)
        wait_for(comm, [parent], {}, TAG_COLLECTIVE, label, timeout_s, ranks, spin_s)  # the parent's notice
        verdict, result = wait_for(comm, [parent], {}, TAG_COLLECTIVE, label, timeout_s, ranks, spin_s)[parent]
    else:
        verdict = calls if len(calls) > 1 else None
        result = _result(op, values, root, size) if verdict is None else None
    # Down: the verdict, and the result where the subtree needs it (gather: only towards its root).
    # (MPI keeps one sender's messages in order: each child takes its notice before this.)
    sends = {}
    for child in children:
        share = result if op != "gather" or root in subtree(child, size) else None
        sends[child] = comm.Issend([MPI.pickle.dumps((verdict, share)), MPI.BYTE], dest=child, tag=TAG_COLLECTIVE)
    if sends:
        wait_for(comm, [], sends, TAG_COLLECTIVE, label, timeout_s, ranks, spin_s)
        wait_for(comm, [], notices, TAG_COLLECTIVE, label, timeout_s, ranks, spin_s)
    if verdict is not None:
        _check_same_call(mine, {r: identity for identity, who in verdict.items() for r in who if r != me}, ranks)
    if op == "gather":
        return result if me == root else None
    return result


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


_NOTICE = pickle.dumps(("collective",))  # the notice a collective's first message down the tree carries


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


def root_problem(root_rank: Any, size: int) -> str | None:
    """What is wrong with ``root_rank`` as the root of a collective over ``size`` workers, or None."""
    if isinstance(root_rank, bool) or not isinstance(root_rank, int) or not 0 <= root_rank < size:
        return f"root_rank {root_rank!r} is not a worker rank (0 .. {size - 1})"
    return None
