"""Stage 3: one object per unit group, the parameters gathered and freed together: its buffers in every storage,
its gathers, its hpZ copy, its gradient count and the state it is in.

[Note: one object per unit group]
A unit's parameters may live in several storages of the parameter store (one per optimizer and dtype, see
``shards/store.py``), each with the unit's flat buffer and its memory from that storage's pool (``params.py``,
``pool.py``), and under hpZ a secondary copy (``secondary.py``). The :class:`UnitGroup` is the one place that acts on
the unit as a whole (as FSDP2's ``FSDPParamGroup`` does for a ``fully_shard`` module): it gathers, waits and frees
over all of those storages, keeps or drops the hpZ copy, counts the gradients backward has produced, and holds the
state. The runtime (``units.py``) keeps only what spans units: the hooks that call into the groups, the order the
units run in, the prefetch policy, the lockstep check and the training phase.

[Note: a unit's state and the runtime's phase]
Each unit is one :class:`UnitGroup` that owns its state, a :class:`UnitState`: ``SHARDED`` (its buffers hold no memory),
``GATHERING`` (all-gathers issued, not waited for: a prefetch), ``GATHERED`` (its parameters hold their full values).
The moves are ``SHARDED -> GATHERING`` (:meth:`UnitGroup.start_gather`), ``GATHERING -> GATHERED``
(:meth:`UnitGroup.wait`), ``GATHERED -> GATHERING`` (:meth:`UnitGroup.regather`, after a step wrote new shards) and
``GATHERED -> SHARDED`` (:meth:`UnitGroup.release`); any other raises :class:`IllegalUnitTransition`, so a bookkeeping
mistake fails where it is made instead of freeing memory an all-gather is still writing. The runtime's own
:class:`TrainingPhase` (``IDLE``, ``FORWARD``, ``RECOMPUTE``, ``BACKWARD``, ``SUMMONED``; ``UnitRuntime`` in
``units.py``) says what the hooks are inside: a unit is freed after its forward except when recomputing (backward needs
it next) or ``SUMMONED`` (``UnitRuntime.all_gathered``). Whether a forward is a recomputation inside backward is read
from autograd (``_current_graph_task_id``), the only thing that can tell: a reentrant checkpoint recomputes before any
of our backward hooks ran (its first forward ran under ``no_grad``, so no unit output carried a hook), and a backward
run outside the engine never tells the runtime that it started or ended.
"""

from __future__ import annotations

from collections.abc import Callable
from enum import Enum
from typing import TYPE_CHECKING, Any, Optional, Sequence

from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from lightning_zero.comm import collectives
from lightning_zero.stage3.buffer import UnitBuffer

if TYPE_CHECKING:
    from lightning_zero.stage3.partitioned import PartitionedStorage


class UnitState(Enum):
    """Where a unit's parameters are (see [Note: a unit's state and the runtime's phase])."""

    SHARDED = "sharded"
    GATHERING = "gathering"
    GATHERED = "gathered"


class TrainingPhase(Enum):
    """What the unit hooks are running inside (see [Note: a unit's state and the runtime's phase])."""

    IDLE = "idle"
    FORWARD = "forward"
    RECOMPUTE = "recompute"
    BACKWARD = "backward"
    SUMMONED = "summoned"


class IllegalUnitTransition(RuntimeError):
    """A unit was asked for a move its state does not allow (a bug in the runtime, never in user code)."""


class UnitGroup:
    """One stage 3 unit: its buffer in every storage holding its parameters (with their pool memory and hpZ copies),
    its gathers, guard and frees over them, its hooks, its gradient count and its state (see [Note: one object per
    unit group])."""

    def __init__(self, index: int, name: str, storages: Sequence["PartitionedStorage"]) -> None:
        self.index = index
        self.name = name
        self.storages = storages
        found = (storage.unit_buffer(index) for storage in storages)
        self.buffers: list[UnitBuffer] = [b for b in found if b is not None]
        """The unit's buffer in each storage that has parameters of it (see ``buffer.py``)."""
        self.state = UnitState.SHARDED
        self.pending: list[Any] = []
        """The all-gathers in flight (``GATHERING``)."""
        self.grads_expected = 0
        """Parameters of the unit whose gradient backward produces (the unit is freed once all of them have)."""
        self.grads_seen = 0
        """Those whose gradient the current backward has produced (see :meth:`grad_arrived`)."""
        self.guarded_while_gathering = False
        """Whether the parameters refuse reads until :meth:`wait` (a gather started between steps)."""
        self.handles: list[RemovableHandle] = []
        """The unit's hooks: its module's forward hooks and its parameters' gradient hooks (the runtime's code)."""

    def _move(self, allowed: UnitState, to: UnitState, what: str) -> None:
        if self.state is not allowed:
            raise IllegalUnitTransition(
                f"stage 3 unit '{self.name}': cannot {what} while {self.state.value} (only while {allowed.value})."
            )
        self.state = to

    def start_gather(self, compute: bool = False, backward: bool = False, guarded: bool = False) -> None:
        """``SHARDED -> GATHERING``: give the buffers their memory and start the all-gathers. ``compute``: for a
        forward or (``backward``) a backward, where ZeRO++ may gather from hpZ's secondary copies or as int8 (see
        :meth:`PartitionedStorage.gather_unit`); otherwise exact, from the primary shards. ``guarded``: the
        parameters keep refusing reads until :meth:`wait` (user code may run before the unit's next use)."""
        self._move(UnitState.SHARDED, UnitState.GATHERING, "start a gather")
        options = {"compute": True, "backward": backward} if compute else {}
        self.pending = [w for storage in self.storages for w in storage.gather_unit(self.index, **options)]
        if guarded:
            self._guard(True)

    def _guard(self, released: bool) -> None:
        self.guarded_while_gathering = released
        for buffer in self.buffers:
            buffer.guard(released)

    def regather(self) -> None:
        """``GATHERED -> GATHERING``: gather again into the same buffers (the shards changed under them)."""
        self._move(UnitState.GATHERED, UnitState.GATHERING, "gather again")
        self.pending = [w for storage in self.storages for w in storage.gather_unit(self.index)]

    def wait(self) -> None:
        """``GATHERING -> GATHERED``: wait for the all-gathers in flight."""
        self._move(UnitState.GATHERING, UnitState.GATHERED, "wait for a gather")
        pending, self.pending = self.pending, []
        for work in pending:
            collectives.wait(work, f"gather stage 3 unit '{self.name}'")
        if self.guarded_while_gathering:
            self._guard(False)

    def release(self) -> None:
        """``GATHERED -> SHARDED``: free the buffers."""
        self._move(UnitState.GATHERED, UnitState.SHARDED, "release")
        for storage in self.storages:
            storage.release_unit(self.index)

    def drain(self) -> None:
        """Wait for the all-gathers in flight without raising (before an error leaves: teardown frees their
        buffers)."""
        for work in self.pending:
            work.wait()
        self.pending = []
        if self.state is UnitState.GATHERING:
            self.state = UnitState.GATHERED
        if self.guarded_while_gathering:
            self._guard(False)

    @property
    def gathered_bytes(self) -> int:
        """Bytes the unit's buffers hold now."""
        return sum(buffer.held_bytes for buffer in self.buffers)

    @property
    def gathered(self) -> bool:
        """Whether its buffers hold memory (``GATHERING`` or ``GATHERED``)."""
        return self.state is not UnitState.SHARDED

    def gather(self, compute: bool = False, backward: bool = False, wait: bool = True) -> bool:
        """Start the unit's gather if it is ``SHARDED`` (``compute``, ``backward``: as :meth:`start_gather`) and, with
        ``wait``, wait for a gather in flight; returns whether a gather started."""
        started = self.state is UnitState.SHARDED
        if started:
            self.start_gather(compute=compute, backward=backward)
        if wait and self.state is UnitState.GATHERING:
            self.wait()
        return started

    def land(self) -> None:
        """Wait for a gather in flight, if any (the unit stays gathered)."""
        if self.state is UnitState.GATHERING:
            self.wait()

    def free(self) -> None:
        """Release the unit whatever it is doing: a gather in flight lands first (its buffers must not go while an
        all-gather writes them); nothing if it is ``SHARDED``."""
        if self.state is UnitState.SHARDED:
            return
        self.land()
        self.release()

    @property
    def numel(self) -> int:
        """Elements of the unit over every storage (what a gather of it moves into its buffers)."""
        return sum(buffer.numel for buffer in self.buffers)

    # ------------------------------------------------------------------ hooks
    def hook_module(
        self, module: nn.Module, pre_forward: Optional[Callable[..., Any]], post_forward: Callable[..., Any]
    ) -> None:
        """Hold the unit module's forward hooks (the runtime's, which call into the group); ``pre_forward`` ``None``:
        the post-forward hook only (the root, gathered by the engine's own hook)."""
        if pre_forward is not None:
            self.handles.append(module.register_forward_pre_hook(pre_forward))
        self.handles.append(module.register_forward_hook(post_forward))

    def watch_grad(self, param: Tensor, hook: Callable[[Tensor], None]) -> None:
        """Hold ``param``'s gradient hook (the runtime's, which calls :meth:`grad_arrived`), and count its gradient
        among those a backward produces."""
        self.expect_grad()
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


Unit = UnitGroup
"""The name this class had first, kept importable."""
