"""``ZeroStrategy``: the Trainer's adapter over ``ZeroEngine``. It registers
``zero1``, ``zero2``, ``zero3`` and their ``_spawn`` / ``_fork`` variants (``zero_auto`` is its subclass
``ZeroAutoStrategy``, in ``auto.py``), makes the engine at setup and hands it Lightning's steps, backward and
checkpoints; the optimizer step goes through the precision plugin (``precision.py``)."""

from __future__ import annotations

from collections.abc import Generator, Iterator, Mapping
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Literal, Optional, Union

import lightning
import lightning.pytorch as pl
import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.accelerators import Accelerator, CPUAccelerator, CUDAAccelerator
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies.launchers import _MultiProcessingLauncher, _SubprocessScriptLauncher
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import Tensor
from torch.optim import Optimizer
from typing_extensions import override

from lightning_zero.checkpoints.storage import KEY, CheckpointError
from lightning_zero.comm import collectives
from lightning_zero.config import ZeroConfig, check_option_names
from lightning_zero.engine import state as engine_state
from lightning_zero.engine.construction import abandon_construction, sharded_construction
from lightning_zero.engine.engine import ZeroEngine
from lightning_zero.engine.state import STORAGE_OPTIONS_ERROR
from lightning_zero.lightning.processes import StartMethod, ZeroProcesses
from lightning_zero.lightning.trainer import early_checks
from lightning_zero.lightning.trainer.precision import ZeroPrecision, to_zero_precision
from lightning_zero.process import one_report
from lightning_zero.process.shutdown import GUARD
from lightning_zero.stage3.construction import Recording


class ZeroStrategy(ZeroProcesses, ParallelStrategy):
    """ZeRO data parallelism: model states partitioned across the data-parallel ranks.

    Use ``Trainer(strategy="zero1")`` / ``"zero2"`` / ``"zero3"`` (``"zero2_spawn"`` to launch with ``spawn``), or
    construct it; ``strategy="zero_auto"`` is its subclass ``ZeroAutoStrategy``. Lightning calls the step and
    checkpoint hooks after ``setup``, which makes the engine.

    Args:
        stage: 1 partitions optimizer states (and fp32 master weights), 2 also gradients, 3 also parameters (a
            stage chosen from a memory budget: ``ZeroAutoStrategy``).
        process_group_backend: ``"gloo"`` or ``"nccl"``; default from the device.
        timeout: the process group's timeout, in seconds or as a ``timedelta`` (a hung collective fails after it).
        start_method: ``"popen"`` (Lightning's script launcher) or ``"spawn"``/``"fork"``/``"forkserver"``.
        **options: ``ZeroConfig``'s fields, see ``docs/options.md``.
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
        if stage == "auto" or "memory_budget" in options:
            raise ValueError(
                "A stage chosen from a memory budget is `ZeroAutoStrategy(memory_budget=...)` (or "
                f"`strategy='zero_auto'`); `ZeroStrategy` takes `stage` 1, 2 or 3, got {stage!r}."
            )
        check_option_names(options)
        ZeroProcesses.__init__(self, ZeroConfig(stage=stage, **options), process_group_backend, timeout, start_method)
        ParallelStrategy.__init__(
            self,
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
        )
        self.num_nodes = 1
        self._recording: Optional[Recording] = None
        """Stage 3: the recording of ``configure_model`` (see ``model_sharded_context``), replayed by setup."""
        self._ranks_in_step = True
        """Whether every rank is at the same point, so that teardown may gather (not after one rank's exception)."""
        self._failure: Optional[BaseException] = None
        """The exception the run is ending on (Lightning's ``on_exception``), until teardown."""
        self.last_checkpoint: Optional[Path] = None
        """The last checkpoint this strategy wrote (the stop message of a Ctrl-C or SIGTERM names it)."""

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
        if fitting:
            self._configure_fit(trainer)
        if not self.policy.shards_params:
            self.model_to_device()
        if fitting:
            super().setup_optimizers(trainer)
        self.engine = ZeroEngine(
            self.lightning_module,
            self.optimizers if fitting else [],
            precision=self.precision_plugin.mode,
            device=self.root_device,
            config=self.config,
            recording=self._take_recording(),
            shard_groups=self.shard_groups,
        )
        self.precision_plugin.engine = self.engine
        # LightningOptimizer copies the optimizer's class when it is made: make them again after the engine swapped it.
        self.optimizers = list(self.optimizers)
        self.setup_precision_plugin()
        if fitting:
            rank_zero_info(self.engine.summary())

    def _configure_fit(self, trainer: "pl.Trainer") -> None:
        """The configuration of a fit, set before its engine is made: the one given (``ZeroAutoStrategy`` chooses
        it here)."""

    def _take_recording(self) -> Optional[Recording]:
        """Stage 3's recording of the model's construction (``configure_model``'s, else ``init_module``'s), for the
        engine to replay; ``None`` when nothing was recorded."""
        assert self.lightning_module is not None
        recording = self._recording if self._recording is not None else self._init_module.take(self.lightning_module)
        self._recording = None  # construction is replayed once; the log holds no memory worth keeping
        return recording

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

    # ------------------------------------------------------------------ the step
    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        assert self.engine is not None and self.lightning_module is not None
        self._step_boundary()
        self.engine.begin_step()
        self.engine.completed_steps = self.lightning_module.trainer.global_step  # named by the non-finite guard
        output = super().training_step(*args, **kwargs)
        if not self.lightning_module.automatic_optimization:
            self.engine.end_step()
        return output

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._evaluation_step(super().validation_step, *args, **kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._evaluation_step(super().test_step, *args, **kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._evaluation_step(super().predict_step, *args, **kwargs)

    def _evaluation_step(self, step: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """An evaluation step between the engine's ``begin_step`` and ``end_step`` (stage 3 gathers and frees its
        units around it), at a step boundary every rank agrees on signals at."""
        assert self.engine is not None
        self._step_boundary("evaluation.step")
        self.engine.begin_step()
        try:
            return step(*args, **kwargs)
        finally:
            self.engine.end_step()

    @override
    @contextmanager
    def block_backward_sync(self) -> Iterator[None]:
        """The micro-batches ``accumulate_grad_batches`` runs before the one the step follows."""
        assert self.engine is not None
        with self.engine.no_backward_sync():
            yield

    @override
    def post_backward(self, closure_loss: Tensor) -> None:
        assert self.engine is not None and self.lightning_module is not None
        # manual optimization may run more forwards before its `optimizer.step()`: the root stays until the step ends
        self.engine.finish_backward(include_root=self.lightning_module.automatic_optimization)

    # ------------------------------------------------------------------ checkpoints
    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        """Checkpoints load into the sharded engines, so they are read after setup built them."""
        return True

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        assert self.engine is not None
        return self.engine.model_state()

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        assert self.engine is not None
        return self.engine.optimizer_state(getattr(optimizer, "_optimizer", optimizer))

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Optional[Any] = None
    ) -> None:
        """Sharded (a directory, every rank writes its pieces) or full (one file on rank 0), as ``state_dict_type``
        says."""
        if storage_options is not None:  # as Lightning's fsdp and deepspeed strategies
            raise TypeError(STORAGE_OPTIONS_ERROR)
        assert self.engine is not None
        self.engine.save_checkpoint(checkpoint, Path(filepath), writer="trainer")
        self.last_checkpoint = Path(filepath)

    @override
    def remove_checkpoint(self, filepath: _PATH) -> None:
        if self.is_global_zero:
            self.checkpoint_io.remove_checkpoint(filepath)  # removes directories too

    @override
    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: Optional[bool] = None) -> dict[str, Any]:
        """A file is read whole (``ddp``'s form); a directory gives its ``meta.pt`` after every file was checked,
        and the tensors are read later, straight into this rank's shards. Only data is unpickled unless
        ``weights_only=False`` (see [Note: a checkpoint is data, never code] in ``checkpoints/trust.py``)."""
        # see [Note: the Trainer's weights_only reaches a strategy that restores after setup] in early_checks.py
        trusted = weights_only is False or (
            weights_only is None and early_checks.requested_trust(self.lightning_module)
        )
        if Path(checkpoint_path).is_file() or "://" in str(checkpoint_path):
            return super().load_checkpoint(checkpoint_path, False if trusted else weights_only)
        meta = engine_state.read(Path(checkpoint_path), trusted=trusted)
        writer = meta[KEY].get("writer")
        if writer in ("fabric", "engine"):
            # Fabric's and a plain loop's loop state is the user's own entries: the Trainer's loops start afresh,
            # with no schedulers, from the step counter a plain loop recorded (see [Note: a plain loop's step])
            meta.setdefault("lr_schedulers", [])
            meta.setdefault("pytorch-lightning_version", lightning.__version__)
            assert self.lightning_module is not None
            trainer = self.lightning_module.trainer
            if writer == "engine" and "loops" not in meta and trainer.state.fn == "fit":
                meta["loops"] = {"fit_loop": _fit_loop_at_step(trainer, int(meta.get("global_step") or 0))}
        return meta

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        assert self.engine is not None
        self.engine.load_model_state(checkpoint, strict)

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        assert self.engine is not None
        self.engine.load_optimizer_states(checkpoint)

    # ------------------------------------------------------------------ stopping and teardown
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
        """Lightning calls this when a run stops on an exception or Ctrl-C, just before ``teardown``."""
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
        failure, self._failure = self._failure, None
        self._release_signals(failure)

    # ------------------------------------------------------------------ collectives for Lightning
    @override
    def reduce(
        self, tensor: Union[Tensor, Any], group: Optional[Any] = None, reduce_op: Optional[Union[Any, str]] = "mean"
    ) -> Union[Tensor, Any]:
        return self._reduce_tensor(tensor, group, reduce_op)


def _fit_loop_at_step(trainer: "pl.Trainer", global_step: int) -> dict[str, Any]:
    """The state of a fresh fit loop whose optimizer steps stand at ``global_step``.

    [Note: a plain loop's step]
    A ``ZeroEngine`` checkpoint records ``global_step`` (its optimizer steps) but no loop state: the Trainer resumes
    it with that step count (``trainer.global_step``, ``max_steps`` and the loggers' step go on from it), at the start
    of an epoch, its data from the beginning. The step counter lives in the optimizer progress of the automatic or
    manual optimization loop, whichever the module uses; both are set.
    """
    state = trainer.fit_loop.state_dict()
    steps = {"ready": global_step, "completed": global_step}
    automatic = state["epoch_loop.automatic_optimization.optim_progress"]["optimizer"]["step"]
    manual = state["epoch_loop.manual_optimization.optim_step_progress"]
    for progress in (automatic, manual):
        progress["total"].update(steps)
    state["epoch_loop.state_dict"]["_batches_that_stepped"] = global_step
    return state
