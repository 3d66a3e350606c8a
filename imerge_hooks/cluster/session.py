"""This process's IMerge session: its topology, settings, comm thread and the callbacks engines
register, and the accessors every other module reads them through (``runtime`` starts and stops it)."""

from __future__ import annotations

import itertools
from typing import Any

from ..core.config import PROCESS_OPTIONS, Config
from ..core.config import given as config_given
from ..core.errors import IMergeConfigError, IMergeError
from ..worker.comm import CommThread
from .topology import Topology


class State:
    """Set by ``runtime.init()``; read through the accessors below."""

    def __init__(self) -> None:
        self.topology: Topology | None = None
        self.config: Config | None = None
        self.comm_thread: CommThread | None = None
        self.server_program = False
        self.server: Any = None  # server.Server on a server rank once it serves
        self.explicit: dict[str, Any] = {}  # the options given to init() (explicit beats env)
        self.clients = itertools.count()
        self.process_group: Any = None
        self.own_process_group = False
        self.store = None  # worker 0: the workers' torch.distributed store it serves (rendezvous)
        self.store_socket = None
        self.master: tuple[str, int] | None = None  # the workers' torch.distributed rendezvous (worker 0)
        self.shut_down = False
        self.flush_callbacks: list = []
        self.join_callbacks: list = []  # engines finish their iteration before a join
        self.after_join_callbacks: list = []  # fn(last joiner): engines take its parameters
        self.shadow_callbacks: list = []  # fn(wait) -> workers that trained: engines shadow a round in join()
        self.timeline = None  # timeline.Timeline when IMERGE_TIMELINE is set


state = State()


def topology() -> Topology:
    if state.topology is None:
        raise IMergeError("IMerge is not initialised: call imerge_hooks.init() first")
    return state.topology


def config() -> Config:
    topology()
    return state.config


def engine_config(where: str, **options: Any) -> Config:
    """The settings of one engine (``where`` names its front end in errors).

    One precedence rule for every option: an explicit argument (the engine's, then ``init()``'s)
    > its ``IMERGE_*`` env var > the default. Process options (``PROCESS_OPTIONS``) belong to
    ``init()``: passing one to an engine is an error that says so, not silently ignored.
    """
    config()
    given = config_given(options)
    misplaced = sorted(given.keys() & PROCESS_OPTIONS)
    if misplaced:
        raise IMergeConfigError(f"IMerge: {', '.join(misplaced)}: process option(s) that {where} cannot change; "
                                f"pass them to imerge_hooks.init() or set IMERGE_{misplaced[0].upper()}")
    return Config.from_env(None, **{**state.explicit, **given})


def init_option(name: str) -> Any:
    """The value ``init()`` was given for engine option ``name`` (None: not given, or given as None)."""
    return state.explicit.get(name)


def comm_thread() -> CommThread | None:
    return state.comm_thread


def is_initialized() -> bool:
    return state.topology is not None


def new_client_id() -> int:
    return next(state.clients)


def add_flush_callback(fn) -> None:
    state.flush_callbacks.append(fn)


def add_join_callbacks(before, after, shadow) -> None:
    """An engine's part in ``join()`` (``worker_join``): ``before()`` finishes its iteration,
    ``after(last joiner)`` takes that worker's parameters, ``shadow(wait)`` shadows one round."""
    state.join_callbacks.append(before)
    state.after_join_callbacks.append(after)
    state.shadow_callbacks.append(shadow)


def remove_callbacks(*fns) -> None:
    """Unregister flush/join callbacks of a retired engine (missing ones are ignored)."""
    for lst in (state.flush_callbacks, state.join_callbacks, state.after_join_callbacks, state.shadow_callbacks):
        lst[:] = [f for f in lst if f not in fns]


def flush_all(reason: str = "imerge_hooks.flush_all()") -> None:
    """Apply every pending (deferred) update; anything that reads parameters calls this.

    ``reason`` names the caller: updates applied outside the forward are counted by it and the
    first one is logged (``GradientEngine.flush_deferred``)."""
    for fn in list(state.flush_callbacks):
        fn(reason)


def timeline():
    """This rank's Timeline, or None when IMERGE_TIMELINE is not set."""
    return state.timeline
