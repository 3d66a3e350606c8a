"""One key's streaming average, without MPI: what a server does with the pushes it receives.

Each push is added scaled by 1/W as it arrives, so the sum is the average once the last
worker's push is in and workers use the result as it comes. 16-bit pushes are accumulated in
float32. Pushes carry their step modulo ``ROUND_TAGS``; a push of another step than the key's
open round is refused (some worker skipped or repeated a step). The server loop
(``server.py``) owns the MPI side: matching, receiving into :meth:`KeyAggregate.target`,
sending :attr:`KeyAggregate.out`. Unit tests drive this class directly.
"""

from __future__ import annotations

import torch

from ..core.memory import host_buffer
from ..core.wire import DTYPE_BY_NAME, ROUND_TAGS, KeySpec


class KeyAggregate:
    """The average of one key over ``workers`` workers, one round at a time.

    ``pushers``: the ranks whose pushes make up a round (default: the workers 0..W-1). With host
    aggregation each host's push is the sum of its workers' gradients, so fewer pushes than workers
    arrive and the sum is still divided by W.
    """

    def __init__(self, spec: KeySpec, workers: int, join_divisor: str = "workers",
                 pushers: list[int] | None = None) -> None:
        self.spec = spec
        self.workers = workers
        self.pushers = list(range(workers)) if pushers is None else list(pushers)
        self.join_divisor = join_divisor
        dtype = DTYPE_BY_NAME[spec.dtype]
        numel = spec.nbytes // torch.empty((), dtype=dtype).element_size()
        acc_dtype = torch.float64 if dtype == torch.float64 else torch.float32
        self.wire = host_buffer(numel, dtype)  # receive scratch, wire dtype
        self.acc = host_buffer(numel, acc_dtype)  # running sum of pushes / W
        self.out = self.acc if acc_dtype == dtype else host_buffer(numel, dtype)  # result, wire dtype
        self.count = 0
        self.arrived: set[int] = set()
        self.open_round: int | None = None  # round (mod ROUND_TAGS) of the pushes matched since the last completion
        self.last_round: int | None = None  # round of the last completed one

    def round_problem(self, round_number: int, others: set[int]) -> str | None:
        """Why a push for ``round_number`` cannot join this key's round (None: it can; it opens the
        round if none is open). ``others``: the workers already in the round, for the message.

        A worker's push of round r+1 can only follow its result of round r, which is sent once
        every push of round r is in, so pushes of two rounds never mix at a key: a different
        number means some worker skipped or repeated a step.
        """
        if self.open_round is None:
            if round_number == self.last_round:
                return ("again for a step whose round this key has already completed: it is behind the other workers "
                        "(every worker must call backward() and step() the same number of times)")
            self.open_round = round_number
            return None
        if round_number == self.open_round:
            return None
        ahead = (round_number - self.open_round) % ROUND_TAGS
        where = (f"{ahead} step(s) ahead of" if ahead < ROUND_TAGS / 2 else
                 f"{ROUND_TAGS - ahead} step(s) behind" if ahead > ROUND_TAGS / 2 else "2 steps apart from")
        return (f"for a step {where} worker(s) {sorted(others)}: workers are out of step (one skipped a backward "
                "before step(), or called step() or backward() a different number of times)")

    def target(self, first: bool) -> torch.Tensor:
        """Where a push lands: the round's first push straight into the sum when the dtypes agree."""
        return self.acc if first and self.acc.dtype == self.wire.dtype else self.wire

    def add(self, source: int, first: bool) -> None:
        """The push from ``source`` is in :meth:`target`'s buffer: add it, scaled by 1/W."""
        scale = 1.0 / self.workers
        if first:
            if self.acc.dtype == self.wire.dtype:
                if self.workers > 1:
                    self.acc.mul_(scale)
            else:
                torch.mul(self.wire, scale, out=self.acc)
        else:
            self.acc.add_(self.wire, alpha=scale)
        self.count += 1
        self.arrived.add(source)

    def complete(self, joined: set[int]) -> bool:
        """Has every worker that still trains (not in ``joined``, or joined after pushing) pushed?"""
        return self.count > 0 and self.count == len(self.pushers) - len((joined & set(self.pushers)) - self.arrived)

    def finish(self) -> tuple[list[int], int | None]:
        """Close the round: :attr:`out` holds the average. Returns the workers to send it to (those
        that pushed; joined ones posted no receive) and the round number.

        Joined workers count as zero pushes and the sum was scaled by 1/W; with ``join_divisor``
        "active" it becomes the average over the workers that did push.
        """
        if self.count < len(self.pushers) and self.join_divisor == "active":
            self.acc.mul_(len(self.pushers) / self.count)
        if self.out is not self.acc:
            self.out.copy_(self.acc)
        dests = sorted(self.arrived)
        self.count = 0
        self.arrived = set()
        self.last_round, self.open_round = self.open_round, None
        return dests, self.last_round
