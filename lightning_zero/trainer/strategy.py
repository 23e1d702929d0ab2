"""``ZeroStrategy``: the only module that knows Lightning's strategy API. It registers ``zero1``, ``zero2``, ``zero3``
and their ``_spawn`` variants, and wires the engine into Lightning's precision, optimizer and checkpoint lifecycle."""

from __future__ import annotations

from collections.abc import Generator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, Literal, Optional, Union

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.strategies.registry import _StrategyRegistry
from lightning.fabric.utilities.distributed import (
    _get_default_process_group_backend_for_device,
    _init_dist_connection,
    _sync_ddp_if_available,
)
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.accelerators import Accelerator, CPUAccelerator, CUDAAccelerator
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies.launchers import _MultiProcessingLauncher, _SubprocessScriptLauncher
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_only
from torch import Tensor
from typing_extensions import override

from lightning_zero.engine import collectives
from lightning_zero.engine.activations import ActivationCheckpointing
from lightning_zero.checkpoints.storage import CheckpointError
from lightning_zero.config import ZeroConfig, check_option_names, process_group_timeout, resolve_shard_group_size
from lightning_zero.stage3.construction import Recording
from lightning_zero.engine.engine import ZeroEngine, sharded_construction
from lightning_zero.engine.host_memory import release_freed_memory
from lightning_zero.stage3.materialize import drop_meta
from lightning_zero.engine.optimizer import ShardedOptimizer
from lightning_zero.trainer.precision import ZeroPrecision, to_zero_precision
from lightning_zero.engine.shutdown import GUARD
from lightning_zero.engine.stages import all_policies, policy_for
from lightning_zero.trainer.checkpoints import CheckpointHooks
from lightning_zero.trainer.steps import StepHooks
from lightning_zero.stage3.units import UnitRuntime

StartMethod = Literal["popen", "spawn", "fork", "forkserver"]


class ZeroStrategy(CheckpointHooks, StepHooks, ParallelStrategy):
    """ZeRO data parallelism: model states partitioned across the data-parallel ranks.

    Use ``Trainer(strategy="zero1")`` / ``"zero2"`` / ``"zero3"`` (``"zero2_spawn"`` to launch with ``spawn``), or
    construct it:

    Args:
        stage: 1 partitions optimizer states (and fp32 master weights), 2 also gradients, 3 also parameters.
        process_group_backend: ``"gloo"`` or ``"nccl"``; default from the device.
        timeout: the process group's timeout, in seconds or as a ``timedelta`` (a hung collective fails after it).
        start_method: ``"popen"`` (Lightning's script launcher) or ``"spawn"``/``"fork"``/``"forkserver"``.
        **options: the engine's options, each defined once in :class:`~lightning_zero.ZeroConfig` (one line each
            there): ``reduce_bucket_size``, ``overlap_comm``, ``bucket_buffers``, ``partition_whole_params``,
            ``elementwise_optimizers``, ``unit_classes``, ``persistence_threshold``, ``prefetch_size``,
            ``host_mmap_threshold``, ``state_dict_type``, ``activation_checkpointing``, ``activation_offload``,
            ``activation_partition_group``, ``contiguous_checkpoints``, ``offload_optimizer``, ``offload_params``,
            ``shard_group_size``. LightningCLI reads their types and help from there too.
    """

    strategy_name = "zero"

    def __init__(
        self,
        stage: Literal[1, 2, 3] = 2,
        accelerator: Optional[Accelerator] = None,
        parallel_devices: Optional[list[torch.device]] = None,
        cluster_environment: Optional[ClusterEnvironment] = None,
        checkpoint_io: Optional[CheckpointIO] = None,
        precision_plugin: Optional[Precision] = None,
        process_group_backend: Optional[str] = None,
        timeout: Optional[Union[float, timedelta]] = default_pg_timeout,
        start_method: StartMethod = "popen",
        **options: Any,
    ) -> None:
        check_option_names(options)
        self.config = ZeroConfig(stage=stage, **options)
        self.policy = policy_for(stage)
        if start_method not in ("popen", "spawn", "fork", "forkserver"):
            raise ValueError(f"`start_method` must be 'popen', 'spawn', 'fork' or 'forkserver', got {start_method!r}.")
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=cluster_environment, checkpoint_io=checkpoint_io,
                         precision_plugin=precision_plugin)
        self._process_group_backend = process_group_backend
        self._timeout = process_group_timeout(timeout)
        self._start_method = start_method
        self.num_nodes = 1
        self.engine: Optional[ZeroEngine] = None
        """The engine of the last setup (see ``engine.py``); it stays after teardown for ``save_checkpoint``."""
        self._recording: Optional[Recording] = None
        self._ranks_in_step = True
        self.shard_groups = collectives.ShardGroups()
        """The process groups the engines shard over and replicate across (made in :meth:`setup_environment`)."""

    # ------------------------------------------------------------------ properties
    @property  # type: ignore[override]
    @override
    def precision_plugin(self) -> ZeroPrecision:
        if self._precision_plugin is None:
            self._precision_plugin = ZeroPrecision("32-true")
        return self._precision_plugin  # type: ignore[return-value]

    @precision_plugin.setter
    def precision_plugin(self, plugin: Optional[Precision]) -> None:
        self._precision_plugin = None if plugin is None else to_zero_precision(plugin)

    @property  # type: ignore[override]
    @override
    def accelerator(self) -> Optional[Accelerator]:
        return self._accelerator

    @accelerator.setter
    def accelerator(self, accelerator: Optional[Accelerator]) -> None:
        if accelerator is not None and not isinstance(accelerator, (CPUAccelerator, CUDAAccelerator)):
            raise ValueError(
                f"ZeroStrategy runs on CPU (gloo) and CUDA GPUs (nccl), not on {type(accelerator).__name__}. "
                "Use `Trainer(accelerator='cpu')` or `accelerator='gpu'`."
            )
        self._accelerator = accelerator

    @property
    @override
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": self.num_nodes * self.num_processes, "rank": self.global_rank}

    @property
    def is_distributed(self) -> bool:
        """Tells Lightning's connector to use a ``DistributedSampler`` (custom strategies must say so)."""
        return True

    @property
    def process_group_backend(self) -> Optional[str]:
        return self._process_group_backend

    @property
    def shard_group_size(self) -> int:
        """k, the ranks each model state is sharded over (the world size unless hybrid sharding)."""
        per_node = max(1, self.num_processes)
        return resolve_shard_group_size(self.config.shard_group_size, self.num_nodes * per_node, per_node,
                                        self.num_nodes)

    # ------------------------------------------------------------------ processes
    @override
    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        self.shard_group_size  # a bad `shard_group_size` fails before any process starts
        if self._start_method == "popen":
            self._launcher = _SubprocessScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)
        else:
            self._launcher = _MultiProcessingLauncher(self, start_method=self._start_method)

    @override
    def setup_environment(self) -> None:
        GUARD.install()  # see [Note: signals act at agreed step boundaries] in shutdown.py
        super().setup_environment()
        if self.root_device.type == "cpu":
            release_freed_memory(self.config.host_mmap_threshold)
        reset_seed()
        self.set_world_ranks()
        self._process_group_backend = self._process_group_backend or _get_default_process_group_backend_for_device(
            self.root_device
        )
        assert self.cluster_environment is not None
        _init_dist_connection(self.cluster_environment, self._process_group_backend, timeout=self._timeout)
        self.shard_groups = collectives.make_shard_groups(self.shard_group_size)

    def set_world_ranks(self) -> None:
        """Tell the cluster environment and ``rank_zero_only`` this process's ranks."""
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = self.global_rank

    # ------------------------------------------------------------------ setup
    @property
    def engines(self) -> list[ShardedOptimizer]:
        """The shards of each optimizer (those of the last setup: a checkpoint can still be saved after fit)."""
        return self.engine.optimizers if self.engine is not None else []

    @property
    def runtime(self) -> Optional[UnitRuntime]:
        """Stage 3's unit runtime while set up."""
        return self.engine.runtime if self.engine is not None else None

    @property
    def activations(self) -> Optional[ActivationCheckpointing]:
        return self.engine.activations if self.engine is not None else None

    @override
    def setup(self, trainer: "pl.Trainer") -> None:
        """Make the engine over the LightningModule and the optimizers of ``configure_optimizers`` (none outside
        fit: stage 3 still shards the weights for validate, test and predict)."""
        assert self.accelerator is not None and self.model is not None and self.lightning_module is not None
        self.accelerator.setup(trainer)
        self.precision_plugin.device_type = self.root_device.type
        fitting = trainer.state.fn == TrainerFn.FITTING
        self._ranks_in_step = True
        if not self.policy.shards_params:
            self.model_to_device()
        if fitting:
            super().setup_optimizers(trainer)
        self.engine = ZeroEngine(self.lightning_module, self.optimizers if fitting else [],
                                 precision=self.precision_plugin.mode, device=self.root_device, config=self.config,
                                 recording=self._recording, shard_groups=self.shard_groups)
        self._recording = None  # construction is replayed once; the log holds no memory worth keeping
        self.precision_plugin.engine = self.engine
        # LightningOptimizer copies the optimizer's class when it is made: make them again after the engine swapped it.
        self.optimizers = list(self.optimizers)
        self.setup_precision_plugin()
        if fitting:
            rank_zero_info(self.engine.summary())

    @override
    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    @contextmanager
    @override
    def model_sharded_context(self) -> Generator[None, None, None]:
        """Under zero3, ``configure_model`` builds on the meta device and is recorded; setup replays it one unit at a
        time (see [Note: record and replay] in ``construction.py``). ``load_pretrained`` there records what setup
        fills from the files."""
        if not self.policy.shards_params:
            yield
            return
        with sharded_construction(self.root_device) as recording:
            yield
        self._recording = recording

    @override
    def on_exception(self, exception: BaseException) -> None:
        """Lightning calls this when a run stops on an exception or Ctrl-C, just before :meth:`teardown`."""
        # a refused checkpoint is refused by every rank at the same point (its checks are agreed across ranks)
        self._ranks_in_step = self.world_size == 1 or isinstance(exception, CheckpointError)

    @override
    def teardown(self) -> None:
        # see [Note: teardown after an exception] in engine.py: a single rank, and a checkpoint every rank refused,
        # still gather
        if self.engine is not None:
            self.engine.teardown(gather=self._ranks_in_step)
        elif self.model is not None:  # setup stopped inside stage 3's construction: no meta tensor may be left
            drop_meta(self.model, self.root_device)
        super().teardown()
        GUARD.remove()
        GUARD.raise_pending()  # a Ctrl-C during the last checkpoint write still stops the script

    # ------------------------------------------------------------------ collectives for Lightning
    @override
    def barrier(self, name: Optional[str] = None) -> None:
        collectives.barrier(self.root_device)

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return collectives.broadcast_object(obj, src)

    @override
    def reduce(self, tensor: Union[Tensor, Any], group: Optional[Any] = None,
               reduce_op: Optional[Union[Any, str]] = "mean") -> Union[Tensor, Any]:
        if isinstance(tensor, Tensor):
            return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return tensor

    # ------------------------------------------------------------------ registration
    @classmethod
    @override
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        for policy in all_policies():
            for suffix, start_method in (("", "popen"), ("_spawn", "spawn"), ("_fork", "fork")):
                strategy_registry.register(
                    f"{policy.name}{suffix}", cls, override=True, stage=policy.stage, start_method=start_method,
                    description=f"ZeRO stage {policy.stage} ({policy.partitions}), start method '{start_method}'",
                )
