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
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_only, rank_zero_warn
from torch import Tensor
from torch.optim import Optimizer
from typing_extensions import override

from lightning_zero import collectives, pretrained
from lightning_zero.activations import ActivationCheckpointing, activations_from_config
from lightning_zero.checkpoint import CheckpointError
from lightning_zero.config import ZeroConfig, process_group_timeout, resolve_shard_group_size
from lightning_zero.construction import Recording, record_construction
from lightning_zero.estimate import human_bytes
from lightning_zero.materialize import (
    broadcast_module_states,
    drop_meta,
    move_materialized,
    shard_by_units,
    warn_if_built_in_full,
)
from lightning_zero.memory import expected_model_state_bytes, expected_offload_bytes
from lightning_zero.offload import fused_hint
from lightning_zero.optimizer import ShardedOptimizer
from lightning_zero.precision import ZeroPrecision, to_zero_precision
from lightning_zero.host_memory import release_freed_memory
from lightning_zero.shutdown import GUARD
from lightning_zero.sharing import whole_params_per_optimizer
from lightning_zero.stages import policy_for
from lightning_zero.strategy_checkpoints import CheckpointHooks
from lightning_zero.strategy_steps import StepHooks
from lightning_zero.units import UnitPlan, UnitRuntime, plan_units

StartMethod = Literal["popen", "spawn", "fork", "forkserver"]


class ZeroStrategy(CheckpointHooks, StepHooks, ParallelStrategy):
    """ZeRO data parallelism: model states partitioned across the data-parallel ranks.

    Use ``Trainer(strategy="zero1")`` / ``"zero2"`` / ``"zero3"`` (``"zero2_spawn"`` to launch with ``spawn``), or
    construct it:

    Args:
        stage: 1 partitions optimizer states (and fp32 master weights), 2 also gradients, 3 also parameters.
        reduce_bucket_size: elements per gradient bucket (constant memory: ``bucket_buffers`` of them); ``None``:
            from the model, ``clamp(Ψ / 32, 1M, 4M)`` (see [Note: the default bucket size] in ``config.py``).
        overlap_comm: stage 2 launches each bucket's reduce-scatter asynchronously during backward.
        bucket_buffers: bucket-sized buffers that may be in flight at once.
        partition_whole_params: give each rank whole tensors (``None``: only for non-elementwise optimizers).
        elementwise_optimizers: extra optimizer class names that may be stepped on flat slices.
        unit_classes: stage 3: module classes (or names) gathered as one unit; default: repeated blocks.
        persistence_threshold: stage 3: units with at most this many elements are gathered once per step.
        prefetch_size: stage 3: elements of upcoming units all-gathered ahead of their use.
        host_mmap_threshold: CPU runs on glibc: bytes above which freed tensors go back to the OS (the process's
            ``mallopt(M_MMAP_THRESHOLD)``; 0 leaves the allocator alone). See ``host_memory.py``.
        state_dict_type: ``"sharded"`` (default): checkpoints are directories, every rank writes its own pieces and
            any world size or stage loads them; ``"full"``: one file gathered on rank 0, in ``ddp``'s form.
        activation_checkpointing: recompute blocks in backward (non-reentrant, RNG preserved): ``True`` for the
            repeated blocks (``unit_classes`` if set), or a list of block classes / names. The module is unchanged.
        activation_offload: Pa+cpu: checkpointed block inputs wait in pinned host memory (no effect on CPU).
        activation_partition_group: Pa: ranks holding identical activations (a module's own tensor-parallel group;
            ZeRO's data-parallel ranks never do): a list of ranks, a list of such lists, or a callable giving a group.
        contiguous_checkpoints: MD: checkpointed block inputs live in one buffer preallocated after the first step.
        offload_optimizer: ZeRO-Offload: the fp32 master shard, the optimizer states and the step live in host memory
            (pinned on CUDA); gradient shards go to the host after their reduction, updates come back to the device.
        offload_params: stage 3 only: the parameter shards live in (pinned) host memory and each unit is uploaded
            as it is gathered (in prefetch order); the device holds only the units in flight.
        shard_group_size: hybrid sharding (HSDP, MiCS): shard over groups of this many ranks and replicate across
            the groups, so that only one all-reduce of the gradient shard crosses nodes. Default: the devices of
            one node when ``num_nodes > 1``, else all ranks. Must divide the world size.
        process_group_backend: ``"gloo"`` or ``"nccl"``; default from the device.
        timeout: the process group's timeout, in seconds or as a ``timedelta`` (a hung collective fails after it).
        start_method: ``"popen"`` (Lightning's script launcher) or ``"spawn"``/``"fork"``/``"forkserver"``.
    """

    strategy_name = "zero"

    def __init__(
        self,
        stage: Literal[1, 2, 3] = 2,
        reduce_bucket_size: Optional[int] = None,
        overlap_comm: bool = True,
        bucket_buffers: int = 2,
        partition_whole_params: Optional[bool] = None,
        elementwise_optimizers: tuple[str, ...] = (),
        unit_classes: tuple[Union[type, str], ...] = (),
        persistence_threshold: int = 100_000,
        prefetch_size: int = 5_000_000,
        host_mmap_threshold: int = 131_072,
        state_dict_type: Literal["sharded", "full"] = "sharded",
        activation_checkpointing: Union[bool, tuple[Union[type, str], ...]] = False,
        activation_offload: bool = False,
        activation_partition_group: Optional[Union[tuple[int, ...], tuple[tuple[int, ...], ...]]] = None,
        contiguous_checkpoints: bool = False,
        offload_optimizer: bool = False,
        offload_params: bool = False,
        shard_group_size: Optional[int] = None,
        accelerator: Optional[Accelerator] = None,
        parallel_devices: Optional[list[torch.device]] = None,
        cluster_environment: Optional[ClusterEnvironment] = None,
        checkpoint_io: Optional[CheckpointIO] = None,
        precision_plugin: Optional[Precision] = None,
        process_group_backend: Optional[str] = None,
        timeout: Optional[Union[float, timedelta]] = default_pg_timeout,
        start_method: StartMethod = "popen",
    ) -> None:
        self.config = ZeroConfig(stage=stage, reduce_bucket_size=reduce_bucket_size, overlap_comm=overlap_comm,
                                 bucket_buffers=bucket_buffers, partition_whole_params=partition_whole_params,
                                 elementwise_optimizers=elementwise_optimizers, unit_classes=unit_classes,
                                 persistence_threshold=persistence_threshold, prefetch_size=prefetch_size,
                                 host_mmap_threshold=host_mmap_threshold,
                                 state_dict_type=state_dict_type, activation_checkpointing=activation_checkpointing,
                                 activation_offload=activation_offload,
                                 activation_partition_group=activation_partition_group,
                                 contiguous_checkpoints=contiguous_checkpoints, offload_optimizer=offload_optimizer,
                                 offload_params=offload_params, shard_group_size=shard_group_size)
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
        self.engines: list[ShardedOptimizer] = []
        self.runtime: Optional[UnitRuntime] = None
        self.activations: Optional[ActivationCheckpointing] = None
        self._unit_plan = UnitPlan()
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
    @override
    def setup(self, trainer: "pl.Trainer") -> None:
        assert self.accelerator is not None and self.model is not None
        self.accelerator.setup(trainer)
        if self._recording is not None:
            self._recording.keep(self.model)  # before the precision plugin converts the module
        self.precision_plugin.device_type = self.root_device.type
        self.model = self.precision_plugin.convert_module(self.model)
        fitting = trainer.state.fn == TrainerFn.FITTING
        self._ranks_in_step = True
        assert self.lightning_module is not None
        self.activations = activations_from_config(self.lightning_module, self.config)
        if not fitting:
            self.engines = []  # those of an earlier fit were uninstalled at its teardown
        if self.policy.shards_params:
            self._setup_sharded_params(trainer, fitting)
        else:
            self.model_to_device()
            broadcast_module_states(self.model)
            if fitting:
                self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        pretrained.attach(self.lightning_module, self)  # `load_pretrained` after setup writes into the shards
        if fitting:
            rank_zero_info(self._summary())

    def _setup_sharded_params(self, trainer: "pl.Trainer", fitting: bool) -> None:
        """Stage 3: plan the units, make the optimizers' engines, then shard the model unit by unit."""
        assert self.model is not None and self.lightning_module is not None
        warn_if_built_in_full(self.model)
        move_materialized(self.model, self.root_device)
        self._unit_plan = plan_units(self.lightning_module, self.config.unit_classes, self.config.persistence_threshold)
        if fitting:
            self.setup_optimizers(trainer)
        elif any(p.requires_grad for p in self.model.parameters()):
            self.engines = [self._evaluation_engine()]
        shard_by_units(self.model, self._unit_plan, self.engines, self.root_device, self._recording)
        self._recording = None  # construction is replayed once; the log holds no memory worth keeping
        self.runtime = UnitRuntime(self._unit_plan, self.engines, self.config.prefetch_size)
        pretrained.fill_pending(self.lightning_module, self.engines, self.runtime)  # loads from configure_model

    def _summary(self) -> str:
        """One line for the start of fit: what each rank holds, next to what DDP would hold (DESIGN.md's table)."""
        psi = sum(p.numel() for engine in self.engines for p in engine.params)
        precision = self.precision_plugin.precision
        zero = expected_model_state_bytes(psi, self.shard_group_size, self.config.stage, precision)
        ddp = expected_model_state_bytes(psi, self.world_size, 0, precision)
        where = ""
        moved = [name for name in ("offload_optimizer", "offload_params") if getattr(self.config, name)]
        if moved:  # see [Note: what lives where with offload_optimizer=True] in offload.py
            zero, host = expected_offload_bytes(psi, self.shard_group_size, self.config.stage, precision,
                                                self.config.offload_optimizer, self.config.offload_params)
            where = f" on the device + {human_bytes(host)} in host memory ({', '.join(moved)})"
        k = self.shard_group_size
        hybrid = f" (sharded over groups of {k}, replicated {self.world_size // k}x)" if k != self.world_size else ""
        return (f"ZeRO stage {self.config.stage} on {self.world_size} rank{'s' if self.world_size != 1 else ''}"
                f"{hybrid}, "
                f"precision {precision}: {psi:,} trainable parameters; model states {human_bytes(zero)}{where} per "
                f"rank (DDP: {human_bytes(ddp)}, {zero / ddp:.0%} of it)" if ddp else "no trainable parameters")

    def _evaluation_engine(self) -> ShardedOptimizer:
        """validate/test/predict under zero3 shard the weights too; an internal SGD (never stepped) holds them."""
        assert self.model is not None
        return self._make_engine(torch.optim.SGD([p for p in self.model.parameters() if p.requires_grad], lr=0.0))

    def _make_engine(self, optimizer: Optimizer, whole_params: Optional[bool] = None) -> ShardedOptimizer:
        """The engine of ``optimizer``; it borrows the parameters the engines made before it already hold."""
        precision = self.precision_plugin
        unit_of = self._unit_plan.unit if self.policy.shards_params else None
        return ShardedOptimizer(optimizer, self.policy, self.config, precision.working_dtype, precision.master_dtype,
                                self.root_device, module=self.lightning_module, unit_of=unit_of,
                                unit_names=self._unit_plan.names, owners=list(self.engines), whole_params=whole_params,
                                groups=self.shard_groups)

    @override
    def setup_optimizers(self, trainer: "pl.Trainer") -> None:
        self._uninstall_engines()
        self.engines = []
        super().setup_optimizers(trainer)
        # several optimizers may hold the same parameter: see [Note: parameters shared by several optimizers]
        for optimizer, whole_params in zip(self.optimizers, whole_params_per_optimizer(self.optimizers, self.config)):
            self.engines.append(self._make_engine(optimizer, whole_params))
            hint = fused_hint(optimizer) if self.config.offload_optimizer else None
            if hint:
                rank_zero_warn(hint)
        # LightningOptimizer copies the optimizer's class when it is made: make them again after the engine swapped it.
        self.optimizers = list(self.optimizers)

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
        with record_construction(self.root_device) as recording, pretrained.deferring():
            yield
        self._recording = recording

    @override
    def on_exception(self, exception: BaseException) -> None:
        """Lightning calls this when a run stops on an exception or Ctrl-C, just before :meth:`teardown`."""
        # a refused checkpoint is refused by every rank at the same point (its checks are agreed across ranks)
        self._ranks_in_step = self.world_size == 1 or isinstance(exception, CheckpointError)

    @override
    def teardown(self) -> None:
        # [Note: teardown after an exception]
        # A normal teardown gathers the full weights back into the module, which takes every rank. After an
        # exception or Ctrl-C the ranks stopped at different points (a peer may be gone), so a collective would be
        # matched against a different one or hang: teardown then only removes the hooks, and stage 3's parameters
        # become empty tensors (their gathered storage is gone). The last checkpoint is the state to resume or load
        # from. A single rank, and a checkpoint every rank refused, still gather.
        gather = self._ranks_in_step
        if self.runtime is not None:
            if gather:
                self.runtime.release_all(include_root=True)
            self.runtime.remove()
            self.runtime = None
        if self.activations is not None:
            self.activations.remove()
        self._uninstall_engines(gather)
        if not gather and self.model is not None:
            drop_meta(self.model, self.root_device)
        if self.lightning_module is not None:
            pretrained.detach(self.lightning_module)
        super().teardown()
        GUARD.remove()
        GUARD.raise_pending()  # a Ctrl-C during the last checkpoint write still stops the script

    def _uninstall_engines(self, gather: bool = True) -> None:
        # The engines stay reachable after teardown: `trainer.save_checkpoint` after `fit` still needs their shards.
        for engine in self.engines:
            engine.uninstall(gather)

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
        for stage in (1, 2, 3):
            for suffix, start_method in (("", "popen"), ("_spawn", "spawn"), ("_fork", "fork")):
                strategy_registry.register(
                    f"zero{stage}{suffix}", cls, description=f"ZeRO stage {stage}, start method '{start_method}'",
                    override=True, stage=stage, start_method=start_method,
                )
