"""``ZeroEngine``: ZeRO on one module and its optimizers, and one training step in one place, without Lightning.

The Trainer's ``ZeroStrategy`` and Fabric's ``ZeroFabricStrategy`` are
adapters over it; a plain PyTorch loop with ``torch.distributed`` initialized uses it directly::

    engine = ZeroEngine(model, [optimizer], stage=2, precision="bf16-mixed")
    for x, y in loader:
        with engine.forward_context():
            loss = loss_fn(model(x), y)
        engine.backward(loss)
        engine.step(clip_grad_norm=1.0)  # reduce, unscale, clip, step, gather, zero_grad
    engine.save_checkpoint(engine.checkpoint_entries(), path)

The whole public surface is this one class: setup, the step (see [Note: the order of one optimizer step] at
``ZeroEngine.step``), the checkpoints and the reports. The code below it takes what it needs explicitly: the
checkpoint format (``state.py``) and the module's own state dict methods (``module_state.py``) each name the few
attributes they read in a ``Protocol``, the summary (``summary.py``) takes its numbers as arguments; none of them
imports this file.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import Any, Callable, Optional, Union, cast

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_zero.activations.checkpointing import ActivationCheckpointing, activations_from_policy
from lightning_zero.comm import collectives
from lightning_zero.comm.groups import ShardGroups
from lightning_zero.config import ZeroConfig, check_option_names
from lightning_zero.engine import module_state, simulated, state
from lightning_zero.engine.amp import (
    PrecisionMode,
    clip_grad_norm,
    clip_grad_value,
    global_grad_norm,
    parameter_grad_norms,
)
from lightning_zero.engine.policies import group_sizes, policies_of
from lightning_zero.engine.summary import model_state_summary
from lightning_zero.memory import costs
from lightning_zero.memory.account import EngineMemory, MemoryLedger
from lightning_zero.memory.host_memory import give_back_free_heap
from lightning_zero.pretrained import loading as pretrained
from lightning_zero.shards import disk
from lightning_zero.shards.accounting import measure_model_states
from lightning_zero.shards.flat import FlatStorage
from lightning_zero.shards.offload import fused_hint
from lightning_zero.shards.optimizer import ShardedOptimizer
from lightning_zero.shards.optimizer_support import check_not_dtensor
from lightning_zero.shards.sharing import whole_params_per_optimizer
from lightning_zero.shards.store import ParameterStore, ShardedStorage
from lightning_zero.stage3 import guard
from lightning_zero.stage3.construction import Recording
from lightning_zero.stage3.materialize import (
    broadcast_module_states,
    drop_meta,
    move_materialized,
    shard_by_units,
    warn_if_built_in_full,
)
from lightning_zero.stage3.partitioned import PartitionedStorage, move_units
from lightning_zero.stage3.plan import UnitPlan
from lightning_zero.stage3.units import UnitRuntime, warn_if_units_compiled_inside
from lightning_zero.tensor_parallel import count_tensor_parallel, warn_if_nothing_is_sliced


class ZeroEngine:
    """Installs ZeRO on ``module`` and the user's ``optimizers`` and runs their steps.

    Args:
        module: the model. Under stage 3 it may have been built under ``sharded_construction`` (pass the
            recording as ``recording``), so that no rank ever holds it whole.
        optimizers: the user's optimizers over ``module``'s parameters (their objects, classes and hyperparameters
            stay theirs). None: evaluation only (stage 3 then still shards the weights).
        precision: ``"32-true"``, ``"bf16-mixed"``, ``"16-mixed"`` or ``"bf16-true"``, or a ``PrecisionMode``.
        device: this rank's device (default: the current CUDA device, else the CPU).
        config: the options as a ``ZeroConfig``, or give them as keyword arguments instead
            (``stage=3, offload_optimizer=True``, ...).
        recording: stage 3: the construction recorded by ``sharded_construction``, replayed unit by unit.
        shard_groups: the groups to shard over and replicate across (default: made from ``shard_group_size`` and
            ``tensor_parallel_size``, or plain ZeRO over every rank; see [Note: hybrid sharding and its traffic] and
            [Note: ZeRO over the data dimension] in ``groups.py``). With tensor parallelism, build the module over the
            mesh of ``make_device_mesh``; the engine finds the same mesh (it is
            made once per job).
    """

    def __init__(
        self,
        module: nn.Module,
        optimizers: Sequence[Optimizer] = (),
        *,
        precision: Union[str, PrecisionMode] = "32-true",
        device: Optional[torch.device] = None,
        config: Optional[ZeroConfig] = None,
        recording: Optional[Recording] = None,
        shard_groups: Optional[ShardGroups] = None,
        **options: Any,
    ) -> None:
        if config is not None and options:
            raise TypeError(
                f"Give the options either as `config=ZeroConfig(...)` or as keyword arguments, not both "
                f"(got config and {sorted(options)})."
            )
        check_option_names(options)
        self.config = config if config is not None else ZeroConfig(**options)
        """The options (with a simulated rank's checks across ranks turned off, see ``simulated.py``)."""
        if simulated.simulated():  # see [Note: one rank of a simulated world] in simulated.py
            self.config = simulated.stand_aside(self.config)
        # what each component reads of the options (see [Note: one policy per component] in policies.py)
        self.policies = policies_of(self.config)
        self.policy = self.policies.stage  # what the stage partitions (see stages.py)
        self.precision = precision if isinstance(precision, PrecisionMode) else PrecisionMode(precision)
        """The precision mode: autocast, the loss scaler of ``16-mixed``, the working and master dtypes."""
        self.device = device if device is not None else _default_device()
        """This rank's device."""
        if recording is not None:
            recording.keep(module)  # before the precision converts the module (see [Note: record and replay])
        self.module = self.precision.convert_module(module)
        """The model, its parameters managed by the engine from the end of setup to ``teardown``."""
        if shard_groups is None:
            world = collectives.world_size()  # one node of every rank: "node" is then the world
            shard_groups = group_sizes(self.config, world, world, 1).make(self.device.type)
        self.shard_groups = shard_groups
        """The groups the states are sharded over and replicated across, and their ``traffic``."""
        # where the managed parameters live, with or without optimizers (see [Note: the store and the optimizers])
        self.store = ParameterStore()
        self.optimizers: list[ShardedOptimizer] = []
        """One ``ShardedOptimizer`` per user optimizer, in their order (none for evaluation)."""
        # stage 3: the units' gathers and releases (None at stages 1 and 2, and after teardown)
        self.runtime: Optional[UnitRuntime] = None
        self.activations: Optional[ActivationCheckpointing] = None  # activation checkpointing, when asked for
        self.unit_plan = UnitPlan()  # stage 3's units (one, the root, at stages 1 and 2)
        self.torn_down = False  # set by the first teardown; the state dict hooks stand aside after it
        self.skipped_steps = 0
        """Optimizer steps skipped because their gradients were not finite (``nonfinite="skip"``)."""
        self.completed_steps = 0
        """Optimizer steps run (or skipped) since setup; the Trainer sets it to its ``global_step``."""
        self.memory = MemoryLedger(self.memory_parts, enabled=self.device.type == "cpu")
        """Readings of this rank's host memory at the highest points of its steps (see [Note: the account of a rank's
        memory] in ``memory/account.py``)."""
        self._root_hook: Optional[Any] = None  # stage 3: the module's forward pre-hook that gathers the root unit
        self._state_hooks: list[Any] = []  # the handles of module_state.attach's hooks
        self._costs_mark: dict[str, int] = {}  # the counters at the last step_costs()
        self._step_norms: dict[int, Tensor] = {}  # clipping's global norm, per optimizer, until its step
        self._heap_given_back = 0  # trims of the host heap done: after setup, after the first step
        # a disk fault at setup is raised by every rank at the end of it (see [Note: faults are agreed on every rank])
        with disk.agreed_faults(self.shard_groups.world, self.policies.offload.on_disk):
            self._setup(list(optimizers), recording)
        self.memory.note("the end of setup")
        self._give_back_heap_once()
        self.step_costs()  # counts from the end of setup on

    # ------------------------------------------------------------------ setup
    def _setup(self, optimizers: list[Optimizer], recording: Optional[Recording]) -> None:
        for name, param in self.module.named_parameters():  # before any collective
            check_not_dtensor(param, name)
        if self.shard_groups.tensor is not None:
            warn_if_nothing_is_sliced(self.module, self.shard_groups.tensor_size)
            count_tensor_parallel(self.module, self.shard_groups.tensor)
        self.activations = activations_from_policy(self.module, self.policies.activations, self.shard_groups.tensor)
        if self.policy.shards_params:
            self._setup_sharded_params(optimizers, recording)
        else:
            self.module.to(self.device)
            broadcast_module_states(self.module, self.shard_groups)
            self._add_optimizers(optimizers)
        pretrained.attach(self.module, self)  # `load_pretrained` after setup writes into the shards
        self._state_hooks = module_state.attach(self)  # `model.state_dict()` / `load_state_dict` after setup

    def _setup_sharded_params(self, optimizers: list[Optimizer], recording: Optional[Recording]) -> None:
        """Stage 3: plan the units, make the store's storages (laid out for the optimizers, or one for evaluation),
        then shard the model unit by unit."""
        warn_if_built_in_full(self.module)
        move_materialized(self.module, self.device)
        self.unit_plan = self.policies.units.plan(self.module)
        if optimizers:
            self._add_optimizers(optimizers)
        elif any(p.requires_grad for p in self.module.parameters()):
            # evaluation: the store alone holds the weights, as one group of flat slices (see [Note: the store and
            # the optimizers] in store.py)
            trainable: list[Tensor] = [p for p in self.module.parameters() if p.requires_grad]
            whole = bool(self.policies.optimizer.partition_whole_params)
            self.store.add(self._make_storage(trainable, [0] * len(trainable), whole))
        shard_by_units(self.module, self.unit_plan, self._partitioned_storages, self.device, recording)
        guard.name_parameters(
            self.module, {key: self.unit_plan.names[unit] for key, unit in self.store.param_units().items()}
        )
        self.runtime = self._unit_runtime()
        # never traced: a compiled module's root gather runs eagerly (see [Note: units and torch.compile] in
        # stage3/plan.py)
        self._root_hook = self.module.register_forward_pre_hook(torch.compiler.disable(lambda *_: self.begin_step()))
        warn_if_units_compiled_inside(self.module, self.unit_plan)
        pretrained.fill_pending(self.module, self.store.storages, self.runtime)  # loads recorded at construction

    def add_optimizers(self, optimizers: Sequence[Optimizer]) -> None:
        """Take optimizers made after the engine (Fabric's ``setup_module`` then ``setup_optimizers``).

        Stages 1 and 2 lay them out over the parameters as they are. Stage 3's weights are then held by the store's
        evaluation storage: they move into storages laid out for the new optimizers one unit at a time (gathered,
        filled into the new shards, freed), so no rank holds more than one unit in full (see [Note: the store and
        the optimizers] in ``store.py``).
        """
        if not self.policy.shards_params:
            self._add_optimizers(list(optimizers))
            return
        if self.optimizers or len(self.store.storages) != 1:
            raise RuntimeError(
                "Under stage 3 the optimizers are set up together, once: pass all of them to "
                "`fabric.setup_optimizers(...)` (or `fabric.setup(model, *optimizers)`) in one call."
            )
        assert self.runtime is not None
        self.runtime.reshard_all(include_root=True)
        self.runtime.remove()
        source = self.store.storages[0]
        assert isinstance(source, PartitionedStorage)
        self.store = ParameterStore()
        self._add_optimizers(list(optimizers))
        targets = [storage for storage in self.store.storages if isinstance(storage, PartitionedStorage)]
        move_units(source, targets, self.unit_plan.names)
        source.remove_hooks()
        for storage in self.store.storages:
            storage.install_grad_hooks()
        self.runtime = self._unit_runtime()

    def _unit_runtime(self) -> UnitRuntime:
        """Stage 3's runtime over the store's storages as they are now."""
        units = self.policies.units
        return UnitRuntime(
            self.unit_plan, self._partitioned_storages, units.prefetch_size, units.lockstep_check, model=self.module
        )

    def _add_optimizers(self, optimizers: list[Optimizer]) -> None:
        # several optimizers may hold the same parameter: see [Note: parameters shared by several optimizers]
        for optimizer, whole_params in zip(optimizers, whole_params_per_optimizer(optimizers, self.policies.optimizer)):
            self.optimizers.append(self._make_sharded(optimizer, whole_params))
            hint = fused_hint(optimizer) if self.policies.offload.offload_optimizer else None
            if hint and collectives.rank() == 0:
                warnings.warn(hint, UserWarning, stacklevel=4)

    def _make_sharded(self, optimizer: Optimizer, whole_params: Optional[bool] = None) -> ShardedOptimizer:
        """ZeRO on ``optimizer``: its own parameters get a storage in the store, laid out for it; those the store
        already holds (an earlier optimizer's) are borrowed."""

        def make_storage(params: list[Tensor], param_groups: list[int], whole: bool) -> ShardedStorage:
            return self.store.add(self._make_storage(params, param_groups, whole))

        return ShardedOptimizer(
            optimizer,
            self.policies.optimizer,
            make_storage,
            lenders=list(self.store.storages),
            module=self.module,
            whole_params=whole_params,
        )

    @property
    def _partitioned_storages(self) -> list[PartitionedStorage]:
        """The store's storages under stage 3, where ``_make_storage`` makes every one partitioned (the list
        itself, not a copy: the unit runtime reads the store's list)."""
        return cast(list[PartitionedStorage], self.store.storages)

    def _make_storage(self, params: list[Tensor], param_groups: list[int], whole_params: bool) -> ShardedStorage:
        """The storage of ``params`` for this stage (stages 1 and 2: a flat buffer; stage 3: shards and units)."""
        unit_of = self.unit_plan.unit if self.policy.shards_params else None
        kind = PartitionedStorage if self.policy.shards_params else FlatStorage
        storage = kind(
            params,
            param_groups,
            whole_params,
            self.policy,
            self.policies.store,
            self.precision.working_dtype,
            self.precision.master_dtype,
            self.device,
            module=self.module,
            unit_of=unit_of,
            groups=self.shard_groups,
            unit_names=self.unit_plan.names,
        )
        if self.policy.grad_hooks_at_setup:
            storage.install_grad_hooks()
        storage.reducer.ledger = self.memory
        return storage

    # ------------------------------------------------------------------ forward and backward
    def forward_context(self) -> AbstractContextManager:
        """Autocast for the mixed precisions (the Trainer and Fabric enter it for you)."""
        return self.precision.forward_context(self.device.type)

    def begin_step(self) -> None:
        """Stage 3: gather the root unit (the module's own and shared parameters) for the step; the module's forward
        does it too, so only code that reads those parameters before any forward needs to call it."""
        if self.runtime is not None:
            self.runtime.unshard(self.runtime.root)

    def backward(self, loss: Tensor, *args: Any, **kwargs: Any) -> None:
        """``loss.backward()`` (scaled under ``16-mixed``), then ``finish_backward``."""
        self.precision.scale_loss(loss).backward(*args, **kwargs)
        self.finish_backward()

    @contextmanager
    def no_backward_sync(self, enabled: bool = True) -> Iterator[None]:
        """Backwards inside accumulate gradients for a later step (as DDP's ``no_sync``): stage 1 keeps them in
        ``.grad`` and reduces them once, in the backward after the context (see [Note: stage 1 reduces in the
        backward the step follows] in ``shards/store.py``); stages 2 and 3 reduce every backward into their gradient
        shard anyway. Every rank enters it for the same backwards. Lightning and Fabric enter it for you
        (``accumulate_grad_batches``, ``fabric.no_backward_sync``)."""
        if not enabled:
            yield
            return
        self.store.hold_grads(True)
        try:
            yield
        finally:
            self.store.hold_grads(False)

    def finish_backward(self, include_root: bool = True) -> None:
        """After one backward: stages 2 and 3 launch the partly filled buckets and wait for them; stage 3 frees the
        units still gathered (with ``include_root`` the root too: a step that runs more forwards before its
        ``optimizer.step``, as manual optimization may, passes ``False`` and calls ``end_step``)."""
        self.memory.note("the end of a backward")
        self.store.finish_backward()
        if self.runtime is not None:
            self.runtime.end_backward(include_root=include_root)

    @contextmanager
    def gathered_parameters(self) -> Iterator[None]:
        """Every parameter whole inside, on every rank: a collective (every rank enters), for code that reads the
        weights between steps (an EMA copy, logging norms). Stage 3 gathers every unit (the whole model in memory,
        as DeepSpeed's ``GatheredParameters`` and FSDP's ``summon_full_params``) and frees what it gathered after;
        stages 1 and 2 hold them whole anyway. The values are the working parameters (bf16/fp16 under mixed
        precision; the fp32 masters are in the checkpoints). Read-only: what is written into them is not kept."""
        if self.runtime is None:
            yield
            return
        with self.runtime.all_gathered():
            yield

    def end_step(self) -> None:
        """Stage 3: free everything gathered, the root too (after an evaluation or manual-optimization step)."""
        if self.runtime is not None:
            self.runtime.end_step()

    # ------------------------------------------------------------------ the optimizer step
    def _give_back_heap_once(self) -> None:
        """After setup and after the first optimizer step, on a CPU: one trim of the host heap (see [Note: the engine
        gives back what its setup left behind] in ``memory/host_memory.py``); nothing at any later step."""
        if self._heap_given_back < 2:
            self._heap_given_back += 1
            if self.device.type == "cpu":
                give_back_free_heap()

    def sharded(self, optimizer: Optional[Optimizer] = None) -> ShardedOptimizer:
        """The shards of ``optimizer`` (the only one when ``None``)."""
        if optimizer is None:
            if len(self.optimizers) != 1:
                raise ValueError(
                    f"This engine has {len(self.optimizers)} optimizers: name the one to step, clip or "
                    "zero (`engine.step(optimizer)`)."
                )
            return self.optimizers[0]
        # the optimizer itself, or the one inside Lightning's or Fabric's wrapper (both keep it as `_optimizer`)
        for candidate in (optimizer, getattr(optimizer, "_optimizer", None)):
            for sharded in self.optimizers:
                if sharded.optimizer is candidate:
                    return sharded
        raise ValueError(
            f"{type(optimizer).__name__} was not set up by this ZeRO engine: pass the optimizers to "
            "`ZeroEngine(module, [optimizer, ...])` (the Trainer: return them from `configure_optimizers`;"
            " Fabric: `fabric.setup(model, optimizer)`)."
        )

    def reduce(self, optimizer: Optional[Optimizer] = None) -> bool:
        """Step 1 of [Note: the order of one optimizer step]: the optimizer's gradients reduced (``REDUCED``, see
        [Note: the phases of one optimizer step]); returns whether the ``16-mixed`` loss scaler found an overflow
        (the step is then skipped on every rank). Reduces nothing when already ``REDUCED``."""
        scaler = self.precision.scaler
        sharded = self.sharded(optimizer)
        world = self.shard_groups.world
        unscale = (lambda grads: scaler.unscale_and_check(grads, self.device, world)) if scaler is not None else None
        return sharded.reduce(unscale)

    def clip_grad_norm(
        self,
        max_norm: float,
        optimizer: Optional[Optimizer] = None,
        norm_type: float = 2.0,
        error_if_nonfinite: bool = False,
    ) -> Tensor:
        """Clip ``optimizer``'s gradients (all shards together) to a global ``norm_type``-norm of ``max_norm``;
        returns the norm before clipping. A non-finite norm raises with ``error_if_nonfinite``, unless the loss
        scaler found an overflow (that step is skipped anyway)."""
        overflow = self.reduce(optimizer)
        # see [Note: the norm over the shard group] and [Note: the norm over both dimensions] in amp.py
        sharded, groups = self.sharded(optimizer), self.shard_groups
        if groups.tensor is None:
            total = clip_grad_norm(sharded.grads(), max_norm, self.device, norm_type, groups.shard)
        else:
            sliced, replicated = sharded.grads_by_kind()
            total = clip_grad_norm(sliced, max_norm, self.device, norm_type, groups.shard, groups.tensor, replicated)
        self._step_norms[id(sharded)] = total  # for the non-finite guard of this step (any norm of a NaN is NaN)
        if error_if_nonfinite and not overflow and not torch.isfinite(total).all():
            raise RuntimeError(
                f"The total norm of order {norm_type} of the gradients is non-finite ({total.item()}),"
                " so it cannot be clipped. Pass `error_if_nonfinite=False` to clip anyway."
            )
        return total

    def grad_norms(self, norm_type: float = 2.0, optimizer: Optional[Optimizer] = None) -> dict[str, Tensor]:
        """Lightning's ``grad_norm(module, norm_type)`` for a sharded model: the ``norm_type``-norm of each trainable
        parameter's averaged gradient (``ddp``'s ``.grad``) under ``grad_{norm_type}_norm/{name}`` and their total
        under ``grad_{norm_type}_norm_total``, from the gradient shards. A collective; valid from the end of backward
        to the step (``on_before_optimizer_step``, after ``manual_backward``). ``optimizer``: only its parameters."""
        if self.shard_groups.tensor is not None:
            raise NotImplementedError("grad_norms() under tensor parallelism: use `clip_grad_norm` for the total norm.")
        targets = self.optimizers if optimizer is None else [self.sharded(optimizer)]
        for sharded in targets:
            self.reduce(sharded.optimizer)
        names = {id(p): name for name, p in self.module.named_parameters()}
        return parameter_grad_norms(targets, names, float(norm_type), self.shard_groups.shard, self.device)

    def clip_grad_value(self, clip_val: float, optimizer: Optional[Optimizer] = None) -> None:
        """Clamp ``optimizer``'s gradients into ``[-clip_val, clip_val]``."""
        self.reduce(optimizer)
        clip_grad_value(self.sharded(optimizer).grads(), clip_val)

    def step(
        self,
        optimizer: Optional[Optimizer] = None,
        *,
        clip_grad_norm: Optional[float] = None,
        clip_grad_value: Optional[float] = None,
        before_step: Optional[Callable[[], Any]] = None,
        zero_grad: bool = True,
        closure: Optional[Callable[[], Any]] = None,
        **step_kwargs: Any,
    ) -> Any:
        """One optimizer step, as below; ``optimizer`` ``None``: every optimizer of the engine in turn. Returns what
        ``optimizer.step`` returned (``None`` when the step was skipped), or what the ``closure`` returned if the step
        returned nothing. The closure runs once, with the first optimizer.

        [Note: the order of one optimizer step]
        For one optimizer, ``step`` runs:

        1. ``reduce`` (see [Note: the phases of one optimizer step] in ``optimizer.py``): what backward has not reduced
           yet is reduced (stage 1 after ``no_backward_sync``; every stage flushed at the end of the backward the step
           follows) and waited for; every master tensor gets its averaged gradient; under ``16-mixed`` the gradients are
           unscaled and every rank agrees on overflow (one all-reduce of a flag);
        2. ``before_step`` (the Trainer's ``on_before_optimizer_step`` hooks and its clipping), then clipping by global
           norm or value over all shards;
        3. the user's ``optimizer.step()``, skipped on every rank or none when the loss scaler found an overflow;
        4. ``after_step``: the master gradients are dropped (the reduced ones stay in the shard until ``zero_grad``) and
           the updated shards reach the working parameters (stages 1 and 2 all-gather them; stage 3 casts the shard and
           gathers again whatever unit is gathered at that moment);
        5. with ``zero_grad=True``, the gradients are dropped.

        Step 1 moves the optimizer from ``ACCUMULATING`` to ``REDUCED``, where it stays until step 4, so clipping before
        ``step`` (Fabric's ``clip_gradients``, manual optimization) reduces once.

        [Note: the closure goes to the optimizer]
        A ``closure`` (Lightning's forward and backward) goes to the user's ``optimizer.step(closure=...)`` as under
        ``ddp``, wrapped so that steps 1 and 2 (reduce, ``before_step``, clipping) run right after it, inside the
        call: an optimizer that counts or wraps ``step`` sees one call with a closure. Under ``16-mixed`` the overflow
        check must come before the call, and a step in pieces cannot run a closure per piece: there the closure runs
        first, then the step.
        """
        clip = (before_step, clip_grad_norm, clip_grad_value)
        output = None
        guarded = self.config.nonfinite is not None
        # a disk fault in this step is raised by every rank at its end (see [Note: faults are agreed on every rank])
        with disk.agreed_faults(self.shard_groups.world, self.config.on_disk):
            for sharded in self.optimizers if optimizer is None else [self.sharded(optimizer)]:
                if closure is not None and self.precision.scaler is None and sharded.steps_once and not guarded:
                    overflow, output = False, self._step_with_closure(sharded, closure, clip, step_kwargs)
                else:
                    loss = closure() if closure is not None else None
                    overflow = self._before_step(sharded, *clip)
                    skip = overflow or self._nonfinite(sharded)
                    output = None if skip else sharded.step(lambda: sharded.optimizer.step(**step_kwargs))  # noqa: B023 - called in this iteration
                    output = loss if output is None else output
                    overflow = skip
                closure = None
                self._step_norms.pop(id(sharded), None)
                if self.precision.scaler is not None:
                    self.precision.scaler.update(overflow)
                sharded.after_step(stepped=not overflow)
                if self.runtime is not None:
                    self.runtime.refresh()
                if zero_grad:
                    sharded.optimizer.zero_grad()
        self.completed_steps += 1
        self.memory.note("the end of an optimizer step")
        self._give_back_heap_once()
        if self.runtime is not None:
            self.runtime.prefetch_root()  # [Note: the root is gathered ahead of the next step] in stage3/units.py
        return output

    def _nonfinite(self, sharded: ShardedOptimizer) -> bool:
        """Whether to skip this step; raises under ``nonfinite="raise"``. Called on every rank after step 2 of [Note:
        the order of one optimizer step] (the gradients reduced, unscaled and clipped).

        [Note: the non-finite guard]
        With ``nonfinite="raise"`` or ``"skip"``, step 3 first asks whether the global norm of the optimizer's gradients
        is finite. Every rank holds the same norm (it is all-reduced), so every rank decides alike and no rank can step
        alone: ``"raise"`` raises on every rank, with the step and this rank; ``"skip"`` skips the user's
        ``optimizer.step()`` on every rank as an overflow does, counts it (``skipped_steps``, in ``summary()``) and
        warns. The norm is the one clipping by norm computed in this step when it did (Lightning's
        ``gradient_clip_val``, Fabric's ``clip_gradients``): then the guard costs nothing. Without clipping the guard
        computes that norm itself, the same way: one pass over this rank's gradient shard and an all-reduce of one
        number per optimizer (the only collective it adds; a finiteness flag needs an agreement as much as a norm does,
        and no all-reduce runs in every step otherwise). Under ``16-mixed`` the loss scaler has already unscaled the
        gradients and agreed on inf/NaN (step 1): such a step is skipped there and the scale backed off, so the guard
        has nothing left to see and stays out of the scaler's way (it never raises for an overflow the scaler handles by
        design). With the guard on, a closure runs before the step, as under ``16-mixed`` (the update must be skippable
        after the gradients exist).
        """
        if self.config.nonfinite is None or self.precision.scaler is not None:
            return False
        norm = self._step_norms.get(id(sharded))
        if norm is None:
            groups = self.shard_groups
            if groups.tensor is None:
                norm = global_grad_norm(sharded.grads(), self.device, 2.0, groups.shard)
            else:
                sliced, replicated = sharded.grads_by_kind()
                norm = global_grad_norm(sliced, self.device, 2.0, groups.shard, groups.tensor, replicated)
        if bool(torch.isfinite(norm).all()):
            return False
        step, rank = self.completed_steps, collectives.rank()  # from 0: `trainer.global_step` in that step
        if self.config.nonfinite == "raise":
            raise FloatingPointError(
                f"The gradients of step {step} are not finite (global norm "
                f"{norm.item()}; raised on rank {rank}, as on every rank). Look for the inf/NaN in "
                "the loss of that step, or pass `nonfinite='skip'` to skip such steps."
            )
        self.skipped_steps += 1
        if rank == 0:
            warnings.warn(
                f"lightning-zero: step {step} skipped on every rank: its gradients are not finite "
                f"(global norm {norm.item()}); {self.skipped_steps} skipped so far.",
                stacklevel=2,
            )
        return True

    def _before_step(
        self,
        sharded: ShardedOptimizer,
        before_step: Optional[Callable[[], Any]],
        clip_grad_norm: Optional[float],
        clip_grad_value: Optional[float],
    ) -> bool:
        """Steps 1 and 2 of [Note: the order of one optimizer step]; returns whether the loss scaler overflowed."""
        overflow = self.reduce(sharded.optimizer)
        if before_step is not None:
            before_step()
        if clip_grad_norm is not None:
            self.clip_grad_norm(clip_grad_norm, sharded.optimizer)
        if clip_grad_value is not None:
            self.clip_grad_value(clip_grad_value, sharded.optimizer)
        return overflow

    def _step_with_closure(
        self, sharded: ShardedOptimizer, closure: Callable[[], Any], clip: tuple, step_kwargs: dict[str, Any]
    ) -> Any:
        """``optimizer.step(closure=...)`` with steps 1 and 2 inside (see [Note: the closure goes to the optimizer])."""
        losses: list[Any] = []

        def wrapped() -> Any:
            losses.append(closure())
            self._before_step(sharded, *clip)
            return losses[-1]

        output = sharded.step_once(lambda: sharded.optimizer.step(closure=wrapped, **step_kwargs))
        return losses[-1] if output is None and losses else output

    def zero_grad(self, optimizer: Optional[Optimizer] = None) -> None:
        """Drop the gradients of ``optimizer`` (every optimizer when ``None``), as ``optimizer.zero_grad()`` does."""
        for sharded in self.optimizers if optimizer is None else [self.sharded(optimizer)]:
            sharded.optimizer.zero_grad()

    # ------------------------------------------------------------------ checkpoints
    def model_state(self) -> dict[str, Any]:
        """The model's entries of a checkpoint (its ``state_dict``): this rank's pieces under
        ``state_dict_type="sharded"``; under ``"full"`` the full weights in the master precision on rank 0 (a
        collective: every rank calls it)."""
        return state.model_state(self)

    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """``optimizer``'s entry of a checkpoint: this rank's pieces (``"sharded"``), or gathered to rank 0 in the
        per-parameter form ``ddp`` uses (``"full"``)."""
        return state.optimizer_state(self, optimizer)

    def checkpoint_entries(self, optimizers: Optional[Sequence[Optimizer]] = None) -> dict[str, Any]:
        """The engine's entries of a checkpoint: ``state_dict`` (``model_state``) and ``optimizer_states`` of
        ``optimizers`` (every optimizer of the engine when ``None``, none when empty) in the engine's order; add
        your own entries (``global_step``, ...) and give the dict to ``save_checkpoint``."""
        chosen = [sharded.optimizer for sharded in self.optimizers] if optimizers is None else optimizers
        return state.states_entries(self, chosen)

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: Union[str, Path], writer: state.Writer = "engine"
    ) -> None:
        """Write ``checkpoint`` (``checkpoint_entries`` and your own entries) in the format the Trainer and
        Fabric read too (see [Note: one checkpoint format for every way in] in ``state.py``): a directory every
        rank writes its pieces into, or with ``state_dict_type="full"`` one file written by rank 0. A collective;
        the checkpoint appears complete or not at all. ``writer``: which API wrote it (the adapters name
        themselves)."""
        state.save(self, checkpoint, Path(path), writer)

    def load_checkpoint(self, path: Union[str, Path], strict: bool = True, trusted: bool = False) -> dict[str, Any]:
        """Read the checkpoint at ``path`` (any writer's, any world size), load the model and, if it holds them,
        every optimizer's state (a collective); returns the checkpoint's other entries (``global_step``, ...). Only
        data is unpickled unless ``trusted`` (see [Note: a checkpoint is data, never code] in
        ``checkpoints/trust.py``)."""
        checkpoint = state.read(Path(path), trusted)
        self.load_model_state(checkpoint, strict)
        self.load_optimizer_states(checkpoint)
        return {key: value for key, value in checkpoint.items() if key not in state.INTERNAL_KEYS}

    def load_model_state(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        """Load the model part of ``checkpoint`` (what ``lightning_zero.engine.state.read`` returned, or the dict of a
        full file) into this rank's shards, then refresh the working parameters (a collective)."""
        state.load_model(self, checkpoint, strict)

    def load_optimizer_states(self, checkpoint: Mapping[str, Any]) -> None:
        """Load every optimizer's state of ``checkpoint`` into the engine's optimizers (the same number, in order);
        nothing when it holds none."""
        state.load_optimizers(self, checkpoint)

    def load_optimizer_state(self, optimizer: Optimizer, optimizer_state: Mapping[str, Any]) -> None:
        """Load one optimizer's full state dict (``optimizer.state_dict()`` of an unsharded run) into its shards."""
        state.load_one_optimizer(self, optimizer, optimizer_state)

    # ------------------------------------------------------------------ reports and teardown
    def step_costs(self) -> dict[str, int]:
        """What this process spent since the last call (or setup), without a clock (see [Note: what a step costs] in
        ``memory/costs.py``): ``large_allocations`` and ``allocated_bytes`` of the engine's own buffers (0 per step
        after warm-up), ``copied_bytes`` (about Ψ elements per step: the gradients into their buckets),
        ``minor_faults`` of the process, and ``collectives`` issued by the engine. Call it once per step."""
        now = {**costs.COSTS.snapshot(), "collectives": sum(self.shard_groups.traffic.calls.values())}
        spent = costs.difference(now, self._costs_mark) if self._costs_mark else now
        self._costs_mark = now
        return spent

    def memory_parts(self) -> EngineMemory:
        """What this engine holds now, by part (see [Note: the account of a rank's memory] in
        ``memory/account.py``): the model states by kind, stage 3's pool and the bucket buffers."""
        states = measure_model_states(self.module, [s.optimizer for s in self.optimizers])
        storages = self._partitioned_storages if self.policy.shards_params else []
        gathered = sum(s.gathered_bytes for s in storages)  # counted among the parameters by their storages
        return EngineMemory(
            params=states.params - gathered,
            grads=states.grads,
            master=states.master,
            optimizer_states=states.optimizer_states,
            pool=sum(s.sharded.pool.block_bytes for s in storages),
            buckets=sum(s.reducer.buffer_bytes for s in self.store.storages),
            pin=sum(s.reducer.heap_pin.held for s in self.store.storages if s.reducer.heap_pin is not None),
        )

    def summary(self) -> str:
        """One line: what each rank holds, next to what DDP would hold (see ``summary.py``)."""
        return model_state_summary(
            self.config,
            self.shard_groups,
            self.precision.precision,
            trainable=sum(p.numel() for p in self.store.params),
            units=len(self.unit_plan.names),
            skipped_steps=self.skipped_steps,
        )

    def teardown(self, gather: bool = True) -> None:
        """Remove every hook and, with ``gather`` (a collective), give the parameters their full fp32 values back.

        [Note: teardown after an exception]
        A normal teardown gathers the full weights back into the module, which takes every rank. After an exception
        or Ctrl-C the ranks stopped at different points (a peer may be gone), so a collective would be matched
        against a different one or hang: teardown then only removes the hooks, and stage 3's parameters become empty
        tensors (their gathered storage is gone). The last checkpoint is the state to resume or load from. The
        optimizers' shards stay reachable (a checkpoint can still be saved after ``fit`` returns).

        A run that ended normally on this rank can still meet a peer that did not: one given fewer batches ends its
        epoch while another waits in a step. Its gather then fails after the process group's timeout; teardown goes
        on as after an exception (nothing left that a later ``module.cpu()`` would refuse) and raises that failure,
        named as such, once it is done.
        """
        if self.torn_down:
            return
        self.torn_down = True
        failure: Optional[RuntimeError] = None
        runtime, self.runtime = self.runtime, None
        if runtime is not None:
            if gather:
                failure = _attempt(lambda: runtime.reshard_all(include_root=True))
            runtime.remove()
        if self._root_hook is not None:
            self._root_hook.remove()
            self._root_hook = None
        if self.activations is not None:
            self.activations.remove()
        for sharded in self.optimizers:
            sharded.uninstall()
        gather = gather and failure is None
        failure = failure or _attempt(lambda: self.store.uninstall(gather))
        if gather and failure is None:
            self.memory.note("the hand-back of the full weights")
        if not gather or failure is not None:
            drop_meta(self.module, self.device)
        pretrained.detach(self.module)
        for handle in self._state_hooks:
            handle.remove()
        if failure is not None:
            hint = "" if collectives.DIVERGENCE_HINT in str(failure) else f" {collectives.DIVERGENCE_HINT}"
            raise RuntimeError(
                f"ZeRO could not gather the full weights back into the model at the end of the run on this rank "
                f"(another rank did not join): {failure}.{hint}"
            ) from failure


def _attempt(action: Callable[[], object]) -> Optional[RuntimeError]:
    """Run ``action``; the ``RuntimeError`` it raised (a collective a peer did not join), or ``None``."""
    try:
        action()
    except RuntimeError as error:
        return error
    return None


def _default_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
