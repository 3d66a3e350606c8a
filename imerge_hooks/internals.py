"""The one seam through which the benchmark lab (``benchmarks/``) reaches IMerge's internals.

The lab (the emulated cluster, the replayed models, the runner) otherwise uses only the public
API: ``imerge_hooks`` itself, ``imerge_hooks.simulate``, ``imerge_hooks.tools.timeline_report`` and
``imerge_hooks.tools.transport_check``. What it needs beyond that is named here, and only here
(``tests/test_import_graph.py`` checks it), so a change to one of these internals shows which
lab code it touches. None of it is a stable API: any release may change it.
"""

from .cluster import collectives, messages, session
from .core._mpi import MPI
from .core.config import SCHEDULE_TRAITS, parse_value
from .core.layout import link_bytes
from .core.polling import Backoff
from .plan import calibrate
from .plan.choice import choose_plan, cluster_for, model_spec_from_profile
from .plan.costmodel import LinearModel, PSModel, extend_table, planner_model
from .plan.planner import plan as plan_groups
from .plan.search import SearchBudgetSpent
from .server import stages
from .worker.read_guard import AccessGuard
from .worker.schedule import SchedulePolicy

__all__ = [
    "MPI",  # mpi4py's MPI, imported without starting MPI (init() starts it with thread support)
    "SCHEDULE_TRAITS", "parse_value", "SchedulePolicy",  # what a schedule does; A/B of its policy fields
    "AccessGuard",  # the overlap's parameter guard (its cost per access)
    "link_bytes",  # bytes per link of a key layout
    "calibrate", "LinearModel", "PSModel", "extend_table", "planner_model",  # the cost models
    "choose_plan", "cluster_for", "model_spec_from_profile", "plan_groups", "SearchBudgetSpent",  # plan choice
    "Backoff",  # polled waits that do not spin a shared core
    "session", "collectives", "messages", "stages",  # a started process: topology, waits, server stages
]
