"""The parameter server: a streaming average per key.

Run implicitly by ``imerge_hooks.init()`` on the last ``num_servers`` ranks, or as its own
program in an MPMD launch::

    mpiexec -n 4 python train.py : -n 2 python -m imerge_hooks.server
"""

from __future__ import annotations

import heapq
import logging
import os
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from ._mpi import MPI
from .config import Config
from .memory import host_buffer
from .polling import Backoff
from .topology import Topology
from .transport import (
    DTYPE_BY_NAME,
    KEY_TAG_BASE,
    TAG_CONTROL,
    TAG_ERROR,
    TAG_REPLY,
    KeySpec,
    PendingRequests,
    as_mpi_buffer,
    table_from_wire,
)

log = logging.getLogger("imerge")


@dataclass
class _Receive:
    """A matched push streaming into its key's buffers."""

    request: MPI.Request
    source: int
    nbytes: int
    first: bool  # the round's first push: it lands in ``acc`` (or ``wire``, then scaled into ``acc``)
    started: float


@dataclass
class _KeyState:
    spec: KeySpec
    wire: torch.Tensor  # receive scratch, wire dtype
    acc: torch.Tensor  # running sum of pushes / W (float32 for 16-bit wire types)
    out: torch.Tensor  # result in wire dtype (may alias acc)
    count: int = 0
    arrived: set[int] = field(default_factory=set)
    first_push_at: float = 0.0
    warned: bool = False
    sends: list = field(default_factory=list)
    receiving: _Receive | None = None  # the push being received into this key's buffers
    held: deque = field(default_factory=deque)  # matched pushes of this key waiting for it
    held_since: float | None = None  # a new round's first push waits for the last round's results to leave
    wire_buf: list = field(default_factory=list)  # MPI views of wire / acc / out, built once
    acc_buf: list = field(default_factory=list)
    out_buf: list = field(default_factory=list)

    def __post_init__(self) -> None:
        self.wire_buf = as_mpi_buffer(self.wire)
        self.acc_buf = as_mpi_buffer(self.acc) if self.acc.dtype == self.wire.dtype else []
        self.out_buf = as_mpi_buffer(self.out)


class Server:
    """Sums the pushes of all workers per key and sends every worker the result."""

    def __init__(self, topology: Topology, config: Config) -> None:
        self.topo = topology
        self.cfg = config
        self.comm = topology.data_comm
        self.index = topology.server_index
        self.workers = topology.num_workers
        self.keys: dict[int, _KeyState] = {}
        self.epoch = -1
        self._registrations: dict[int, dict] = {}
        self.pushes = 0
        self._shut: set[int] = set()  # workers that shut down
        self._stage_ends = [0] * self.workers  # stage_end messages per worker (Lightning entry points)
        self._stages = 0  # stages served so far
        self.joined: set[int] = set()  # workers out of data (imerge_hooks.join())
        self.last_joined = -1
        # Result sends in flight, owned by their key's state; this also keeps the buffers of keys
        # that a new plan epoch dropped alive until their last result has gone out.
        self._sending = PendingRequests(window=2 * self.workers)
        # Pushes being received, one per key at a time (a key has one scratch buffer); other keys'
        # pushes are matched and received meanwhile, so one slow push does not hold up the rest.
        self._receiving = PendingRequests(window=4 * self.workers)
        self._in_flight: dict[int, _KeyState] = {}  # key -> state, while a push is being received
        # Keys whose next round has begun (a push is matched) while the last round's results, sent
        # from the same buffer, are still going out: their pushes wait, the loop goes on.
        self._sends_pending: dict[int, _KeyState] = {}
        # Test/debug aid: answer each key only after nbytes * delay (emulates a slow link, without blocking).
        self._delay_per_byte = float(os.environ.get("IMERGE_DEBUG_DELAY_PER_MB_S", "0") or 0) / 1e6
        self._delayed: list[tuple[float, int, list[int]]] = []
        from . import runtime

        self.timeline = runtime.timeline()
        self.bytes_in = 0

    # ------------------------------------------------------------------ main loop
    def serve(self, until: str = "shutdown") -> str:
        """Serve until every worker sent ``stage_end`` (returns "stage") or ``shutdown``."""
        backoff = Backoff()
        status = MPI.Status()
        last_stall_check = time.monotonic()
        while True:
            if self._delayed:
                self._send_due()
            if self._in_flight:
                self._progress_receives()
            if self._sends_pending:
                self._start_held_rounds()
            msg = self.comm.Improbe(MPI.ANY_SOURCE, MPI.ANY_TAG, status)
            if msg is None:
                self._progress_sends()
                now = time.monotonic()
                if now - last_stall_check > 1.0:
                    self._check_stalls(now)
                    last_stall_check = now
                backoff.idle()
                continue
            backoff.reset()
            source, tag = status.Get_source(), status.Get_tag()
            if tag >= KEY_TAG_BASE:
                self._on_push(msg, source, tag - KEY_TAG_BASE, status.Get_count(MPI.BYTE))
                continue
            self._drain_receives()  # control messages see every push before them handled
            raw = bytearray(status.Get_count(MPI.BYTE))
            msg.Recv([raw, MPI.BYTE])
            request = MPI.pickle.loads(raw)
            if tag != TAG_CONTROL or not isinstance(request, dict):
                log.error("IMerge server %d: unexpected message tag %d from rank %d", self.index, tag, source)
                continue
            op = request.get("op")
            if op == "register":
                self._on_register(source, request)
            elif op == "join":
                self._on_join(source)
            elif op in ("stage_end", "shutdown"):
                if op == "shutdown":
                    self._shut.add(source)
                else:
                    self._stage_ends[source] += 1
                if len(self._shut) == self.workers:
                    self._finish("shutdown")
                    return "shutdown"
                if until == "stage" and self._stage_complete():
                    self._stages += 1
                    self._finish("stage")
                    return "stage"
            else:
                log.error("IMerge server %d: unknown control op %r from rank %d", self.index, op, source)

    def _stage_complete(self) -> bool:
        """Every worker ended the current stage or shut down.

        Counted across calls of serve(): a worker may already shut down (or end the next
        stage) in the same burst of messages in which the last one ends this stage.
        """
        return all(self._stage_ends[w] > self._stages or w in self._shut for w in range(self.workers))

    def _finish(self, why: str) -> None:
        self._drain_receives()
        self._wait_sends()
        partial = [k for k in self.keys.values() if k.count]
        for k in partial:
            missing = sorted(set(range(self.workers)) - k.arrived)
            log.error("IMerge server %d: %s while %s still waits for worker(s) %s",
                      self.index, why, k.spec.describe(), missing)

    # ------------------------------------------------------------------ registration
    def _on_register(self, source: int, request: dict) -> None:
        self._registrations[source] = request
        if len(self._registrations) < self.workers:
            return
        regs, self._registrations = self._registrations, {}
        error = _compare_tables(regs, self.index)
        if error is None:
            epochs = {r["epoch"] for r in regs.values()}
            if len(epochs) != 1:
                error = f"IMerge server {self.index}: workers registered different plan epochs {sorted(epochs)}"
        if error is not None:
            log.error("%s", error)
            for worker in regs:
                self.comm.send({"op": "error", "message": error}, dest=worker, tag=TAG_REPLY)
            return
        table = table_from_wire(regs[0]["keys"])
        self.epoch = regs[0]["epoch"]
        old = self.keys
        self.keys = {k.key: old[k.key] if k.key in old and old[k.key].spec == k else self._make_state(k)
                     for k in table if k.server == self.index}
        for worker in regs:
            self.comm.send({"op": "ack", "epoch": self.epoch, "server": self.index}, dest=worker, tag=TAG_REPLY)
        log.debug("IMerge server %d: plan epoch %d with %d keys", self.index, self.epoch, len(self.keys))

    @staticmethod
    def _make_state(spec: KeySpec) -> _KeyState:
        dtype = DTYPE_BY_NAME[spec.dtype]
        numel = spec.nbytes // torch.empty((), dtype=dtype).element_size()
        acc_dtype = torch.float64 if dtype == torch.float64 else torch.float32
        wire = host_buffer(numel, dtype)
        acc = host_buffer(numel, acc_dtype)
        out = acc if acc_dtype == dtype else host_buffer(numel, dtype)
        return _KeyState(spec, wire, acc, out)

    # ------------------------------------------------------------------ data
    def _on_push(self, msg: MPI.Message, source: int, key: int, nbytes: int) -> None:
        state = self.keys.get(key)
        problem = None
        if state is None:
            problem = (f"IMerge server {self.index}: worker {source} pushed key {key}, which is not in plan "
                       f"epoch {self.epoch} (known keys: {sorted(self.keys)[:8]}...)")
        elif nbytes != state.spec.nbytes:
            problem = (f"IMerge server {self.index}: worker {source} pushed {nbytes} bytes for "
                       f"{state.spec.describe()}, expected {state.spec.nbytes}")
        elif source in state.arrived or source in _matched_sources(state):
            problem = (f"IMerge server {self.index}: worker {source} pushed {state.spec.describe()} twice "
                       "in one round")
        if problem is not None:
            msg.Recv([bytearray(max(nbytes, 1)), MPI.BYTE])
            log.error("%s", problem)
            for worker in range(self.workers):
                self.comm.send({"op": "error", "message": problem}, dest=worker, tag=TAG_ERROR)
            return
        if state.receiving is not None or state.held_since is not None:
            state.held.append((msg, source, nbytes))
            return
        self._accept(state, msg, source, nbytes)

    def _accept(self, state: _KeyState, msg: MPI.Message, source: int, nbytes: int) -> None:
        """Start receiving a matched push of a key that is not receiving one, unless it begins a new
        round while the last round's results, sent from the same buffer, are still going out: then
        hold it (first in line) rather than block the loop, so other keys keep moving."""
        if state.count == 0 and state.sends and not MPI.Request.Testall(state.sends):
            state.held.appendleft((msg, source, nbytes))
            state.held_since = time.monotonic()
            self._sends_pending[state.spec.key] = state
            return
        self._start_receive(state, msg, source, nbytes)

    def _start_held_rounds(self) -> None:
        """Start the held first push of every key whose last round's results have all gone out."""
        now = time.monotonic()
        for key, state in list(self._sends_pending.items()):
            if MPI.Request.Testall(state.sends):
                del self._sends_pending[key]
                state.sends = []
                if self.timeline is not None:
                    self.timeline.span(f"hold key {key} for its last results", "wait", state.held_since, now)
                state.held_since = None
                self._start_receive(state, *state.held.popleft())
            elif now - state.held_since > self.cfg.timeout_s:
                raise TimeoutError(f"IMerge server {self.index}: result of {state.spec.describe()} was not "
                                   f"taken by every worker within {self.cfg.timeout_s} s")

    def _start_receive(self, state: _KeyState, msg: MPI.Message, source: int, nbytes: int) -> None:
        first = state.count == 0
        if first:
            self._wait_key_sends(state)  # returns at once: _accept started this round after those sends
            state.first_push_at = time.monotonic()
            state.warned = False
        into_acc = first and state.acc.dtype == state.wire.dtype
        request = msg.Irecv(state.acc_buf if into_acc else state.wire_buf)
        state.receiving = _Receive(request, source, nbytes, first, time.monotonic())
        self._in_flight[state.spec.key] = state
        self._receiving.add(request, state)

    def _progress_receives(self, full: bool | None = None) -> int:
        """Add the pushes that have arrived (one progress call) and start held ones; how many."""
        arrived = self._receiving.completed(full)
        for state in arrived:
            self._received(state)
        return len(arrived)

    def _received(self, state: _KeyState) -> None:
        """A push is in: add it (the server sends the average: each push is scaled by 1/W as it
        is added, so workers use the result as it arrives)."""
        done, state.receiving = state.receiving, None
        del self._in_flight[state.spec.key]
        scale = 1.0 / self.workers
        if done.first:
            if state.acc.dtype == state.wire.dtype:
                if self.workers > 1:
                    state.acc.mul_(scale)
            else:
                torch.mul(state.wire, scale, out=state.acc)
        else:
            state.acc.add_(state.wire, alpha=scale)
        state.count += 1
        state.arrived.add(done.source)
        self.pushes += 1
        self.bytes_in += done.nbytes
        if state.count == self.workers - len(self.joined - state.arrived):
            self._complete(state)
        if state.held:
            self._accept(state, *state.held.popleft())

    def _drain_receives(self) -> None:
        """Finish every push matched so far (held ones included)."""
        backoff = Backoff()
        while self._in_flight or self._sends_pending:
            if self._sends_pending:
                self._start_held_rounds()
            if self._progress_receives(full=True):
                backoff.reset()
                continue
            self._abort_late_receives(time.monotonic())
            backoff.idle()

    def _abort_late_receives(self, now: float) -> None:
        """Abort the job if a matched push has been arriving for longer than ``timeout_s``."""
        for state in self._in_flight.values():
            r = state.receiving
            if now - r.started > self.cfg.timeout_s:
                log.error("IMerge server %d: the push of %s from worker %d did not finish arriving within %.0f s "
                          "(timeout_s): aborting the job", self.index, state.spec.describe(), r.source,
                          self.cfg.timeout_s)
                MPI.COMM_WORLD.Abort(3)

    def _complete(self, state: _KeyState) -> None:
        """Every worker that still trains has pushed: send the average (rescaled if some joined)."""
        if self.timeline is not None:
            self.timeline.span(f"key {state.spec.key} ({', '.join(state.spec.names[:2])})", "server",
                               state.first_push_at, time.monotonic())
        if state.count < self.workers:
            # Joined workers count as zero contributions; the sum was scaled by 1/W, so this
            # makes it the average over the workers that did contribute.
            state.acc.mul_(self.workers / state.count)
        if state.out is not state.acc:
            state.out.copy_(state.acc)
        dests = sorted(state.arrived)  # joined workers posted no receive for this round
        state.count = 0
        state.arrived = set()
        if self._delay_per_byte and not state.spec.names[0].startswith("calibration."):
            heapq.heappush(self._delayed, (time.monotonic() + state.spec.nbytes * self._delay_per_byte,
                                           state.spec.key, dests))
        else:
            self._send_result(state, dests)

    def _on_join(self, source: int) -> None:
        self.joined.add(source)
        self.last_joined = source
        for state in self.keys.values():
            if state.count and state.count == self.workers - len(self.joined - state.arrived):
                self._complete(state)
        if len(self.joined) == self.workers:
            for worker in range(self.workers):
                self.comm.send({"op": "all_joined", "last": self.last_joined}, dest=worker, tag=TAG_REPLY)
            self.joined = set()

    def _send_result(self, state: _KeyState, dests: list[int]) -> None:
        tag = KEY_TAG_BASE + state.spec.key
        state.sends = [self.comm.Isend(state.out_buf, dest=w, tag=tag) for w in dests]
        for request in state.sends:
            self._sending.add(request, state)

    def _send_due(self) -> None:
        now = time.monotonic()
        while self._delayed and self._delayed[0][0] <= now:
            _, key, dests = heapq.heappop(self._delayed)
            self._send_result(self.keys[key], dests)

    def _wait_key_sends(self, state: _KeyState) -> None:
        if not state.sends:
            return
        deadline = time.monotonic() + self.cfg.timeout_s
        backoff = Backoff()
        while not MPI.Request.Testall(state.sends):
            if time.monotonic() > deadline:
                raise TimeoutError(f"IMerge server {self.index}: result of {state.spec.describe()} was not "
                                   f"taken by every worker within {self.cfg.timeout_s} s")
            backoff.idle()
        state.sends = []

    def _progress_sends(self) -> None:
        """Retire finished result sends with one progress call (not one per key)."""
        for state in {id(state): state for state in self._sending.completed()}.values():
            if state.sends and not any(state.sends):  # completed requests are REQUEST_NULL, which is falsy
                state.sends = []

    def _wait_sends(self) -> None:
        for state in self.keys.values():
            self._wait_key_sends(state)

    def _check_stalls(self, now: float) -> None:
        self._abort_late_receives(now)
        for state in self.keys.values():
            if state.count and now - state.first_push_at > self.cfg.timeout_s:
                missing = sorted(set(range(self.workers)) - state.arrived)
                log.error("IMerge server %d: %s waited %.0f s (timeout_s) for worker(s) %s (tensors: %s); they are "
                          "dead or stuck: aborting the job", self.index, state.spec.describe(),
                          now - state.first_push_at, missing, ", ".join(state.spec.names))
                MPI.COMM_WORLD.Abort(3)
            if state.count and not state.warned and now - state.first_push_at > self.cfg.stall_warning_s:
                state.warned = True
                missing = sorted(set(range(self.workers)) - state.arrived)
                log.warning("IMerge server %d: %s has waited %.0f s for worker(s) %s (tensors: %s)",
                            self.index, state.spec.describe(), now - state.first_push_at, missing,
                            ", ".join(state.spec.names))


def _matched_sources(state: _KeyState) -> set[int]:
    """Workers whose push of this key is matched but not yet added (being received, or held)."""
    held = {source for _, source, _ in state.held}
    return held | {state.receiving.source} if state.receiving is not None else held


def _compare_tables(regs: dict[int, dict], server: int) -> str | None:
    """Compare every worker's key table with worker 0's; describe the first difference."""
    ref_worker = min(regs)
    ref = table_from_wire(regs[ref_worker]["keys"])
    for worker in sorted(regs):
        if worker == ref_worker:
            continue
        mine = table_from_wire(regs[worker]["keys"])
        for a, b in zip(ref, mine):
            if (a.nbytes, a.dtype, a.names) != (b.nbytes, b.dtype, b.names):
                return (f"model mismatch detected by server {server}: worker {worker} has "
                        f"{b.describe()} but worker {ref_worker} has {a.describe()}; every worker must build "
                        "the same model (same parameter names, shapes and dtypes, in the same order)")
        if len(ref) != len(mine):
            longer, which = (ref, ref_worker) if len(ref) > len(mine) else (mine, worker)
            extra = longer[min(len(ref), len(mine))]
            return (f"model mismatch detected by server {server}: worker {worker} has {len(mine)} keys "
                    f"but worker {ref_worker} has {len(ref)}; only worker {which} has {extra.describe()}")
    return None


def main() -> None:
    """Entry point of ``python -m imerge_hooks.server`` (MPMD launch): serve, then exit 0."""
    from . import runtime

    runtime.declare_server_program()
    runtime.init()
    raise SystemExit(0)  # init() does not return on a server; this is a safety net


if __name__ == "__main__":
    main()
