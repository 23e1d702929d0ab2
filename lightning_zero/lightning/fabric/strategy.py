"""``ZeroFabricStrategy``: ZeRO under Lightning Fabric (``Fabric(strategy="zero1" | "zero2" | "zero3")``).

A thin adapter over ``ZeroEngine``: ``fabric.setup`` makes the engine,
``fabric.backward`` and ``optimizer.step()`` are the engine's, ``fabric.save`` / ``fabric.load`` write and read the
Trainer's checkpoint format (see [Note: one checkpoint format for every way in] in ``engine/state.py``), and
``fabric.init_module()`` under zero3 builds the model sharded, as the Trainer's ``configure_model`` does. Each
``fabric.setup`` gives its own engine (several models: see [Note: several models in one checkpoint] in
``several.py``).

[Note: the Fabric state dict in the Trainer's format]
``fabric.save(path, {"model": model, "optimizer": opt, "step": 7})`` writes the module under ``state_dict`` and the
optimizers under ``optimizer_states`` in the engine's order; every other entry is stored as itself (objects with a
``state_dict`` as their state dict). ``fabric.load`` restores the module and the optimizers it is given from those two
keys (the engine knows their order) and the other entries by name. A Trainer checkpoint loads the same way (its
``epoch``, ``global_step``, ``loops``... come back as the remainder), and a Fabric checkpoint resumes under the Trainer.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Literal, Optional, Union

import torch
from lightning.fabric.accelerators import Accelerator
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.plugins.precision import Precision
from lightning.fabric.strategies.launchers import _MultiProcessingLauncher, _SubprocessScriptLauncher
from lightning.fabric.strategies.parallel import ParallelStrategy
from lightning.fabric.strategies.strategy import _BackwardSyncControl, _Sharded
from lightning.fabric.utilities.types import _PATH, _Stateful
from torch import Tensor
from torch.nn import Module
from torch.optim import Optimizer
from typing_extensions import override

from lightning_zero.checkpoints.consolidate import load_full_checkpoint
from lightning_zero.config import ZeroConfig, check_option_names
from lightning_zero.engine import state as engine_state
from lightning_zero.engine.construction import place_module
from lightning_zero.engine.engine import ZeroEngine
from lightning_zero.engine.state import STORAGE_OPTIONS_ERROR
from lightning_zero.lightning.fabric import plain, resetup, several
from lightning_zero.lightning.fabric.precision import ZeroFabricPrecision, to_fabric_precision
from lightning_zero.lightning.fabric.several import MODELS_KEY, EngineGroup
from lightning_zero.lightning.processes import StartMethod, ZeroProcesses

#: The loss scaler's state, under the key the Trainer gives its precision plugin's state (``ZeroPrecision``).
PRECISION_KEY = "ZeroPrecision"


class _ZeroBackwardSyncControl(_BackwardSyncControl):
    """``fabric.no_backward_sync``: the engine of the module holds its gradients for a later step (stage 1: one
    reduce-scatter per step; stages 2 and 3 reduce every backward into their gradient shard anyway, which is what
    keeps a rank's gradients at 1/N)."""

    def __init__(self, strategy: ZeroFabricStrategy) -> None:
        self._strategy = strategy

    @override
    def no_backward_sync(self, module: Module, enabled: bool) -> AbstractContextManager:
        return several.engine_of_module(self._strategy.engines, module).no_backward_sync(enabled)


class ZeroFabricStrategy(ZeroProcesses, ParallelStrategy, _Sharded):
    """ZeRO under Lightning Fabric: ``Fabric(strategy="zero2")``, or ``Fabric(strategy=ZeroFabricStrategy(...))``.

    Args:
        stage: 1 partitions optimizer states (and fp32 master weights), 2 also gradients, 3 also parameters.
        process_group_backend: ``"gloo"`` or ``"nccl"``; default from the device.
        timeout: the process group's timeout, in seconds or as a ``timedelta``.
        start_method: ``"popen"`` (Fabric's script launcher) or ``"spawn"``/``"fork"``/``"forkserver"``.
        **options: ``ZeroConfig``'s fields, see ``docs/options.md``.
    """

    def __init__(
        self,
        stage: Literal[1, 2, 3] = 2,
        accelerator: Optional[Accelerator] = None,
        parallel_devices: Optional[list[torch.device]] = None,
        cluster_environment: Optional[ClusterEnvironment] = None,
        checkpoint_io: Optional[CheckpointIO] = None,
        precision: Optional[Precision] = None,
        process_group_backend: Optional[str] = None,
        timeout: Optional[Union[float, timedelta]] = default_pg_timeout,
        start_method: StartMethod = "popen",
        **options: Any,
    ) -> None:
        check_option_names(options)
        ZeroProcesses.__init__(self, ZeroConfig(stage=stage, **options), process_group_backend, timeout, start_method)
        ParallelStrategy.__init__(
            self,
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision=precision,
        )
        self._num_nodes = 1
        self._backward_sync_control = _ZeroBackwardSyncControl(self)
        self.engines: list[ZeroEngine] = []
        """One engine per ``fabric.setup`` / ``setup_module``, in setup order, over the same process groups (see
        [Note: several models in one checkpoint] in ``several.py``); ``engine`` is the last."""

    # ------------------------------------------------------------------ properties
    @property
    @override
    def precision(self) -> ZeroFabricPrecision:
        if self._precision is None:
            self._precision = ZeroFabricPrecision("32-true")
        return self._precision  # type: ignore[return-value]

    @precision.setter
    def precision(self, precision: Optional[Precision]) -> None:
        device_type = "cuda" if torch.cuda.is_available() else "cpu"
        self._precision = None if precision is None else to_fabric_precision(precision, device_type)

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._num_nodes = num_nodes

    # ------------------------------------------------------------------ processes
    @override
    def _configure_launcher(self) -> None:
        self._launcher = self._make_launcher(_SubprocessScriptLauncher, _MultiProcessingLauncher)

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        self._start_distributed()
        self.precision.device_type = self.root_device.type

    # ------------------------------------------------------------------ setup
    @override
    def setup_module_and_optimizers(
        self, module: Module, optimizers: list[Optimizer], scheduler: Optional[Any] = None
    ) -> tuple[Module, list[Optimizer], Optional[Any]]:
        self._make_engine(module, optimizers)
        return module, optimizers, scheduler

    @override
    def setup_module(self, module: Module) -> Module:
        self._make_engine(module, [])
        return module

    @override
    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        if self.engine is None:
            raise RuntimeError(
                "Set up the model first: `model = fabric.setup_module(model)`, then create the "
                "optimizer from its parameters and call `fabric.setup_optimizers(optimizer)`."
            )
        several.engine_of_params(self.engines, optimizer).add_optimizers([optimizer])
        return optimizer

    def _make_engine(self, module: Module, optimizers: list[Optimizer]) -> None:
        recording = self._init_module.take(module)
        resetup.release_held(self.engines, module, optimizers)  # see [Note: setting up a model again]
        states = resetup.states_of(optimizers)
        self.engine = ZeroEngine(
            module,
            optimizers,
            precision=self.precision.mode,
            device=self.root_device,
            config=self.config,
            recording=recording,
            shard_groups=self.shard_groups,
        )
        resetup.load_states(self.engine, states)
        self.engines.append(self.engine)

    @override
    def module_to_device(self, module: Module) -> None:
        self._init_module.stop()  # Fabric's setup calls this first
        place_module(module, self.root_device, self.policy.shards_params)

    @override
    def module_init_context(self, empty_init: Optional[bool] = None) -> AbstractContextManager:
        """Under zero3 the model is built on the meta device and its construction recorded; setup replays it one unit
        at a time, so no rank holds it whole and the values are those of eager construction, initialized also under
        ``empty_init=True`` (see [Note: empty_init under zero3] in ``engine/construction.py``). Stages 1 and 2 build
        on the device; ``empty_init=True`` skips the initializers there, as ``ddp`` and ``deepspeed`` do."""
        if not self.policy.shards_params:
            return super().module_init_context(empty_init)
        return self._init_module.context(self.root_device, self.precision.module_init_context(), bool(empty_init))

    @override
    def module_sharded_context(self) -> AbstractContextManager:
        return self.module_init_context(empty_init=False)

    # ------------------------------------------------------------------ the step
    @override
    def backward(self, tensor: Tensor, module: Optional[Module], *args: Any, **kwargs: Any) -> None:
        """The engine's backward; with several models the loss may flow through any of them (a GAN's generator loss
        through the discriminator), so every engine finishes its backward after it. A model whose forward graph is
        still pending (the generator's, while the discriminator steps on ``fake.detach()``) is gathered again when
        its own backward comes (see [Note: backward finds every unit gathered, the root too] in
        ``stage3/units.py``)."""
        engine = self._engine()
        if len(self.engines) == 1:
            engine.backward(tensor, *args, **kwargs)
            return
        engine.precision.scale_loss(tensor).backward(*args, **kwargs)
        for each in self.engines:
            each.finish_backward()

    @override
    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        """The engine's step (reduce, unscale, step, gather); a ``closure`` runs first, as ``optimizer.step`` would."""
        closure: Optional[Callable[[], Any]] = kwargs.pop("closure", None)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        output = several.engine_of_optimizer(self.engines, optimizer).step(optimizer, zero_grad=False, **kwargs)
        return loss if closure is not None else output

    @override
    def clip_gradients_norm(
        self,
        module: Module,
        optimizer: Optimizer,
        max_norm: Union[float, int],
        norm_type: Union[float, int] = 2.0,
        error_if_nonfinite: bool = True,
    ) -> Tensor:
        engine = several.engine_of_optimizer(self.engines, optimizer)
        norm = engine.clip_grad_norm(float(max_norm), optimizer, float(norm_type), error_if_nonfinite)
        return norm.reshape(())  # a scalar, as under the other strategies

    @override
    def clip_gradients_value(self, module: Module, optimizer: Optimizer, clip_val: Union[float, int]) -> None:
        several.engine_of_optimizer(self.engines, optimizer).clip_grad_value(float(clip_val), optimizer)

    def _engine(self) -> ZeroEngine:
        if self.engine is None:
            raise RuntimeError("Set up the model with `fabric.setup(model, optimizer)` first.")
        return self.engine

    # ------------------------------------------------------------------ collectives
    @override
    def all_reduce(
        self, tensor: Tensor, group: Optional[Any] = None, reduce_op: Optional[Union[Any, str]] = "mean"
    ) -> Tensor:
        return self._reduce_tensor(tensor, group, reduce_op)

    # ------------------------------------------------------------------ checkpoints
    @override
    def save_checkpoint(
        self,
        path: _PATH,
        state: dict[str, Any],
        storage_options: Optional[Any] = None,
        filter: Optional[dict[str, Callable[[str, Any], bool]]] = None,
    ) -> None:
        """See [Note: the Fabric state dict in the Trainer's format]; a state whose models are not set up is saved as
        ``ddp`` saves it (see [Note: saving and loading a model that is not set up] in ``plain.py``)."""
        if not self._holds_set_up_model(state):
            super().save_checkpoint(path, state, storage_options, filter)
            return
        if storage_options is not None:
            raise TypeError(STORAGE_OPTIONS_ERROR)
        if filter:
            raise ValueError(
                "ZeroFabricStrategy saves whole model and optimizer states (a checkpoint must resume at "
                "any world size and stage): remove `filter=` from `fabric.save`."
            )
        engine = self._engine_of(state)
        optimizers = [obj for obj in state.values() if isinstance(obj, Optimizer)]
        checkpoint = {
            key: obj.state_dict() if isinstance(obj, _Stateful) else obj
            for key, obj in state.items()
            if not isinstance(obj, (Module, Optimizer))
        }
        if isinstance(engine, EngineGroup):
            checkpoint[MODELS_KEY] = list(engine.module.keys())
        checkpoint.update(engine.checkpoint_entries(optimizers))
        checkpoint[PRECISION_KEY] = self.precision.state_dict()
        engine.save_checkpoint(checkpoint, Path(path), writer="fabric")

    @override
    def load_checkpoint(
        self,
        path: _PATH,
        state: Optional[Union[Module, Optimizer, dict[str, Any]]] = None,
        strict: bool = True,
        weights_only: Optional[bool] = None,
    ) -> dict[str, Any]:
        """Restore ``state`` in place from a checkpoint of any writer (Fabric, Trainer, full file); the rest of the
        checkpoint is returned. A bare module or optimizer (``fabric.load_raw``) takes a raw state dict file too.
        Only data is unpickled unless ``weights_only=False`` (see [Note: a checkpoint is data, never code] in
        ``checkpoints/trust.py``)."""
        path = Path(path)
        trusted = weights_only is False
        if not state:
            if path.is_dir():
                return load_full_checkpoint(path, trust_code=trusted)
            return self.checkpoint_io.load_checkpoint(path, weights_only=weights_only)
        if isinstance(state, (Module, Optimizer)) and not self._holds_set_up_model({"state": state}):
            return super().load_checkpoint(path, state, strict, weights_only)
        if isinstance(state, dict) and not self._holds_set_up_model(state):
            return plain.load_into_plain_models(
                plain.read_for_plain_models(path, self.checkpoint_io, weights_only), state, strict
            )
        checkpoint = engine_state.read(path, trusted)
        if isinstance(state, Module):
            several.engine_of_module(self.engines, state).load_model_state(checkpoint, strict)
            return {}
        if isinstance(state, Optimizer):
            several.engine_of_optimizer(self.engines, state).load_optimizer_state(state, checkpoint)
            return {}
        engine = self._engine_of(state)
        checkpoint = plain.as_engine_checkpoint(checkpoint, state)
        saved_models = checkpoint.get(MODELS_KEY)
        models = list(engine.module.keys()) if isinstance(engine, EngineGroup) else None
        if saved_models != models:
            raise ValueError(
                f"The checkpoint {path} holds the model(s) {saved_models or 'of one model'} and the "
                f"state passed to `fabric.load` has {models or 'one model'}: pass the models (and their "
                "optimizers) under the keys they were saved with."
            )
        return self._restore(engine, checkpoint, state, strict)

    def _holds_set_up_model(self, state: dict[str, Any]) -> bool:
        """Whether a model (or optimizer) of ``state`` was set up by this strategy."""
        return any(
            engine.module is obj or (isinstance(obj, Optimizer) and several.owns(engine, obj))
            for engine in self.engines
            for obj in state.values()
        )

    def _engine_of(self, state: dict[str, Any]) -> Any:
        """The engine of the one model in ``state``, or an ``EngineGroup`` of its several models (see [Note:
        several models in one checkpoint] in ``several.py``)."""
        named = {
            key: several.engine_of_module(self.engines, obj) for key, obj in state.items() if isinstance(obj, Module)
        }
        if len(named) == 1:
            return next(iter(named.values()))
        return EngineGroup(named)

    def _restore(self, engine: Any, checkpoint: dict[str, Any], state: dict[str, Any], strict: bool) -> dict[str, Any]:
        modules = [key for key, obj in state.items() if isinstance(obj, Module)]
        optimizers = [key for key, obj in state.items() if isinstance(obj, Optimizer)]
        if optimizers and len(optimizers) != len(engine.optimizers):
            raise ValueError(
                f"`fabric.load` got {len(optimizers)} of the model's {len(engine.optimizers)} "
                "optimizers: pass all of them (or none)."
            )
        others = [key for key in state if key not in modules and key not in optimizers]
        missing = [key for key in others if key not in checkpoint]
        if strict and missing:
            raise KeyError(
                f"The requested state contains keys that are not present in the checkpoint: {missing}. "
                "Pass `strict=False` to load what is there."
            )
        if modules:
            engine.load_model_state(checkpoint, strict)
        if optimizers:
            engine.load_optimizer_states(checkpoint)
        self.precision.load_state_dict(checkpoint.get(PRECISION_KEY, {}))
        for key in others:
            if key in checkpoint:
                obj = state[key]
                if isinstance(obj, _Stateful):
                    obj.load_state_dict(checkpoint[key])
                else:
                    state[key] = checkpoint[key]
        used = set(engine_state.INTERNAL_KEYS) | set(others) | {PRECISION_KEY, MODELS_KEY}
        return {key: value for key, value in checkpoint.items() if key not in used}

    # ------------------------------------------------------------------ teardown and registration
    @override
    def teardown(self) -> None:
        self._init_module.stop()  # a model built under init_module and never set up: stop recording it
        for engine in self.engines:
            engine.teardown(gather=True)
        super().teardown()

    @override
    def gathered_parameters(self) -> AbstractContextManager:
        """Every parameter of every set-up model whole inside, on every rank (a collective); see
        ``ZeroEngine.gathered_parameters``."""
        if not self.engines:
            raise RuntimeError("`gathered_parameters()` needs the model set up: use it after `fabric.setup`.")
        return several.all_gathered(self.engines)
