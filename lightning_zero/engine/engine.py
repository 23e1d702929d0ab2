"""``ZeroEngine``: ZeRO on one module and its optimizers, and one training step in one place, without Lightning.

The Trainer's :class:`~lightning_zero.ZeroStrategy` and Fabric's :class:`~lightning_zero.ZeroFabricStrategy` are
adapters over it; a plain PyTorch loop with ``torch.distributed`` initialized uses it directly::

    engine = ZeroEngine(model, [optimizer], stage=2, precision="bf16-mixed")
    for x, y in loader:
        with engine.forward_context():
            loss = loss_fn(model(x), y)
        engine.backward(loss)
        engine.step(clip_grad_norm=1.0)  # reduce, unscale, clip, step, gather, zero_grad

The optimizer step is :class:`~lightning_zero.engine.stepping.OptimizerSteps`', a base class of the engine (see [Note:
the order of one optimizer step] in ``stepping.py``).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from typing import Any, Callable, Optional, Union, cast

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_zero.activations.checkpointing import ActivationCheckpointing, activations_from_policy
from lightning_zero.comm import collectives
from lightning_zero.comm.groups import ShardGroups
from lightning_zero.config import ZeroConfig, check_option_names
from lightning_zero.engine import module_state, simulated
from lightning_zero.engine.amp import PrecisionMode
from lightning_zero.engine.policies import group_sizes, policies_of
from lightning_zero.engine.stepping import OptimizerSteps
from lightning_zero.engine.summary import model_state_summary
from lightning_zero.memory import costs
from lightning_zero.memory.account import EngineMemory, MemoryLedger
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


class ZeroEngine(OptimizerSteps):
    """Installs ZeRO on ``module`` and the user's ``optimizers`` and runs their steps.

    Args:
        module: the model. Under stage 3 it may have been built under :func:`sharded_construction` (pass the
            recording as ``recording``), so that no rank ever holds it whole.
        optimizers: the user's optimizers over ``module``'s parameters (their objects, classes and hyperparameters
            stay theirs). None: evaluation only (stage 3 then still shards the weights).
        precision: ``"32-true"``, ``"bf16-mixed"``, ``"16-mixed"`` or ``"bf16-true"``, or a :class:`PrecisionMode`.
        device: this rank's device (default: the current CUDA device, else the CPU).
        config: the options as a :class:`~lightning_zero.ZeroConfig`, or give them as keyword arguments instead
            (``stage=3, offload_optimizer=True``, ...).
        recording: stage 3: the construction recorded by :func:`sharded_construction`, replayed unit by unit.
        shard_groups: the groups to shard over and replicate across (default: made from ``shard_group_size`` and
            ``tensor_parallel_size``, or plain ZeRO over every rank; see [Note: hybrid sharding and its traffic] and
            [Note: ZeRO over the data dimension] in ``groups.py``). With tensor parallelism, build the module over the
            mesh of :func:`~lightning_zero.tensor_parallel.make_device_mesh`; the engine finds the same mesh (it is
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
        if simulated.simulated():  # see [Note: one rank of a simulated world] in simulated.py
            self.config = simulated.stand_aside(self.config)
        self.policies = policies_of(self.config)
        """What each component reads of the options (see [Note: one policy per component] in ``policies.py``)."""
        self.policy = self.policies.stage
        self.precision = precision if isinstance(precision, PrecisionMode) else PrecisionMode(precision)
        self.device = device if device is not None else _default_device()
        if recording is not None:
            recording.keep(module)  # before the precision converts the module (see [Note: record and replay])
        self.module = self.precision.convert_module(module)
        if shard_groups is None:
            world = collectives.world_size()  # one node of every rank: "node" is then the world
            shard_groups = group_sizes(self.config, world, world, 1).make(self.device.type)
        self.shard_groups = shard_groups
        self.store = ParameterStore()
        """Where the managed parameters live, with or without optimizers (see [Note: the store and the optimizers])."""
        self.optimizers: list[ShardedOptimizer] = []
        """One :class:`ShardedOptimizer` per user optimizer, in their order (none for evaluation)."""
        self.runtime: Optional[UnitRuntime] = None
        self.activations: Optional[ActivationCheckpointing] = None
        self.unit_plan = UnitPlan()
        self._root_hook: Optional[Any] = None
        self.torn_down = False
        self._state_hooks: list[Any] = []
        self._costs_mark: dict[str, int] = {}
        self.skipped_steps = 0
        """Optimizer steps skipped because their gradients were not finite (``nonfinite="skip"``)."""
        self.completed_steps = 0
        """Optimizer steps run (or skipped) since setup; the Trainer sets it to its ``global_step``."""
        self._step_norms: dict[int, torch.Tensor] = {}  # clipping's global norm, per optimizer, until its step
        self._heap_given_back = 0  # trims of the host heap done: after setup, after the first step
        self.memory = MemoryLedger(self.memory_parts, enabled=self.device.type == "cpu")
        """Readings of this rank's host memory at the highest points of its steps (see [Note: the account of a rank's
        memory] in ``memory/account.py``)."""
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
        """The store's storages under stage 3, where :meth:`_make_storage` makes every one partitioned (the list
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
        """``loss.backward()`` (scaled under ``16-mixed``), then :meth:`finish_backward`."""
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
        ``optimizer.step``, as manual optimization may, passes ``False`` and calls :meth:`end_step`)."""
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
        """One line: what each rank holds, next to what DDP would hold (see :func:`model_state_summary`)."""
        return model_state_summary(self)

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
