"""``Trainer(strategy="imerge")``: data-parallel training with gradients summed by IMerge's parameter servers.

Launch one MPI rank per device; the last ``IMERGE_NUM_SERVERS`` ranks are servers::

    mpiexec -n 4 -env IMERGE_NUM_SERVERS 1 python train.py     # 3 workers + 1 server

Every rank runs the same script. On server ranks each Trainer entry point (fit, validate,
test, predict) serves that stage and returns what it returned on worker 0 (``launcher.py``);
an uncaught exception in a server's script is reported and the server serves on and exits 0
(``serving.py``). Guard rank-specific code with ``trainer.is_global_zero`` (False on servers)
or ``trainer.strategy.is_server`` (``imerge_hooks.is_server()`` once an entry point has
started IMerge).

The optimizers returned by ``configure_optimizers`` are wrapped in place with
``imerge_hooks.DistributedOptimizer`` (same engine, same schedules). Gradients are complete
(averaged over the workers) before ``on_before_optimizer_step`` and gradient clipping when the
model clips or overrides that hook; otherwise ``optimizer.step()`` synchronises, which lets
the ``imerge`` schedule defer the update into the next forward pass.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed
from lightning_utilities.core.rank_zero import rank_zero_only
from torch import Tensor
from typing_extensions import override

import imerge_hooks
from imerge_hooks.cluster import session
from imerge_hooks.cluster.devices import gpu_index
from imerge_hooks.core.config import PROCESS_OPTIONS, Config, given
from imerge_hooks.core.errors import IMergeConfigError

from ._lightning import (
    LightningOptimizer,
    ParallelStrategy,
    TrainerFn,
    _distributed_is_initialized,
    _sync_ddp_if_available,
    is_overridden,
    reset_seed,
)
from .environment import IMergeEnvironment
from .launcher import IMergeLauncher
from .serving import start as start_imerge

_IMERGE_METHODS = ("synchronize", "skip_synchronize", "set_backward_passes_per_step", "close", "gradients_pending")


class IMergeStrategy(ParallelStrategy):
    """Parameter-server data parallelism through IMerge; one process per device, launched by mpiexec.

    Building it checks the configuration and calls no MPI. IMerge starts (collective over
    COMM_WORLD) at the first Trainer entry point, on every rank; torch.distributed over the
    workers and the node ranks follow in ``setup_environment``, the first parameter broadcast
    in ``setup``.

    Args:
        num_servers: server ranks (default: ``IMERGE_NUM_SERVERS``, else 0: one process, no servers).
        schedule: one of ``imerge_hooks.SCHEDULES`` (default: ``IMERGE_SCHEDULE``, else ``imerge``).
        broadcast_buffers: as DDP's: before every training forward (and at validation during fit)
            worker 0's module buffers (BatchNorm running statistics) go to every worker.
        **config: any other ``imerge_hooks.Config`` field (``partition_bytes``, ``credit_bytes``,
            ``timeout_s``, ...). ``backward_passes_per_step`` is taken from
            ``Trainer(accumulate_grad_batches=...)`` in automatic optimization; in manual
            optimization several ``manual_backward`` calls before one ``step()`` accumulate, as
            under DDP.
        accelerator, checkpoint_io, precision_plugin: as for every Lightning strategy.
    """

    strategy_name = "imerge"

    def __init__(self, num_servers: int | None = None, schedule: str | None = None, *,
                 accelerator: Any = None, checkpoint_io: Any = None, precision_plugin: Any = None,
                 broadcast_buffers: bool = True, **config: Any) -> None:
        self._config = given(dict(config, schedule=schedule))
        Config.from_env(**self._config)  # unknown options and bad values fail here, on every rank
        _check_num_servers(num_servers)
        self._num_servers = num_servers
        self._broadcast_buffers = broadcast_buffers
        self._buffers_follow = True  # the next forward broadcasts buffers (see _before_forward)
        self._blocking_sync = False
        self._passes: int | None = None  # backward passes per step set on the IMerge optimizers
        self._environment = IMergeEnvironment(start=self.start_imerge)
        super().__init__(accelerator=accelerator, parallel_devices=None, cluster_environment=self._environment,
                         checkpoint_io=checkpoint_io, precision_plugin=precision_plugin)

    def start_imerge(self) -> None:
        """Start IMerge with this strategy's configuration (collective over COMM_WORLD); no-op once it runs."""
        start_imerge(self._num_servers, self._config)

    # ------------------------------------------------------------------ topology
    @property
    def is_server(self) -> bool:
        """Whether this rank is a parameter server (starts IMerge first if no entry point has)."""
        return self._environment.topology().is_server

    @property
    @override
    def root_device(self) -> torch.device:
        device = self.parallel_devices[0] if self.parallel_devices else torch.device("cpu")
        if device.type == "cuda":  # the GPU init() bound this worker to: its local rank among its host's workers
            return torch.device("cuda", gpu_index(self._environment.topology()))
        return device

    @property
    def is_distributed(self) -> bool:  # read by Lightning to decide on a DistributedSampler
        return self.world_size > 1

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": self.world_size, "rank": self.global_rank}

    def set_world_ranks(self) -> None:
        # One object shared by lightning_utilities, lightning_fabric and (pytorch_)lightning.
        rank_zero_only.rank = self.global_rank

    @override
    def _configure_launcher(self) -> None:
        devices = self.parallel_devices or []
        if len(devices) > 1:
            raise IMergeConfigError(
                f"IMerge runs one process per device, but this process was given {len(devices)} devices "
                f"(Trainer(devices={len(devices)})). Pass Trainer(devices=1) and launch one MPI rank per device "
                f"plus the servers, e.g. `mpiexec -n {len(devices) + 1} -env IMERGE_NUM_SERVERS 1 python train.py` "
                f"for {len(devices)} workers and one server (Open MPI: `mpirun -np N -x IMERGE_NUM_SERVERS=1 ...`); "
                "each worker uses the device of its local rank.")
        self._launcher = IMergeLauncher(self.start_imerge)

    # ------------------------------------------------------------------ set-up (workers only)
    @override
    def setup_environment(self) -> None:
        """The device, the seed and torch.distributed over the workers (collectives)."""
        super().setup_environment()
        reset_seed()
        self.set_world_ranks()
        if self.world_size > 1:
            imerge_hooks.worker_group()  # torch.distributed over the workers: reduce, barrier, broadcast

    @override
    def setup(self, trainer: Any) -> None:
        self._trainer = trainer
        self._buffers_follow = True  # as a new DDP wrapper of this stage
        if trainer.state.fn == TrainerFn.FITTING and self._layer_sync:  # Trainer(sync_batchnorm=True)
            if self.root_device.type != "cuda":
                raise IMergeConfigError(
                    f"IMerge: sync_batchnorm=True needs CUDA devices (torch's SyncBatchNorm does not run on "
                    f"{self.root_device.type}); use sync_batchnorm=False, where worker 0's BatchNorm statistics "
                    "are broadcast before every training step (broadcast_buffers=True)")
            self.model = self._layer_sync.apply(self.model)  # over the workers' torch.distributed group
        super().setup(trainer)  # convert module, move it, build optimizers (wrapped below), precision
        named = list(self.lightning_module.named_parameters()) + list(self.lightning_module.named_buffers())
        imerge_hooks.broadcast_parameters(named, root_rank=0)  # every worker starts from worker 0's state
        self._synchronize_before_manual_clipping()

    @override
    def setup_optimizers(self, trainer: Any) -> None:
        super().setup_optimizers(trainer)
        module = self.lightning_module
        named = list(module.named_parameters())
        self._passes = trainer.accumulate_grad_batches if module.automatic_optimization else None
        config = {k: v for k, v in self._config.items() if k not in PROCESS_OPTIONS}  # init() took those
        if self._passes is not None:
            config["backward_passes_per_step"] = self._passes
        # Re-assigning rebuilds the LightningOptimizer wrappers over the wrapped classes (zero_grad in place).
        self.optimizers = [_distribute(opt, named, config) for opt in self.optimizers]

    @override
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
    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        # In manual optimization Lightning's DDP turns DDP's gradient sync off after each training_step
        # forward (it reduces in manual_backward), and with it DDP's buffer broadcast before the next
        # forward: buffers go out before the first training step of a fit only, so here too.
        module = self.lightning_module
        manual = module is not None and not module.automatic_optimization
        self._before_forward(syncs_gradients=not self._blocking_sync and not manual)
        return super().training_step(*args, **kwargs)

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        trainer = getattr(self, "_trainer", None)
        if trainer is not None and trainer.state.fn == TrainerFn.FITTING:  # DDP's forward runs it then
            self._before_forward(syncs_gradients=False)
        return super().validation_step(*args, **kwargs)

    @contextlib.contextmanager
    @override
    def block_backward_sync(self) -> Iterator[None]:
        """Lightning's accumulation micro-batches (DDP's ``no_sync``); IMerge accumulates by itself."""
        self._blocking_sync = True
        try:
            yield
        finally:
            self._blocking_sync = False

    def _before_forward(self, syncs_gradients: bool) -> None:
        """``broadcast_buffers`` as DDP does it: worker 0's buffers go to every worker before a forward
        that follows a forward whose gradients were synchronised (DDP's ``require_forward_param_sync``)."""
        if self._buffers_follow and self._broadcast_buffers and self.world_size > 1 \
                and _distributed_is_initialized():
            for buffer in self.lightning_module.buffers():
                torch.distributed.broadcast(buffer, src=0)
        self._buffers_follow = syncs_gradients and torch.is_grad_enabled()

    @override
    def backward(self, closure_loss: Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> Tensor:
        """Manual optimization may call ``manual_backward`` several times before ``step()``; each
        earlier backward's gradients are averaged first, so the next one adds to averaged
        gradients (what DDP's all-reduce per backward gives)."""
        module = self.lightning_module
        if module is not None and not module.automatic_optimization:
            for inner in _imerge_optimizers(self.optimizers):
                if inner.gradients_pending():
                    inner.synchronize()
        return super().backward(closure_loss, optimizer, *args, **kwargs)

    @override
    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        inner = _imerge_optimizer(optimizer)
        if inner is not None and inner.gradients_averaged:  # manual clip_gradients synchronised already
            with inner.skip_synchronize():
                return super().optimizer_step(optimizer, closure, model, **kwargs)
        if inner is None or not self._needs_gradients_before_step(model):
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

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        # GradientAccumulationScheduler may change accumulate_grad_batches between epochs.
        trainer = getattr(self, "_trainer", None)
        if trainer is None or self._passes is None or trainer.accumulate_grad_batches == self._passes:
            return
        self._passes = trainer.accumulate_grad_batches
        for opt in _imerge_optimizers(self.optimizers):
            opt.set_backward_passes_per_step(self._passes)

    # ------------------------------------------------------------------ pending updates
    @override
    def on_validation_start(self) -> None:
        session.flush_all()

    @override
    def on_test_start(self) -> None:
        session.flush_all()

    @override
    def on_predict_start(self) -> None:
        session.flush_all()

    @override
    def on_train_end(self) -> None:
        session.flush_all()

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        session.flush_all()
        return super().lightning_module_state_dict()

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        session.flush_all()
        super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)  # worker 0 writes

    # ------------------------------------------------------------------ collectives over the workers
    @override
    def reduce(self, tensor: Any, group: Any = None, reduce_op: Any = "mean") -> Any:
        if isinstance(tensor, Tensor):
            return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return tensor

    @override
    def barrier(self, name: str | None = None) -> None:
        if not _distributed_is_initialized():
            return
        if torch.distributed.get_backend() == "nccl":  # as Lightning's DDP: the barrier on this worker's GPU
            torch.distributed.barrier(device_ids=[self.root_device.index])
        else:
            torch.distributed.barrier()

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not _distributed_is_initialized():
            return obj
        holder = [obj]
        torch.distributed.broadcast_object_list(holder, src)
        return holder[0]

    # ------------------------------------------------------------------ tear-down
    @override
    def teardown(self) -> None:
        """Close the IMerge optimizers (hooks, callbacks, the servers' keys), then Lightning's tear-down.

        ``close()`` is collective over the workers and their servers. Lightning tears down inside
        the entry point when it ends normally; after a failed one (torn down once the servers
        left the stage) the optimizers stay open: no worker waits there for one that failed.
        """
        if self._may_close_optimizers():
            for opt in _imerge_optimizers(self.optimizers):
                opt.close()  # a later fit() builds new optimizers; their hooks must be the only ones
        module = self.lightning_module
        if (self._layer_sync and module is not None and module._trainer is not None
                and module._trainer.state.fn == TrainerFn.FITTING and self.model is not None):
            self.model = self._layer_sync.revert(self.model)
        super().teardown()

    def _may_close_optimizers(self) -> bool:
        """On a worker: inside a stage its servers still serve, or without servers (closing is local)."""
        if not session.is_initialized() or session.topology().is_server:
            return False
        launcher = self.launcher
        return session.topology().num_servers == 0 or (isinstance(launcher, IMergeLauncher) and launcher.in_stage)

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        """Lightning's hook for a strategy to register itself: the package's one registration."""
        from . import register_strategies

        register_strategies(strategy_registry)


def _check_num_servers(num_servers: int | None) -> None:
    """``num_servers`` must agree with ``IMERGE_NUM_SERVERS`` and with a running IMerge (checks, no MPI)."""
    if num_servers is None:
        return
    env = os.environ.get("IMERGE_NUM_SERVERS")
    if env is not None and Config.from_env().num_servers not in (None, num_servers):
        raise IMergeConfigError(f"IMergeStrategy(num_servers={num_servers}) disagrees with the environment "
                                f"IMERGE_NUM_SERVERS={env}: every rank must use the same servers; pass one of them "
                                "(or the same number in both)")
    if session.is_initialized() and session.topology().num_servers != num_servers:
        raise IMergeConfigError(f"IMerge is already running with {session.topology().num_servers} server(s); "
                                f"IMergeStrategy(num_servers={num_servers}) cannot change that")


def _imerge_optimizer(optimizer: Any) -> Any | None:
    """The IMerge optimizer (``imerge_hooks.DistributedOptimizer``) behind ``optimizer``, or None."""
    inner = optimizer.optimizer if isinstance(optimizer, LightningOptimizer) else optimizer
    return inner if all(callable(getattr(inner, name, None)) for name in _IMERGE_METHODS) else None


def _imerge_optimizers(optimizers: list[Any]) -> list[Any]:
    return [inner for inner in map(_imerge_optimizer, optimizers) if inner is not None]


def _distribute(optimizer: Any, named: list, config: dict[str, Any]) -> Any:
    inner = _imerge_optimizer(optimizer)
    if inner is not None:  # configure_optimizers returned an IMerge optimizer already
        passes = config.get("backward_passes_per_step")
        if passes is not None:
            inner.set_backward_passes_per_step(passes)
        return optimizer
    if not any(p.requires_grad for group in optimizer.param_groups for p in group["params"]):
        return optimizer  # e.g. Lightning's mock optimizer when configure_optimizers returns None
    return imerge_hooks.DistributedOptimizer(optimizer, named_parameters=named, **config)


def _synchronize(optimizer: Any) -> None:
    inner = _imerge_optimizer(optimizer)
    if inner is not None:
        inner.synchronize()
