"""PyTorch Lightning integration of IMerge: ``Trainer(strategy="imerge")``.

Importing this package registers the strategy name ``"imerge"`` in Lightning's
``StrategyRegistry`` (Lightning reads no entry points)::

    import lightning_plugin  # noqa: F401  (registers "imerge")
    trainer = Trainer(strategy="imerge", accelerator="cpu", devices=1)
    trainer = Trainer(strategy=lightning_plugin.IMergeStrategy(num_servers=2, schedule="wfbp"))

launched as ``mpiexec -n 4 -env IMERGE_NUM_SERVERS 1 python train.py`` (3 workers + 1 server).

``pytorch_lightning`` and the unified ``lightning`` package keep separate registries and
separate base classes. ``IMergeStrategy`` here is built on ``pytorch_lightning``; when
``lightning`` is installed too, the same modules are loaded a second time against
``lightning.pytorch`` / ``lightning.fabric`` (the way Lightning derives one package from the
other) as ``lightning_plugin.unified``, and ``"imerge"`` is registered in both registries.
"""

from __future__ import annotations

import importlib.util
import sys
import types
from pathlib import Path
from typing import Any

_MODULES = {"environment": "IMergeEnvironment", "launcher": "IMergeLauncher", "strategy": "IMergeStrategy"}


def _load_for_unified_lightning() -> types.ModuleType:
    """The strategy modules rewritten for the ``lightning`` package, as ``lightning_plugin.unified``."""
    package = types.ModuleType(f"{__name__}.unified", "IMerge strategy for the unified `lightning` package")
    package.__path__ = []
    sys.modules[package.__name__] = package
    for name, cls in _MODULES.items():  # in dependency order
        path = Path(__file__).with_name(f"{name}.py")
        source = path.read_text().replace("pytorch_lightning", "lightning.pytorch")
        source = source.replace("lightning_fabric", "lightning.fabric")
        module = types.ModuleType(f"{package.__name__}.{name}")
        module.__file__, module.__package__ = str(path), package.__name__
        sys.modules[module.__name__] = module
        exec(compile(source, str(path), "exec"), module.__dict__)
        setattr(package, name, module)
        setattr(package, cls, getattr(module, cls))
    from lightning.pytorch.strategies import StrategyRegistry

    package.IMergeStrategy.register_strategies(StrategyRegistry)
    return package


def _start_mpi() -> None:
    """Start MPI now, as importing mpi4py normally does (importing imerge_hooks alone does not).

    Every Trainer asks Lightning's built-in ``MPIEnvironment.detect()`` for the MPI world size
    before it builds any strategy, and that calls MPI.
    """
    from imerge_hooks import _mpi

    getattr(_mpi, "ensure_initialized", lambda: None)()


_start_mpi()

IMergeStrategy: Any = None
IMergeEnvironment: Any = None
IMergeLauncher: Any = None

if importlib.util.find_spec("pytorch_lightning") is not None:
    from pytorch_lightning.strategies import StrategyRegistry as _registry

    from .environment import IMergeEnvironment
    from .launcher import IMergeLauncher
    from .strategy import IMergeStrategy

    IMergeStrategy.register_strategies(_registry)

if importlib.util.find_spec("lightning") is not None and importlib.util.find_spec("lightning.pytorch") is not None:
    unified = _load_for_unified_lightning()
    if IMergeStrategy is None:
        IMergeEnvironment, IMergeLauncher, IMergeStrategy = (
            unified.IMergeEnvironment, unified.IMergeLauncher, unified.IMergeStrategy)

if IMergeStrategy is None:
    raise ImportError("lightning_plugin needs pytorch_lightning (pip install pytorch-lightning) or lightning")

__all__ = ["IMergeEnvironment", "IMergeLauncher", "IMergeStrategy"]
