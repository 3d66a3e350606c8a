"""The Lightning names the plugin builds on: from ``pytorch_lightning`` or from the unified ``lightning``.

Both packages hold the same classes under different module names, with separate registries
and base classes, so the plugin is built on one of them, chosen when ``lightning_plugin`` is
first imported (:func:`_choose_package`): import your Lightning before ``lightning_plugin``, or
set ``IMERGE_LIGHTNING``. Neither import starts MPI.
"""

from __future__ import annotations

import importlib.util
import os
import sys


def _choose_package() -> str:
    """``IMERGE_LIGHTNING`` (``pytorch_lightning`` or ``lightning``) if set; else the one of the two
    the script imported already; else ``pytorch_lightning`` if installed; else ``lightning``."""
    wanted = os.environ.get("IMERGE_LIGHTNING", "").strip()
    if wanted:
        if wanted not in ("pytorch_lightning", "lightning"):
            raise ImportError(f"IMERGE_LIGHTNING={wanted!r}: use pytorch_lightning or lightning")
        return wanted
    imported = [name for name in ("pytorch_lightning", "lightning") if name in sys.modules]
    if len(imported) == 1:
        return imported[0]
    return "pytorch_lightning" if importlib.util.find_spec("pytorch_lightning") is not None else "lightning"


if _choose_package() == "pytorch_lightning":
    from lightning_fabric.plugins.environments import ClusterEnvironment
    from lightning_fabric.utilities.distributed import _distributed_is_initialized, _sync_ddp_if_available
    from lightning_fabric.utilities.seed import reset_seed
    from pytorch_lightning.core.optimizer import LightningOptimizer
    from pytorch_lightning.strategies import ParallelStrategy, StrategyRegistry
    from pytorch_lightning.strategies.launchers.launcher import _Launcher
    from pytorch_lightning.trainer.states import TrainerFn, TrainerStatus
    from pytorch_lightning.utilities.model_helpers import is_overridden

    PACKAGE = "pytorch_lightning"
else:
    try:
        from lightning.fabric.plugins.environments import ClusterEnvironment
        from lightning.fabric.utilities.distributed import _distributed_is_initialized, _sync_ddp_if_available
        from lightning.fabric.utilities.seed import reset_seed
        from lightning.pytorch.core.optimizer import LightningOptimizer
        from lightning.pytorch.strategies import ParallelStrategy, StrategyRegistry
        from lightning.pytorch.strategies.launchers.launcher import _Launcher
        from lightning.pytorch.trainer.states import TrainerFn, TrainerStatus
        from lightning.pytorch.utilities.model_helpers import is_overridden
    except ImportError as missing:
        raise ImportError("lightning_plugin needs pytorch_lightning (pip install pytorch-lightning) or lightning "
                          f"(pip install lightning): {missing}") from missing

    PACKAGE = "lightning.pytorch"

__all__ = [
    "PACKAGE",
    "ClusterEnvironment",
    "LightningOptimizer",
    "ParallelStrategy",
    "StrategyRegistry",
    "TrainerFn",
    "TrainerStatus",
    "_Launcher",
    "_distributed_is_initialized",
    "_sync_ddp_if_available",
    "is_overridden",
    "reset_seed",
]
