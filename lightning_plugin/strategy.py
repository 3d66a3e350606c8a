"""``Trainer(strategy="imerge")``: data-parallel training with gradients summed by IMerge's parameter servers.

Launch one MPI rank per device; the last ``IMERGE_NUM_SERVERS`` ranks are servers::

    mpiexec -n 4 -env IMERGE_NUM_SERVERS 1 python train.py     # 3 workers + 1 server

Every rank runs the same script. On server ranks each Trainer entry point (fit, validate,
test, predict) serves that stage and returns ``None``; guard rank-specific code with
``trainer.is_global_zero`` (False on servers) or ``imerge_hooks.is_server()``.

The optimizers returned by ``configure_optimizers`` are wrapped in place with
``imerge_hooks.DistributedOptimizer`` (same engine, same schedules). Gradients are complete
(averaged over the workers) before ``on_before_optimizer_step`` and gradient clipping when the
model clips or overrides that hook; otherwise ``optimizer.step()`` synchronises, which lets
the ``imerge`` schedule defer the update into the next forward pass.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed
from lightning_fabric.utilities.distributed import _distributed_is_initialized, _sync_ddp_if_available
from lightning_fabric.utilities.seed import reset_seed
from lightning_utilities.core.rank_zero import rank_zero_only
from pytorch_lightning.core.optimizer import LightningOptimizer
from pytorch_lightning.strategies.parallel import ParallelStrategy
from pytorch_lightning.utilities.model_helpers import is_overridden
from torch import Tensor

import imerge_hooks
from imerge_hooks import runtime
from imerge_hooks.config import Config
from imerge_hooks.errors import IMergeConfigError
from lightning_plugin.serving import serve_at_exit

from .environment import IMergeEnvironment
from .launcher import IMergeLauncher


class IMergeStrategy(ParallelStrategy):
    """Parameter-server data parallelism through IMerge; one process per device, launched by mpiexec.

    Args:
        num_servers: server ranks (default: ``IMERGE_NUM_SERVERS``, else 0: one process, no servers).
        schedule: one of ``imerge_hooks.SCHEDULES`` (default: ``IMERGE_SCHEDULE``, else ``imerge``).
        **config: any other ``imerge_hooks.Config`` field (``partition_bytes``, ``credit_bytes``,
            ``timeout_s``, ...). ``backward_passes_per_step`` is taken from
            ``Trainer(accumulate_grad_batches=...)`` in automatic optimization.
        accelerator, checkpoint_io, precision_plugin: as for every Lightning strategy.
    """

    strategy_name = "imerge"

    def __init__(self, num_servers: int | None = None, schedule: str | None = None, *,
                 accelerator: Any = None, checkpoint_io: Any = None, precision_plugin: Any = None,
                 **config: Any) -> None:
        self._config = {k: v for k, v in dict(config, schedule=schedule).items() if v is not None}
        Config.from_env(**self._config)  # unknown options and bad values fail here, on every rank
        _init_runtime(num_servers, self._config)
        super().__init__(accelerator=accelerator, parallel_devices=None, cluster_environment=IMergeEnvironment(),
                         checkpoint_io=checkpoint_io, precision_plugin=precision_plugin)
        self._set_rank_zero()

    # ------------------------------------------------------------------ topology
    @property
    def is_server(self) -> bool:
        return runtime.topology().is_server

    @property
    def root_device(self) -> torch.device:
        device = self.parallel_devices[0] if self.parallel_devices else torch.device("cpu")
        if device.type == "cuda":
            return torch.device("cuda", imerge_hooks.local_rank() % max(torch.cuda.device_count(), 1))
        return device

    @property
    def is_distributed(self) -> bool:  # read by Lightning to decide on a DistributedSampler
        return self.world_size > 1

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": self.world_size, "rank": self.global_rank}

    def set_world_ranks(self) -> None:
        self._set_rank_zero()

    def _set_rank_zero(self) -> None:
        # One object shared by lightning_utilities, lightning_fabric and (pytorch_)lightning.
        rank_zero_only.rank = self.global_rank

    def _configure_launcher(self) -> None:
        devices = self.parallel_devices or []
        if len(devices) > 1:
            workers = runtime.topology().num_workers
            raise IMergeConfigError(
                f"IMerge runs one process per device, but this process was given {len(devices)} devices "
                f"(Trainer(devices={len(devices)})). Pass Trainer(devices=1) and launch one MPI rank per device "
                f"plus the servers, e.g. `mpiexec -n {len(devices) * workers + 1} -env IMERGE_NUM_SERVERS 1 "
                "python train.py` for that many workers and one server (Open MPI: `mpirun -np N -x "
                "IMERGE_NUM_SERVERS=1 ...`); each worker uses the device of its local rank.")
        self._launcher = IMergeLauncher()

    # ------------------------------------------------------------------ set-up (workers only)
    def setup_environment(self) -> None:
        super().setup_environment()
        reset_seed()
        if self.world_size > 1:
            imerge_hooks.worker_group()  # torch.distributed over the workers: reduce, barrier, broadcast

    def setup(self, trainer: Any) -> None:
        self._trainer = trainer
        super().setup(trainer)  # convert module, move it, build optimizers (wrapped below), precision
        named = list(self.lightning_module.named_parameters()) + list(self.lightning_module.named_buffers())
        imerge_hooks.broadcast_parameters(named, root_rank=0)  # every worker starts from worker 0's state
        self._synchronize_before_manual_clipping()

    def setup_optimizers(self, trainer: Any) -> None:
        super().setup_optimizers(trainer)
        module = self.lightning_module
        named = list(module.named_parameters())
        passes = trainer.accumulate_grad_batches if module.automatic_optimization else None
        config = dict(self._config)
        if passes is not None:
            config["backward_passes_per_step"] = passes
        # Re-assigning rebuilds the LightningOptimizer wrappers over the wrapped classes (zero_grad in place).
        self.optimizers = [_distribute(opt, named, config) for opt in self.optimizers]

    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    def _synchronize_before_manual_clipping(self) -> None:
        """``LightningModule.clip_gradients`` (manual optimization) must see the averaged gradients.

        Lightning calls it after every automatic-optimization closure too, with ``clip_val=0`` when
        nothing is clipped: that call must not synchronize, or no step could defer its update.
        """
        plugin = self.precision_plugin
        if getattr(plugin, "_imerge_clip", False):
            return
        clip = plugin.clip_gradients

        def clip_gradients(optimizer: Any, clip_val: float | None = 0.0, *args: Any, **kwargs: Any) -> None:
            if clip_val and clip_val > 0:
                _synchronize(optimizer)
            clip(optimizer, clip_val, *args, **kwargs)

        plugin.clip_gradients = clip_gradients
        plugin._imerge_clip = True

    # ------------------------------------------------------------------ training
    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        inner = optimizer._optimizer if isinstance(optimizer, LightningOptimizer) else optimizer
        if not hasattr(inner, "_imerge_engine") or not self._needs_gradients_before_step(model):
            return super().optimizer_step(optimizer, closure, model, **kwargs)

        def closure_then_synchronize() -> Any:
            result = closure()
            inner.synchronize()
            return result

        with inner.skip_synchronize():  # synchronised in the closure, before hooks and clipping
            return super().optimizer_step(optimizer, closure_then_synchronize, model, **kwargs)

    def _needs_gradients_before_step(self, model: Any) -> bool:
        """Whether anything between backward and step reads the gradients (clipping, hooks, AMP unscaling)."""
        module = model if model is not None else self.lightning_module
        trainer = getattr(self, "_trainer", None)
        if trainer is not None and trainer.gradient_clip_val:
            return True
        if getattr(self.precision_plugin, "scaler", None) is not None:
            return True
        if any(is_overridden(name, module) for name in ("on_before_optimizer_step", "configure_gradient_clipping")):
            return True
        callbacks = trainer.callbacks if trainer is not None else []
        return any(is_overridden("on_before_optimizer_step", cb) for cb in callbacks)

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        # GradientAccumulationScheduler may change accumulate_grad_batches between epochs.
        trainer = getattr(self, "_trainer", None)
        if trainer is None or not self.lightning_module.automatic_optimization:
            return
        for opt in self.optimizers:
            engine = getattr(getattr(opt, "_optimizer", opt), "_imerge_engine", None)
            if engine is not None and engine.passes != trainer.accumulate_grad_batches and not engine.pending_gradients:
                engine.passes = trainer.accumulate_grad_batches

    # ------------------------------------------------------------------ pending updates
    def on_validation_start(self) -> None:
        runtime.flush_all()

    def on_test_start(self) -> None:
        runtime.flush_all()

    def on_predict_start(self) -> None:
        runtime.flush_all()

    def on_train_end(self) -> None:
        runtime.flush_all()

    def lightning_module_state_dict(self) -> dict[str, Any]:
        runtime.flush_all()
        return super().lightning_module_state_dict()

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        runtime.flush_all()
        super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)  # worker 0 writes

    # ------------------------------------------------------------------ collectives over the workers
    def reduce(self, tensor: Any, group: Any = None, reduce_op: Any = "mean") -> Any:
        if isinstance(tensor, Tensor):
            return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return tensor

    def barrier(self, name: str | None = None) -> None:
        if _distributed_is_initialized():
            torch.distributed.barrier()

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not _distributed_is_initialized():
            return obj
        holder = [obj]
        torch.distributed.broadcast_object_list(holder, src)
        return holder[0]

    # ------------------------------------------------------------------ tear-down
    def teardown(self) -> None:
        if runtime.is_initialized() and not self.is_server:
            runtime.flush_all()
        for opt in self.optimizers:
            engine = getattr(getattr(opt, "_optimizer", opt), "_imerge_engine", None)
            if engine is not None:
                engine.remove()  # a later fit() builds new optimizers; their hooks must be the only ones
        super().teardown()

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(cls.strategy_name, cls, description="IMerge parameter-server data parallelism",
                                   override=True)


def _init_runtime(num_servers: int | None, config: dict[str, Any]) -> None:
    if runtime.is_initialized():
        have = runtime.topology().num_servers
        if num_servers is not None and num_servers != have:
            raise IMergeConfigError(f"IMerge is already running with {have} server(s); IMergeStrategy("
                                    f"num_servers={num_servers}) cannot change that")
    else:
        imerge_hooks.init(num_servers, serve="stage", **config)
    serve_at_exit()


def _distribute(optimizer: Any, named: list, config: dict[str, Any]) -> Any:
    if hasattr(optimizer, "_imerge_engine"):
        return optimizer  # configure_optimizers returned an IMerge optimizer already
    if not any(p.requires_grad for group in optimizer.param_groups for p in group["params"]):
        return optimizer  # e.g. Lightning's mock optimizer when configure_optimizers returns None
    return imerge_hooks.DistributedOptimizer(optimizer, named_parameters=named, **config)


def _synchronize(optimizer: Any) -> None:
    inner = optimizer._optimizer if isinstance(optimizer, LightningOptimizer) else optimizer
    if hasattr(inner, "_imerge_engine"):
        inner.synchronize()

