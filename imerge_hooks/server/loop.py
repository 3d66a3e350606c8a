"""The parameter server: a streaming average per key.

Run implicitly by ``imerge_hooks.init()`` on the last ``num_servers`` ranks, or as its own
program in an MPMD launch::

    mpiexec -n 4 python train.py : -n 2 python -m imerge_hooks.server
"""

from __future__ import annotations

import heapq
import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NoReturn

import torch

from ..cluster.failure import abort
from ..cluster.topology import Topology
from ..core._mpi import MPI
from ..core.config import Config
from ..core.polling import Backoff
from ..core.requests import PendingRequests
from ..core.wire import (
    KEY_TAG_BASE,
    TAG_CONTROL,
    TAG_ERROR,
    TAG_REPLY,
    KeySpec,
    as_mpi_buffer,
    key_tag,
    split_key_tag,
    table_from_wire,
)
from .aggregate import KeyAggregate

if TYPE_CHECKING:
    from ..core.timeline import Timeline

log = logging.getLogger("imerge")

# A gap this long between two iterations of the server's loop means the process was not running
# (stopped, or starved of CPU): the stall clocks move on by the gap instead of blaming a worker.
CLOCK_JUMP_S = 5.0


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
    """A key on this server: its average (``aggregate.KeyAggregate``) and the MPI traffic around it."""

    agg: KeyAggregate
    first_push_at: float = 0.0
    warned: bool = False
    sends: list = field(default_factory=list)
    receiving: _Receive | None = None  # the push being received into this key's buffers
    held: deque = field(default_factory=deque)  # matched pushes of this key waiting for it
    held_since: float | None = None  # a new round's first push waits for the last round's results to leave
    send_to: list[int] = field(default_factory=list)  # the workers of ``sends``, in order
    sent_at: float = 0.0  # when ``sends`` were started
    buffers: dict = field(default_factory=dict)  # MPI views of the aggregate's buffers, built once

    @property
    def spec(self) -> KeySpec:
        return self.agg.spec

    def mpi_buffer(self, tensor: torch.Tensor) -> list:
        buf = self.buffers.get(id(tensor))
        if buf is None:
            buf = self.buffers[id(tensor)] = as_mpi_buffer(tensor)
        return buf


class Server:
    """Sums the pushes of all workers per key and sends every worker the result."""

    def __init__(self, topology: Topology, config: Config, timeline: Timeline | None = None) -> None:
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
        self.stage_results: dict[int, bytes] = {}  # stage index -> the result worker 0 ended it with
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
        self._delay_per_byte = config.debug_delay_per_mb_s / 1e6
        self._delayed: list[tuple[float, int, list[int], int]] = []
        self.timeline = timeline  # IMERGE_TIMELINE: this server's track
        self.bytes_in = 0
        self._last_tick = time.monotonic()

    # ------------------------------------------------------------------ main loop
    def serve(self, until: str = "shutdown") -> str:
        """Serve until every worker sent ``stage_end`` (returns "stage") or ``shutdown``.

        An exception here aborts the MPI job: otherwise every worker would wait for this server.
        """
        try:
            return self._serve(until)
        except BaseException as exc:  # noqa: BLE001 - ends the job
            log.exception("IMerge server %d (world rank %d): the server loop failed", self.index,
                          self.topo.world_rank)
            self._abort(f"{type(exc).__name__} in the server loop: {exc}", code=1)

    def _serve(self, until: str) -> str:
        backoff = Backoff()
        status = MPI.Status()
        last_stall_check = self._last_tick = time.monotonic()  # not running between serve() calls is no stall
        while True:
            now = self._tick()
            if self._delayed:
                self._send_due()
            if self._in_flight:
                self._progress_receives()
            if self._sends_pending:
                self._start_held_rounds()
            msg = self.comm.Improbe(MPI.ANY_SOURCE, MPI.ANY_TAG, status)
            if msg is None:
                self._progress_sends()
                if now - last_stall_check > 1.0:
                    self._check_stalls(now)
                    last_stall_check = now
                backoff.idle()
                continue
            backoff.reset()
            source, tag = status.Get_source(), status.Get_tag()
            if tag >= KEY_TAG_BASE:
                if self._shut:
                    self._check_after_shutdown(f"{self._describe_key(split_key_tag(tag)[0])} waits for it")
                self._on_push(msg, source, tag, status.Get_count(MPI.BYTE))
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
                if self._shut:
                    self._check_after_shutdown(f"worker {source} registers a new plan epoch without it")
                self._on_register(source, request)
            elif op == "join":
                self._on_join(source)
            elif op in ("stage_end", "shutdown"):
                if op == "shutdown":
                    self._shut.add(source)
                    self._check_shutdown(source)
                else:
                    self._stage_ends[source] += 1
                    if "result" in request:
                        self.stage_results[self._stage_ends[source] - 1] = request["result"]
                if len(self._shut) == self.workers:
                    self._finish("shutdown")
                    self._warn_if_unused()
                    return "shutdown"
                if until == "stage" and self._stage_complete():
                    self._stages += 1
                    self._finish("stage")
                    return "stage"
            else:
                log.error("IMerge server %d: unknown control op %r from rank %d", self.index, op, source)

    @property
    def stages_served(self) -> int:
        return self._stages

    def _stage_complete(self) -> bool:
        """Every worker ended the current stage or shut down.

        Counted across calls of serve(): a worker may already shut down (or end the next
        stage) in the same burst of messages in which the last one ends this stage.
        """
        return all(self._stage_ends[w] > self._stages or w in self._shut for w in range(self.workers))

    def _finish(self, why: str) -> None:
        self._drain_receives()
        self._wait_sends()
        partial = [k for k in self.keys.values() if k.agg.count]
        for k in partial:
            log.error("IMerge server %d: %s while %s still waits for %s",
                      self.index, why, k.spec.describe(), self._missing(k))

    def _warn_if_unused(self) -> None:
        """Every worker shut down and none ever registered a tensor: the job ran, but not through
        IMerge. Say so once (server 0), or a job that trained undistributed looks like a success."""
        if self.index != 0 or self.epoch >= 0 or self._stages or any(self._stage_ends):
            return
        log.warning("IMerge server 0: every worker shut down and none ever pushed a gradient to the servers: the "
                    "workers trained without IMerge (no DistributedOptimizer, no DDP comm hook "
                    "imerge_hooks.ps_hook, no strategy='imerge'), or the script decided not to run distributed "
                    "(it read RANK/WORLD_SIZE before imerge_hooks.init() set them, or ran with one worker); the %d "
                    "server(s) did nothing", self.topo.num_servers)

    # ------------------------------------------------------------------ failing fast
    def _abort(self, message: str, code: int = 3) -> NoReturn:
        """End the MPI job with ``message``, naming this server."""
        abort(f"IMerge server {self.index} (world rank {self.topo.world_rank}): {message}; aborting the job",
                      code)

    def _tick(self) -> float:
        """The time now. After a gap of ``CLOCK_JUMP_S`` since the last call this loop was not running
        (the process was stopped or starved): the stall clocks skip the gap, so no worker is blamed."""
        now = time.monotonic()
        gap, self._last_tick = now - self._last_tick, now
        if gap > CLOCK_JUMP_S:
            log.warning("IMerge server %d: its loop did not run for %.1f s (stopped or starved); the stall "
                        "clocks skip that time", self.index, gap)
            for state in self.keys.values():
                state.first_push_at += gap
                state.sent_at += gap
                if state.receiving is not None:
                    state.receiving.started += gap
                if state.held_since is not None:
                    state.held_since += gap
        return now

    def _check_shutdown(self, worker: int) -> None:
        """A worker shut down (its pushes are all in): fine unless a round it has not pushed to is
        under way. A normal end has every key complete, because a worker flushes before shutdown."""
        if worker in self.joined:  # counts as zero contributions
            return
        if self.joined:
            self._abort(f"worker {worker} shut down without calling imerge_hooks.join() while workers "
                        f"{sorted(self.joined)} wait in join(): every worker must call join() when its data ends")
        waiting = next((k for k in self.keys.values()
                        if k.agg.count and self._pusher_for(k, worker) not in k.agg.arrived), None)
        if waiting is not None:
            self._abort_early_shutdown(worker, f"{waiting.spec.describe()} waits for it")

    def _check_after_shutdown(self, what: str) -> None:
        """A push or a registration came after a worker shut down without joining: it never will."""
        gone = sorted(self._shut - self.joined)
        if gone:
            self._abort_early_shutdown(gone[0], what)

    def _abort_early_shutdown(self, worker: int, what: str) -> NoReturn:
        training = [w for w in range(self.workers) if w not in self._shut]
        self._abort(f"worker {worker} shut down while workers {training} still train ({what}); a worker that runs "
                    "out of data must call imerge_hooks.join()")

    def _pusher_for(self, state: _KeyState, worker: int) -> int:
        """The rank that pushes ``state``'s key for ``worker`` (itself, or its host's owner of the key)."""
        if worker in state.agg.pushers or not self.topo.hosts:
            return worker
        host = self.topo.hosts[worker]
        return next((r for r in state.agg.pushers if self.topo.hosts[r] == host), worker)

    def _missing(self, state: _KeyState) -> str:
        """``worker(s) [1] on host(s) ['b']``: who a key's open round still waits for (with host
        aggregation, the worker that pushes for a host: it waits for its host's workers in turn)."""
        missing = sorted(set(state.agg.pushers) - state.agg.arrived - self.silent)
        hosts = sorted({self.topo.hosts[r] for r in missing}) if self.topo.hosts else []
        text = f"worker(s) {missing}" + (f" on host(s) {hosts}" if hosts else "")
        if self.topo.aggregate_in_host:
            text += " (each pushes its host's sum: it may itself wait for a worker of its host)"
        return text

    def _describe_key(self, key: int) -> str:
        state = self.keys.get(key)
        return state.spec.describe() if state is not None else f"key {key}"

    # ------------------------------------------------------------------ registration
    def _on_register(self, source: int, request: dict) -> None:
        if self.joined:
            self._refuse_register_during_join(source, request)
            return
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
        self.keys = {k.key: old[k.key] if k.key in old and old[k.key].spec == k else
                     _KeyState(KeyAggregate(k, self.workers, self.cfg.join_divisor, self.topo.pushers(k.key)))
                     for k in table if k.server == self.index}
        for worker in regs:
            self.comm.send({"op": "ack", "epoch": self.epoch, "server": self.index}, dest=worker, tag=TAG_REPLY)
        log.debug("IMerge server %d: plan epoch %d with %d keys", self.index, self.epoch, len(self.keys))

    def _refuse_register_during_join(self, source: int, request: dict) -> None:
        """A plan epoch cannot change while some worker waits in join(): it would never register."""
        error = (f"IMerge server {self.index}: worker {source} registers plan epoch {request.get('epoch')} while "
                 f"worker(s) {sorted(self.joined)} have joined (out of data); a plan change (the end of "
                 "profile_steps, layers frozen or unfrozen) cannot happen during join(): make profile_steps smaller "
                 "than the shortest worker's number of steps")
        log.error("%s", error)
        self._registrations.pop(source, None)
        self.comm.send({"op": "error", "message": error}, dest=source, tag=TAG_REPLY)
        for worker in self.joined:
            self.comm.send({"op": "error", "message": error}, dest=worker, tag=TAG_REPLY)

    # ------------------------------------------------------------------ data
    def _on_push(self, msg: MPI.Message, source: int, tag: int, nbytes: int) -> None:
        key, round_number = split_key_tag(tag)
        state = self.keys.get(key)
        problem = None
        if state is None:
            problem = (f"IMerge server {self.index}: worker {source} pushed key {key}, which is not in plan "
                       f"epoch {self.epoch} (known keys: {sorted(self.keys)[:8]}...)")
        elif source not in state.agg.pushers:
            mine = next((r for r in state.agg.pushers if self.topo.hosts[r] == self.topo.hosts[source]), None)
            problem = (f"IMerge server {self.index}: worker {source} pushed {state.spec.describe()}, but with host "
                       f"aggregation worker {mine} pushes it for host {self.topo.hosts[source]!r} (its workers do "
                       "not agree on the hosts or on host_aggregation)")
        elif nbytes != state.spec.nbytes:
            problem = (f"IMerge server {self.index}: worker {source} pushed {nbytes} bytes for "
                       f"{state.spec.describe()}, expected {state.spec.nbytes}")
        elif source in state.agg.arrived or source in _matched_sources(state):
            problem = (f"IMerge server {self.index}: worker {source} pushed {state.spec.describe()} twice "
                       "in one round")
        else:
            problem = self._round_problem(state, source, round_number)
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

    def _round_problem(self, state: _KeyState, source: int, round_number: int) -> str | None:
        """The aggregate's round check (``KeyAggregate.round_problem``), worded for this server."""
        problem = state.agg.round_problem(round_number, state.agg.arrived | _matched_sources(state))
        if problem is None:
            return None
        return f"IMerge server {self.index}: worker {source} pushed {state.spec.describe()} {problem}"

    def _accept(self, state: _KeyState, msg: MPI.Message, source: int, nbytes: int) -> None:
        """Start receiving a matched push of a key that is not receiving one, unless it begins a new
        round while the last round's results, sent from the same buffer, are still going out: then
        hold it (first in line) rather than block the loop, so other keys keep moving."""
        if state.agg.count == 0 and state.sends and not MPI.Request.Testall(state.sends):
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
                self._abort_results_not_taken(state)

    def _start_receive(self, state: _KeyState, msg: MPI.Message, source: int, nbytes: int) -> None:
        first = state.agg.count == 0
        if first:
            self._wait_key_sends(state)  # returns at once: _accept started this round after those sends
            state.first_push_at = time.monotonic()
            state.warned = False
        request = msg.Irecv(state.mpi_buffer(state.agg.target(first)))
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
        """A push is in: add it to the key's average; send the average once every push is in."""
        done, state.receiving = state.receiving, None
        del self._in_flight[state.spec.key]
        state.agg.add(done.source, done.first)
        self.pushes += 1
        self.bytes_in += done.nbytes
        if state.agg.complete(self.silent):
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
            self._abort_late_receives(self._tick())
            backoff.idle()

    def _abort_late_receives(self, now: float) -> None:
        """Abort the job if a matched push has been arriving for longer than ``timeout_s``."""
        for state in self._in_flight.values():
            r = state.receiving
            if now - r.started > self.cfg.timeout_s:
                self._abort(f"the push of {state.spec.describe()} from worker {r.source} did not finish arriving "
                            f"within {self.cfg.timeout_s:.0f} s (timeout_s)")

    def _complete(self, state: _KeyState) -> None:
        """Every worker that still trains has pushed: send the average (rescaled if some joined)."""
        if self.timeline is not None:
            self.timeline.span(f"key {state.spec.key} ({', '.join(state.spec.names[:2])})", "server",
                               state.first_push_at, time.monotonic())
        dests, round_number = state.agg.finish()
        if self._delay_per_byte and not state.spec.names[0].startswith("calibration."):
            heapq.heappush(self._delayed, (time.monotonic() + state.spec.nbytes * self._delay_per_byte,
                                           state.spec.key, dests, round_number))
        else:
            self._send_result(state, dests, round_number)

    @property
    def silent(self) -> set[int]:
        """Joined workers, whose pushes count as zeros. With host aggregation none: a joined worker
        keeps pushing zeros in the rounds of the others (``engine.shadow_round``), its host needs it."""
        return set() if self.topo.aggregate_in_host else self.joined

    def _on_join(self, source: int) -> None:
        self.joined.add(source)
        self.last_joined = source
        for state in self.keys.values():
            if state.agg.complete(self.silent):
                self._complete(state)
        if len(self.joined) == self.workers:
            for worker in range(self.workers):
                self.comm.send({"op": "all_joined", "last": self.last_joined}, dest=worker, tag=TAG_REPLY)
            self.joined = set()

    def _send_result(self, state: _KeyState, dests: list[int], round_number: int) -> None:
        tag = key_tag(state.spec.key, round_number)
        out = state.mpi_buffer(state.agg.out)
        state.sends = [self.comm.Isend(out, dest=w, tag=tag) for w in dests]
        state.send_to, state.sent_at = list(dests), time.monotonic()
        for request in state.sends:
            self._sending.add(request, state)

    def _send_due(self) -> None:
        now = time.monotonic()
        while self._delayed and self._delayed[0][0] <= now:
            _, key, dests, round_number = heapq.heappop(self._delayed)
            self._send_result(self.keys[key], dests, round_number)

    def _wait_key_sends(self, state: _KeyState) -> None:
        if not state.sends:
            return
        backoff = Backoff()
        while not MPI.Request.Testall(state.sends):
            if self._tick() - state.sent_at > self.cfg.timeout_s:
                self._abort_results_not_taken(state)
            backoff.idle()
        state.sends = []

    def _abort_results_not_taken(self, state: _KeyState) -> None:
        """A key's result has not reached every worker within ``timeout_s``: name the ones it did not."""
        late = [w for w, request in zip(state.send_to, state.sends) if request and not request.Test()]
        self._abort(f"worker(s) {late} did not take the result of {state.spec.describe()} within "
                    f"{self.cfg.timeout_s:.0f} s (timeout_s): they are dead or stuck")

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
            if state.agg.count and now - state.first_push_at > self.cfg.timeout_s:
                self._abort(f"{state.spec.describe()} waited {now - state.first_push_at:.0f} s (timeout_s) for "
                            f"{self._missing(state)} (tensors: {', '.join(state.spec.names)}); they are dead or stuck")
            if state.agg.count and not state.warned and now - state.first_push_at > self.cfg.stall_warning_s:
                state.warned = True
                log.warning("IMerge server %d: %s has waited %.0f s for %s (tensors: %s)",
                            self.index, state.spec.describe(), now - state.first_push_at, self._missing(state),
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
        if worker == ref_worker or regs[worker].get("digest") == regs[ref_worker].get("digest"):
            continue
        problem = _compare_tensors(regs[ref_worker].get("tensors", []), regs[worker].get("tensors", []))
        if problem is not None:
            return (f"model mismatch detected by server {server}: {problem.format(worker=worker, ref=ref_worker)}; "
                    "every worker must build the same model (same parameter names, shapes and dtypes, in the same "
                    "order)")
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


def _compare_tensors(ref: list, mine: list) -> str | None:
    """The first tensor (name, shape, dtype) that differs, with {worker}/{ref} left to fill in."""
    for position, (a, b) in enumerate(zip(ref, mine)):
        if tuple(a) != tuple(b):
            return (f"tensor {b[0]!r} {tuple(b[1])} {b[2]} on worker {{worker}} stands where worker {{ref}} has "
                    f"{a[0]!r} {tuple(a[1])} {a[2]} (position {position} of the tensor table)")
    if len(ref) != len(mine):
        longer, which = (ref, "{ref}") if len(ref) > len(mine) else (mine, "{worker}")
        extra = longer[min(len(ref), len(mine))]
        return (f"worker {{worker}} has {len(mine)} tensors but worker {{ref}} has {len(ref)}; only worker {which} "
                f"has {extra[0]!r} {tuple(extra[1])}")
    return None
