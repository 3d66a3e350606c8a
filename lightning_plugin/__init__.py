"""PyTorch Lightning integration of IMerge: ``Trainer(strategy="imerge")``.

Importing this package registers the strategy name ``"imerge"`` in Lightning's
``StrategyRegistry`` (Lightning reads no entry points)::

    import lightning_plugin  # noqa: F401  (registers "imerge")
    trainer = Trainer(strategy="imerge", accelerator="cpu", devices=1)
    trainer = Trainer(strategy=lightning_plugin.IMergeStrategy(num_servers=2, schedule="wfbp"))

launched as ``mpiexec -n 4 -env IMERGE_NUM_SERVERS 1 python train.py`` (3 workers + 1 server).

The plugin is built on ``pytorch_lightning``, or on ``lightning.pytorch`` where only the unified
``lightning`` package is installed (``lightning_plugin._lightning``).

Importing it does nothing else: no MPI, no ``imerge_hooks``. The classes load on first use
(``lightning_plugin.IMergeStrategy``, or the registry entry when a Trainer asks for
``"imerge"``). Every ``Trainer`` first asks Lightning's ``MPIEnvironment.detect()`` for the MPI
world size, which imports ``mpi4py.MPI`` and so starts MPI; ``imerge_hooks`` imports
``mpi4py.MPI`` without starting it, and MPI calls before ``MPI_Init`` abort the process, so
it must not be imported before that first Trainer (start MPI first if your script imports it).
MPI is otherwise started, and IMerge's collectives run, when the strategy is used: at the
first Trainer entry point (``fit``, ``validate``, ...) and in ``setup_environment``/``setup``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ._lightning import StrategyRegistry

if TYPE_CHECKING:
    from .environment import IMergeEnvironment
    from .launcher import IMergeLauncher
    from .strategy import IMergeStrategy

STRATEGY_NAME = "imerge"
_CLASSES = {"IMergeEnvironment": "environment", "IMergeLauncher": "launcher", "IMergeStrategy": "strategy"}


def __getattr__(name: str) -> Any:
    """Load ``IMergeStrategy``, ``IMergeEnvironment`` and ``IMergeLauncher`` on first use."""
    if name not in _CLASSES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_CLASSES[name]}", __name__), name)
    globals()[name] = value
    return value


def create_strategy(**kwargs: Any) -> IMergeStrategy:
    """``IMergeStrategy(**kwargs)``: what the registry entry ``"imerge"`` builds."""
    from .strategy import IMergeStrategy

    return IMergeStrategy(**kwargs)


def register_strategies(registry: Any = StrategyRegistry) -> None:
    """Register ``"imerge"`` in ``registry``; the class itself loads when a Trainer asks for it."""
    registry.register(STRATEGY_NAME, create_strategy, description="IMerge parameter-server data parallelism",
                      override=True)


register_strategies()

__all__ = ["STRATEGY_NAME", "IMergeEnvironment", "IMergeLauncher", "IMergeStrategy", "create_strategy",
           "register_strategies"]
