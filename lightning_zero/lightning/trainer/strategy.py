"""``ZeroStrategy``: the Trainer's adapter over :class:`~lightning_zero.engine.engine.ZeroEngine`. It registers
``zero1``, ``zero2``, ``zero3``, ``zero_auto`` (``auto.py``) and their ``_spawn`` / ``_fork`` variants, makes the
engine at setup and wires it into Lightning's precision, optimizer and checkpoint lifecycle (``precision.py``,
``steps.py``, ``checkpoints.py``)."""

from __future__ import annotations

from collections.abc import Generator
from contextlib import contextmanager
from dataclasses import replace
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal, Optional, Union

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.distributed import _sync_ddp_if_available
from lightning.pytorch.accelerators import Accelerator, CPUAccelerator, CUDAAccelerator
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies.launchers import _MultiProcessingLauncher, _SubprocessScriptLauncher
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import Tensor
from typing_extensions import override

from lightning_zero.checkpoints.storage import CheckpointError
from lightning_zero.comm import collectives
from lightning_zero.config import ZeroConfig, check_option_names
from lightning_zero.engine.auto.facts import build_whole
from lightning_zero.engine.construction import InitModuleRecording, abandon_construction, sharded_construction
from lightning_zero.engine.engine import ZeroEngine
from lightning_zero.lightning.processes import StartMethod, ZeroProcesses
from lightning_zero.lightning.trainer import early_checks
from lightning_zero.lightning.trainer.auto import AUTO_UNTIL_SETUP, STEPS_MEASURED, AutoRun, check_auto, choose_at_setup
from lightning_zero.lightning.trainer.auto import register as register_auto
from lightning_zero.lightning.trainer.checkpoints import CheckpointHooks
from lightning_zero.lightning.trainer.precision import ZeroPrecision, to_zero_precision
from lightning_zero.lightning.trainer.steps import StepHooks
from lightning_zero.process import one_report
from lightning_zero.process.shutdown import GUARD
from lightning_zero.stages import policy_for


class ZeroStrategy(CheckpointHooks, StepHooks, ZeroProcesses, ParallelStrategy):
    """ZeRO data parallelism: model states partitioned across the data-parallel ranks.

    Use ``Trainer(strategy="zero1")`` / ``"zero2"`` / ``"zero3"`` / ``"zero_auto"`` (``"zero2_spawn"`` to launch with
    ``spawn``), or
    construct it:

    Args:
        stage: 1 partitions optimizer states (and fp32 master weights), 2 also gradients, 3 also parameters;
            ``"auto"`` (``strategy="zero_auto"``): chosen at the setup of ``fit`` from the memory budget, the least
            costly of zero1, zero2, zero3, zero3 with ``offload_optimizer``, zero3 with ``offload_params`` whose
            predicted peak fits (see ``docs/zero_auto.md``); outside ``fit``, zero3.
        memory_budget: with ``stage="auto"``: bytes per rank, a size such as ``"20GiB"`` or a number; ``None``: the
            device's free memory (CPU: the host's available memory shared among this node's ranks) less 10%.
        process_group_backend: ``"gloo"`` or ``"nccl"``; default from the device.
        timeout: the process group's timeout, in seconds or as a ``timedelta`` (a hung collective fails after it).
        start_method: ``"popen"`` (Lightning's script launcher) or ``"spawn"``/``"fork"``/``"forkserver"``.
        **options: the engine's options, each defined once in :class:`~lightning_zero.ZeroConfig` (one line each
            there): ``reduce_bucket_size``, ``overlap_comm``, ``bucket_buffers``, ``partition_whole_params``,
            ``elementwise_optimizers``, ``unit_classes``, ``persistence_threshold``, ``prefetch_size``,
            ``host_mmap_threshold``, ``state_dict_type``, ``activation_checkpointing``, ``activation_offload``,
            ``activation_partition_group``, ``contiguous_checkpoints``, ``offload_optimizer``, ``offload_params``,
            ``offload_path``, ``shard_group_size``, ``tensor_parallel_size``, ``secondary_shard_group_size``,
            ``quantized_weights``, ``quantized_gradients``, ``quantization_block_size``, ``nonfinite``. LightningCLI
            reads their types and help from there too.
    """

    strategy_name = "zero"

    def __init__(
        self,
        stage: Literal[1, 2, 3, "auto"] = 2,
        accelerator: Optional[Accelerator] = None,
        parallel_devices: Optional[list[torch.device]] = None,
        cluster_environment: Optional[ClusterEnvironment] = None,
        checkpoint_io: Optional[CheckpointIO] = None,
        precision_plugin: Optional[Precision] = None,
        process_group_backend: Optional[str] = None,
        timeout: Optional[Union[float, timedelta]] = default_pg_timeout,
        start_method: StartMethod = "popen",
        memory_budget: Optional[Union[str, float]] = None,
        **options: Any,
    ) -> None:
        check_option_names(options)
        self._auto_budget = check_auto(stage, memory_budget, options)
        self._auto: Optional[AutoRun] = None
        """``zero_auto``: the choice of the last setup of ``fit``, and the peak measured after it."""
        fixed = AUTO_UNTIL_SETUP if stage == "auto" else stage  # see [Note: zero_auto records as zero3]
        self.config = ZeroConfig(stage=fixed, **options)
        self._init_processes(fixed, process_group_backend, timeout, start_method)
        self._choosing = stage == "auto"
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
        )
        self.num_nodes = 1
        self._ranks_in_step = True
        self._init_module = InitModuleRecording()
        """Stage 3: the recording of ``trainer.init_module(empty_init=True)``, on until setup."""
        self._failure: Optional[BaseException] = None
        """The exception the run is ending on (Lightning's ``on_exception``), until teardown."""

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        """``zero1``, ``zero2``, ``zero3``, ``zero_auto`` and their ``_spawn`` / ``_fork`` variants."""
        super().register_strategies(strategy_registry)
        register_auto(strategy_registry, cls)

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
    def is_distributed(self) -> bool:
        """Tells Lightning's connector to use a ``DistributedSampler`` (custom strategies must say so)."""
        return True

    # ------------------------------------------------------------------ processes
    @override
    def _configure_launcher(self) -> None:
        self._launcher = self._make_launcher(_SubprocessScriptLauncher, _MultiProcessingLauncher)

    @override
    def setup_environment(self) -> None:
        self._guard_signals()
        GUARD.where = self._stop_position
        super().setup_environment()
        self._start_distributed()
        # before configure_model: see [Note: a checkpoint is checked before the build] in early_checks.py
        early_checks.check_path(
            early_checks.selected_ckpt_path(self.lightning_module), early_checks.requested_trust(self.lightning_module)
        )
        if self.device_mesh is not None and self.lightning_module is not None:
            # as Lightning's ModelParallelStrategy: `configure_model` parallelizes over `self.device_mesh`
            self.lightning_module._device_mesh = self.device_mesh

    # ------------------------------------------------------------------ setup
    @override
    def setup(self, trainer: "pl.Trainer") -> None:
        """Make the engine over the LightningModule and the optimizers of ``configure_optimizers`` (none outside
        fit: stage 3 still shards the weights for validate, test and predict)."""
        assert self.accelerator is not None and self.model is not None and self.lightning_module is not None
        early_checks.check_shapes(
            early_checks.selected_ckpt_path(self.lightning_module),
            self.lightning_module,
            strict=self.lightning_module.strict_loading,  # before the engine shards the model
            trusted=early_checks.requested_trust(self.lightning_module),
        )
        self.accelerator.setup(trainer)
        self.precision_plugin.device_type = self.root_device.type
        fitting = trainer.state.fn == TrainerFn.FITTING
        self._ranks_in_step = True
        if self._choosing and fitting:
            self._choose(trainer)
        if not self.policy.shards_params:
            self.model_to_device()
        if fitting:
            super().setup_optimizers(trainer)
        recording = self._recording if self._recording is not None else self._init_module.take(self.lightning_module)
        self.engine = ZeroEngine(
            self.lightning_module,
            self.optimizers if fitting else [],
            precision=self.precision_plugin.mode,
            device=self.root_device,
            config=self.config,
            recording=recording,
            shard_groups=self.shard_groups,
        )
        self._recording = None  # construction is replayed once; the log holds no memory worth keeping
        self.precision_plugin.engine = self.engine
        # LightningOptimizer copies the optimizer's class when it is made: make them again after the engine swapped it.
        self.optimizers = list(self.optimizers)
        self.setup_precision_plugin()
        if fitting:
            rank_zero_info(self.engine.summary())

    def _choose(self, trainer: "pl.Trainer") -> None:
        """``zero_auto``: pick the configuration for this fit (see ``docs/zero_auto.md``); a model recorded on the
        meta device is built whole for stages 1 and 2."""
        assert self.lightning_module is not None
        self._auto = choose_at_setup(
            trainer,
            self.lightning_module,
            self.precision_plugin,
            self.config,
            self._auto_budget,
            lambda x, op: float(self.reduce(torch.tensor(x, dtype=torch.float64), reduce_op=op)),
            (self.world_size, self.num_processes),
        )
        self.config = self._auto.choice.chosen.candidate.apply(self.config)
        self.policy = policy_for(self.config.stage)
        if not self.policy.shards_params:
            recording = (
                self._recording if self._recording is not None else self._init_module.take(self.lightning_module)
            )
            build_whole(self.lightning_module, self.root_device, recording)
            self._recording = None
        rank_zero_info(self._auto.choice.line())

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        """``zero_auto``: after the first steps, the measured peak next to the predicted one."""
        super().on_train_batch_start(batch, batch_idx)
        if (
            self._auto is not None
            and self._auto.measured is None
            and self.lightning_module is not None
            and (self.lightning_module.trainer.global_step >= STEPS_MEASURED)
        ):
            self._measure_peak()

    @override
    def on_train_end(self) -> None:
        super().on_train_end()
        if self._auto is not None and self._auto.measured is None:
            self._measure_peak()

    def _measure_peak(self) -> None:
        assert self._auto is not None
        peak = torch.tensor(float(self._auto.meter.peak()))
        self._auto.measured = int(self.reduce(peak, reduce_op="max"))
        rank_zero_info(self._auto.report())

    @property
    def auto_run(self) -> Optional[AutoRun]:
        """``zero_auto``: the last choice (``.choice``, with every prediction) and the measured peak (``.measured``),
        ``None`` for a fixed stage."""
        return self._auto

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
        earlier = self._init_module.take(self.lightning_module) if self.lightning_module is not None else None
        with sharded_construction(self.root_device, earlier) as recording:  # continues `init_module`'s
            yield
        self._recording = recording

    @contextmanager
    @override
    def tensor_init_context(self, empty_init: Optional[bool] = None) -> Generator[None, None, None]:
        """``trainer.init_module(empty_init=True)`` under zero3 builds the model sharded and initialized, as Fabric's
        ``init_module`` (see [Note: empty_init under zero3] in ``engine/construction.py``); anything else is
        Lightning's: on the device, ``empty_init=True`` skipping the initializers (as ``ddp`` and ``deepspeed`` at
        stages 1-2)."""
        if not (self.policy.shards_params and empty_init):
            # the recording of an earlier `init_module` ends before this context's own torch mode is entered (the
            # Trainer enters this context around `configure_model`, then takes the recording inside it)
            self._init_module.stop()
            with super().tensor_init_context(empty_init):
                yield
            return
        with self._init_module.context(self.root_device, self.precision_plugin.tensor_init_context(), True):
            yield

    def _stop_position(self) -> str:
        """For the stop message: the global step the ranks stopped at and the checkpoint to resume from (the last one
        this run wrote, else the one it started from)."""
        trainer = getattr(self.lightning_module, "_trainer", None)
        if trainer is None:
            return ""
        if self.last_checkpoint is not None:
            resume = f"resume with `ckpt_path={str(self.last_checkpoint)!r}`, the last checkpoint this run wrote."
        elif trainer.ckpt_path:
            resume = f"no checkpoint was written in this run; it started from `ckpt_path={str(trainer.ckpt_path)!r}`."
        else:
            resume = "no checkpoint was written in this run, so it cannot be resumed."
        return f", at global step {trainer.global_step}: {resume}"

    @override
    def on_exception(self, exception: BaseException) -> None:
        """Lightning calls this when a run stops on an exception or Ctrl-C, just before :meth:`teardown`."""
        # a refused checkpoint is refused by every rank at the same point (its checks are agreed across ranks)
        self._ranks_in_step = self.world_size == 1 or isinstance(exception, CheckpointError)
        self._failure = exception
        trainer = getattr(self.lightning_module, "_trainer", None)
        root = trainer.default_root_dir if trainer is not None else "."
        one_report.report_once(exception, Path(root) / "lightning_zero_errors")  # one report, not one per rank

    @override
    def teardown(self) -> None:
        self._init_module.stop()  # a model built under init_module and never set up: stop recording it
        # see [Note: teardown after an exception] in engine.py: a single rank, and a checkpoint every rank refused,
        # still gather
        if self.engine is not None:
            if self.engine.skipped_steps:  # see [Note: the non-finite guard] in engine/engine.py
                rank_zero_info(
                    f"lightning-zero: {self.engine.skipped_steps} optimizer step(s) skipped on every rank "
                    "for non-finite gradients (`nonfinite='skip'`)."
                )
            # a simulated rank never holds the whole model (see [Note: one rank of a simulated world])
            self.engine.teardown(gather=self._ranks_in_step and not collectives.simulated())
            account = self.engine.memory.account()
            if account is not None and self.engine.completed_steps:
                rank_zero_info(f"lightning-zero: {account.describe()}")
        elif self.model is not None:  # setup stopped inside stage 3's construction: no meta tensor may be left
            abandon_construction(self.model, self.root_device)
        super().teardown()
        if self._choosing:  # the next fit chooses again, recording `configure_model` as zero3 until then
            self.config = replace(self.config, stage=AUTO_UNTIL_SETUP, offload_optimizer=False, offload_params=False)
            self.policy = policy_for(AUTO_UNTIL_SETUP)
        failure, self._failure = self._failure, None
        self._release_signals(failure)

    # ------------------------------------------------------------------ collectives for Lightning
    @override
    def reduce(
        self, tensor: Union[Tensor, Any], group: Optional[Any] = None, reduce_op: Optional[Union[Any, str]] = "mean"
    ) -> Union[Tensor, Any]:
        if isinstance(tensor, Tensor):
            return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return tensor
