"""Stage 3: one object per unit group, the parameters gathered and freed together: its buffers in every storage,
its gathers, its hooks, its hpZ copy, its gradient count and the state it is in.

[Note: one object per unit group]
A unit's parameters may live in several storages of the parameter store (one per optimizer and dtype, see
``shards/store.py``), each with the unit's flat buffer and its memory from that storage's pool (``params.py``,
``pool.py``), and under hpZ a secondary copy (``secondary.py``). The ``UnitGroup`` is the one place that acts on the
unit as a whole (as FSDP2's ``FSDPParamGroup`` does for a ``fully_shard`` module): it unshards, waits and reshards
over all of those storages, keeps or drops the hpZ copy, counts the gradients backward has produced, holds the
state, and its methods are the unit's hooks (``pre_forward``, ``post_forward``, ``pre_backward``, ``post_backward``).
The runtime (``units.py``) registers those hooks and keeps only what spans units: the order the units run in, the
prefetch policy, the lockstep check and the training phase.

[Note: one vocabulary for stage 3]
Three verbs move a unit, at every level, and mean the same thing wherever they appear: ``unshard`` starts the
all-gathers into the unit's buffers (``SHARDED -> GATHERING``; nothing if it is gathered or a gather is in flight),
``wait_for_unshard`` waits for them (``GATHERING -> GATHERED``; nothing if it is gathered), ``reshard`` frees the
buffers back to the shards (a gather in flight is waited for first: its buffers must not go while an all-gather
writes them; nothing if it is ``SHARDED``). The runtime's ``unshard``, ``wait_for_unshard`` and ``reshard`` are the
same verbs applied to a group (or to every group); the rest of the runtime is orchestration named for what it does
(``before_use``, ``prefetch_root``, ``end_backward``, ``refresh``, ...). A storage's ``unshard_unit`` and
``reshard_unit`` are the same verbs for one storage's piece of a unit (``partitioned.py``). Each verb and each hook
runs inside a profiler range named ``lightning_zero::<verb or hook> <unit name>`` (``collectives.profiler_label``),
and so do the gradients' ``reduce_scatter`` and ``wait_for_reduce_scatter`` of each bucket (``shards/buckets.py``,
naming the bucket and its unit), so a trace of a step reads as its data path, unit by unit.

[Note: a unit's state and the runtime's phase]
Each unit is one ``UnitGroup`` that owns its state, a ``UnitState``: ``SHARDED`` (its buffers hold no memory),
``GATHERING`` (all-gathers issued, not waited for: a prefetch), ``GATHERED`` (its parameters hold their full values).
Waiting for an unshard that was never started raises ``IllegalUnitTransition``, so a bookkeeping mistake fails where
it is made. The runtime's ``TrainingPhase`` (``IDLE``, ``FORWARD``, ``RECOMPUTE``, ``BACKWARD``, ``SUMMONED``;
``UnitRuntime`` in ``units.py``) says what the hooks are inside, and its ``FORWARD``, ``RECOMPUTE`` and ``BACKWARD``
are also the passes a lockstep check sends (``lockstep.py``): one enum for both. A unit is freed after its forward
except when recomputing (backward needs it next) or ``SUMMONED`` (``UnitRuntime.all_gathered``). Whether a forward is
a recomputation inside backward is read from autograd (``_current_graph_task_id``), the only thing that can tell: a
reentrant checkpoint recomputes before any of our backward hooks ran (its first forward ran under ``no_grad``, so no
unit output carried a hook), and a backward run outside the engine never tells the runtime that it started or ended.
"""

from __future__ import annotations

from collections.abc import Callable
from enum import Enum, IntEnum
from typing import TYPE_CHECKING, Any, Optional, Sequence

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_flatten
from torch.utils.hooks import RemovableHandle

from lightning_zero.comm import collectives
from lightning_zero.shards.compiled import eager_hook
from lightning_zero.stage3.buffer import UnitBuffer
from lightning_zero.stage3.plan import ROOT

if TYPE_CHECKING:
    from lightning_zero.stage3.partitioned import PartitionedStorage
    from lightning_zero.stage3.units import UnitRuntime


class UnitState(Enum):
    """Where a unit's parameters are (see [Note: a unit's state and the runtime's phase])."""

    SHARDED = "sharded"
    GATHERING = "gathering"
    GATHERED = "gathered"


class TrainingPhase(IntEnum):
    """What the unit hooks are running inside; ``FORWARD``, ``RECOMPUTE`` and ``BACKWARD`` are also the passes a
    lockstep check sends, as their integer values (see [Note: a unit's state and the runtime's phase])."""

    FORWARD = 0
    RECOMPUTE = 1
    BACKWARD = 2
    IDLE = 3
    SUMMONED = 4

    @property
    def described(self) -> str:
        """The pass in words, for an error message."""
        return {TrainingPhase.RECOMPUTE: "recomputed forward"}.get(self, self.name.lower())


FORWARD, RECOMPUTE, BACKWARD = TrainingPhase.FORWARD, TrainingPhase.RECOMPUTE, TrainingPhase.BACKWARD
"""The passes a unit's hook runs in (the phases a lockstep check sends), by their short names."""


class IllegalUnitTransition(RuntimeError):
    """A unit was asked for a move its state does not allow (a bug in the runtime, never in user code)."""


class UnitGroup:
    """One stage 3 unit: its buffer in every storage holding its parameters (with their pool memory and hpZ copies),
    its unshard, wait and reshard over them, its hooks, its gradient count and its state (see [Note: one object per
    unit group] and [Note: one vocabulary for stage 3])."""

    def __init__(
        self,
        index: int,
        name: str,
        storages: Sequence["PartitionedStorage"],
        runtime: Optional["UnitRuntime"] = None,
    ) -> None:
        """``index``: the unit's place in the plan (0: the root); ``runtime``: whose shared state the hooks use."""
        self.index = index
        self.name = name
        self.storages = storages
        self.runtime = runtime
        found = (storage.unit_buffer(index) for storage in storages)
        self.buffers: list[UnitBuffer] = [b for b in found if b is not None]
        """The unit's buffer in each storage that has parameters of it (see ``buffer.py``)."""
        self.state = UnitState.SHARDED
        self.pending: list[Any] = []
        """The all-gathers in flight (``GATHERING``)."""
        self.grads_expected = 0
        """Parameters of the unit whose gradient backward produces (the unit is freed once all of them have)."""
        self.grads_seen = 0
        """Those whose gradient the current backward has produced (see ``grad_arrived``)."""
        self.guarded_while_gathering = False
        """Whether the parameters refuse reads until ``wait_for_unshard`` (a gather started between steps)."""
        self.handles: list[RemovableHandle] = []
        """The unit's hooks: its module's forward hooks and its parameters' gradient hooks."""
        # [Note: backward finds every unit gathered, the root too] in units.py: the root's hook on the model's output
        # is called as it is, every other unit's output hook never traced by dynamo
        self._pre_backward_hook: Callable[[Tensor], None] = (
            self.pre_backward if self.is_root else eager_hook(self.pre_backward, "stage 3's pre-backward hook")
        )

    @property
    def is_root(self) -> bool:
        """Whether this is the root unit (the parameters outside every unit's module, see [Note: units] in
        ``plan.py``)."""
        return self.index == ROOT

    def __repr__(self) -> str:
        return (
            f"UnitGroup('{self.name}', unit {self.index}, {self.state.value}, {self.numel} elements, "
            f"{self.gathered_bytes} bytes held, {len(self.buffers)} storages)"
        )

    # ------------------------------------------------------------------ unshard / wait / reshard
    def unshard(self, compute: bool = False, backward: bool = False, guarded: bool = False) -> bool:
        """``SHARDED -> GATHERING``: give the buffers their memory and start the all-gathers; nothing if the unit is
        gathered or a gather is in flight. Returns whether it started. ``compute``: for a forward or (``backward``)
        a backward, where ZeRO++ may gather from hpZ's secondary copies or as int8 (see
        ``PartitionedStorage.unshard_unit``); otherwise exact, from the primary shards. ``guarded``: the parameters
        keep refusing reads until ``wait_for_unshard`` (user code may run before the unit's next use)."""
        if self.state is not UnitState.SHARDED:
            return False
        with collectives.profiler_label("unshard", self.name):
            options = {"compute": True, "backward": backward} if compute else {}
            self.pending = [w for storage in self.storages for w in storage.unshard_unit(self.index, **options)]
            self.state = UnitState.GATHERING
            if guarded:
                self._guard(True)
        return True

    def wait_for_unshard(self) -> None:
        """``GATHERING -> GATHERED``: wait for the all-gathers in flight; nothing if the unit is gathered. Waiting for
        an unshard never started raises ``IllegalUnitTransition``."""
        if self.state is UnitState.SHARDED:
            raise IllegalUnitTransition(
                f"stage 3 unit '{self.name}': cannot wait for an unshard while sharded (only after unshard)."
            )
        if self.state is UnitState.GATHERED:
            return
        with collectives.profiler_label("wait_for_unshard", self.name):
            pending, self.pending = self.pending, []
            for work in pending:
                collectives.wait(work, f"gather stage 3 unit '{self.name}'")
            self.state = UnitState.GATHERED
            if self.guarded_while_gathering:
                self._guard(False)

    def reshard(self) -> None:
        """``-> SHARDED``: free the buffers back to the shards. A gather in flight is waited for first (its buffers
        must not go while an all-gather writes them); nothing if the unit is ``SHARDED``."""
        if self.state is UnitState.SHARDED:
            return
        self.wait_for_unshard()
        with collectives.profiler_label("reshard", self.name):
            for storage in self.storages:
                storage.reshard_unit(self.index)
            self.state = UnitState.SHARDED

    def _guard(self, released: bool) -> None:
        self.guarded_while_gathering = released
        for buffer in self.buffers:
            buffer.guard(released)

    @property
    def gathered_bytes(self) -> int:
        """Bytes the unit's buffers hold now."""
        return sum(buffer.held_bytes for buffer in self.buffers)

    @property
    def gathered(self) -> bool:
        """Whether its buffers hold memory (``GATHERING`` or ``GATHERED``)."""
        return self.state is not UnitState.SHARDED

    @property
    def numel(self) -> int:
        """Elements of the unit over every storage (what a gather of it moves into its buffers)."""
        return sum(buffer.numel for buffer in self.buffers)

    # ------------------------------------------------------------------ hooks
    def _shared(self) -> "UnitRuntime":
        assert self.runtime is not None, "a unit group's hooks run under the runtime that registered them"
        return self.runtime

    def pre_forward(self, module: nn.Module, args: Any) -> None:
        """The unit's module is about to run: check it against the other ranks, unshard it, prefetch the units after
        it (see [Note: lockstep and prefetch] in ``units.py``)."""
        with collectives.profiler_label("pre_forward", self.name):
            runtime = self._shared()
            recompute = runtime.enter_forward()
            record = torch.is_grad_enabled() and not recompute
            runtime.before_use(self, RECOMPUTE if recompute else FORWARD, record=record)

    def post_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        """The unit's module ran: hook its output for backward, keep the hpZ copy, reshard (unless backward needs the
        unit next: a recomputation, or the last unit of a training forward). The root's (on the whole model) only
        hooks the output (see [Note: backward finds every unit gathered, the root too] in ``units.py``)."""
        with collectives.profiler_label("post_forward", self.name):
            runtime = self._shared()
            if self.is_root:
                if not in_backward() and runtime.phase is not TrainingPhase.SUMMONED:
                    self._hook_output(output)
                return
            if in_backward():
                if runtime.phase is TrainingPhase.RECOMPUTE:
                    runtime.phase = TrainingPhase.BACKWARD
                return  # recomputation under activation checkpointing: backward needs the parameters next
            needs_grad = self._hook_output(output)
            if runtime.keeps_for_backward(self, needs_grad):
                runtime.kept = self
                self.drop_secondary()  # backward reads the gathered buffers themselves
                return
            training = needs_grad or module.training
            keep = runtime.phase is TrainingPhase.FORWARD and training
            self.keep_secondary() if keep else self.drop_secondary()
            runtime.reshard_after_use(self)

    def _hook_output(self, output: Any) -> bool:
        """Hook ``pre_backward`` on every tensor of ``output`` that requires grad; returns whether one did."""
        tensors = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
        for t in tensors:
            t.register_hook(self._pre_backward_hook)
        return bool(tensors)

    def pre_backward(self, grad: Tensor) -> None:
        """Backward reached the unit's output: check it, unshard it, prefetch the units before it. The root only if
        something resharded it after the forward (see [Note: backward finds every unit gathered, the root too] in
        ``units.py``): nothing, no collective, when it is gathered."""
        if self.is_root and self.state is UnitState.GATHERED:
            return
        with collectives.profiler_label("pre_backward", self.name):
            runtime = self._shared()
            if runtime.phase is not TrainingPhase.SUMMONED:
                runtime.phase = TrainingPhase.BACKWARD
            runtime.before_use(self, BACKWARD)

    def post_backward(self, param: Tensor) -> None:
        """One of the unit's gradients is accumulated: after the last of this backward, reshard the unit."""
        with collectives.profiler_label("post_backward", self.name):
            if self.grad_arrived():
                self._shared().reshard_after_use(self)

    def hook_module(self, module: nn.Module) -> None:
        """Register the unit's forward hooks on ``module``: ``pre_forward`` and ``post_forward``; the root's
        module is the whole model, where the engine unshards it itself: its post-forward hook only."""
        if not self.is_root:
            pre = eager_hook(self.pre_forward, "stage 3's pre-forward hook (gathers the unit)")
            self.handles.append(module.register_forward_pre_hook(pre))
        what = "stage 3's post-forward hook of the model (gathers the root for backward)" if self.is_root else None
        post = eager_hook(self.post_forward, what or "stage 3's post-forward hook (frees the unit)")
        self.handles.append(module.register_forward_hook(post))

    def watch_grad(self, param: Tensor) -> None:
        """Register ``post_backward`` as ``param``'s gradient hook, and count its gradient among those a backward
        produces."""
        self.expect_grad()
        hook = eager_hook(self.post_backward, "stage 3's gradient hook (frees the unit)")
        self.handles.append(param.register_post_accumulate_grad_hook(hook))

    def remove_hooks(self) -> None:
        """Remove every hook the group holds."""
        for handle in self.handles:
            handle.remove()
        self.handles = []

    # ------------------------------------------------------------------ gradients
    def expect_grad(self) -> None:
        """Count one more parameter of the unit whose gradient backward produces."""
        self.grads_expected += 1

    def reset_grads(self) -> None:
        """Forget the gradients counted so far (a backward ended before all of them arrived)."""
        self.grads_seen = 0

    def grad_arrived(self) -> bool:
        """One of the unit's gradients is accumulated; returns whether it was the last of this backward (the count
        starts again)."""
        self.grads_seen += 1
        if self.grads_seen != self.grads_expected:
            return False
        self.grads_seen = 0
        return True

    # ------------------------------------------------------------------ hpZ
    def keep_secondary(self) -> None:
        """hpZ: keep this rank's secondary piece of the gathered unit in every storage (see [Note: hpZ, the secondary
        partition] in ``secondary.py``)."""
        for storage in self.storages:
            storage.keep_secondary(self.index)

    def drop_secondary(self) -> None:
        """hpZ: forget the unit's secondary copy in every storage (its values change, or no backward needs it)."""
        for storage in self.storages:
            storage.drop_secondary(self.index)


def in_backward() -> bool:
    """Whether autograd is running a backward on this thread (see [Note: a unit's state and the runtime's phase])."""
    return torch._C._current_graph_task_id() != -1
