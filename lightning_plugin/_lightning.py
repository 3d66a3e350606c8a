"""The Lightning names the plugin builds on: from ``pytorch_lightning``, else from the unified ``lightning``.

Both packages hold the same classes under different module names, with separate registries
and base classes, so the plugin is built on one of them: ``pytorch_lightning`` when it is
installed (also when ``lightning`` is), else ``lightning.pytorch``. Neither import starts MPI.
"""

from __future__ import annotations

try:
    from lightning_fabric.plugins.environments import ClusterEnvironment
    from lightning_fabric.utilities.distributed import _distributed_is_initialized, _sync_ddp_if_available
    from lightning_fabric.utilities.seed import reset_seed
    from pytorch_lightning.core.optimizer import LightningOptimizer
    from pytorch_lightning.strategies import ParallelStrategy, StrategyRegistry
    from pytorch_lightning.strategies.launchers.launcher import _Launcher
    from pytorch_lightning.trainer.states import TrainerStatus
    from pytorch_lightning.utilities.model_helpers import is_overridden

    PACKAGE = "pytorch_lightning"
except ImportError as missing:
    try:
        from lightning.fabric.plugins.environments import ClusterEnvironment
        from lightning.fabric.utilities.distributed import _distributed_is_initialized, _sync_ddp_if_available
        from lightning.fabric.utilities.seed import reset_seed
        from lightning.pytorch.core.optimizer import LightningOptimizer
        from lightning.pytorch.strategies import ParallelStrategy, StrategyRegistry
        from lightning.pytorch.strategies.launchers.launcher import _Launcher
        from lightning.pytorch.trainer.states import TrainerStatus
        from lightning.pytorch.utilities.model_helpers import is_overridden

        PACKAGE = "lightning.pytorch"
    except ImportError:
        raise ImportError("lightning_plugin needs pytorch_lightning (pip install pytorch-lightning) or lightning "
                          f"(pip install lightning); importing pytorch_lightning failed: {missing}") from missing

__all__ = [
    "PACKAGE",
    "ClusterEnvironment",
    "LightningOptimizer",
    "ParallelStrategy",
    "StrategyRegistry",
    "TrainerStatus",
    "_Launcher",
    "_distributed_is_initialized",
    "_sync_ddp_if_available",
    "is_overridden",
    "reset_seed",
]
