"""Stage 3: the hooks that gather units (see [Note: units] in ``plan.py``) around their use and free them after.

[Note: gather, free, and autograd]
Each unit's parameters are views of one flat buffer per storage; freeing resizes that buffer's *storage* to zero
and gathering resizes it back and all-gathers into it. The tensor objects never change, so the tensors autograd
saved in forward (the weights, and views of them such as ``W.t()``) read the re-gathered values in backward. A hook
on each unit output re-gathers the unit when the gradient reaches it; the unit is freed again once all of its
parameters have their gradient. Inside backward (activation checkpointing recomputes a forward) the post-forward
hook does not free: the backward that follows needs the parameters, and the pre-forward hook prefetches in backward
order. A block checkpointed by the strategy (:mod:`lightning_zero.core.activations`) recomputes its original ``forward``
without its hooks; the unit is gathered once in backward, by the hook on its output, before the recomputation.

[Note: lockstep and prefetch]
Every rank must issue the same all-gathers in the same order. The order of units in the first forward is recorded;
afterwards the next units in that order (the previous ones in backward) are gathered asynchronously while the
current one computes, up to ``prefetch_size`` elements in flight. A rank whose control flow runs a different unit
than the others cannot be matched: every unit hook first checks that all ranks are about to run the same unit (see
[Note: the lockstep check] in ``lockstep.py``), so every rank fails at the first unit where they differ, at once, and
the error names the unit each rank ran and the units a rank skipped.

[Note: a unit's state and the runtime's phase]
Each unit is one :class:`Unit` that owns its state, a :class:`UnitState`: ``SHARDED`` (its buffers hold no memory),
``GATHERING`` (all-gathers issued, not waited for: a prefetch), ``GATHERED`` (its parameters hold their full values).
The moves are ``SHARDED -> GATHERING`` (:meth:`Unit.start_gather`), ``GATHERING -> GATHERED`` (:meth:`Unit.wait`),
``GATHERED -> GATHERING`` (:meth:`Unit.regather`, after a step wrote new shards) and ``GATHERED -> SHARDED``
(:meth:`Unit.release`); any other raises :class:`IllegalUnitTransition`, so a bookkeeping mistake fails where it is
made instead of freeing memory an all-gather is still writing. The runtime's own :class:`TrainingPhase` (``IDLE``,
``FORWARD``, ``RECOMPUTE``, ``BACKWARD``, ``SUMMONED``) says what the hooks are inside: a unit is freed after its
forward except when recomputing (backward needs it next) or ``SUMMONED`` (:meth:`UnitRuntime.all_gathered`).
Whether a forward is a recomputation inside backward is read from autograd (``_current_graph_task_id``), the only
thing that can tell: a reentrant checkpoint recomputes before any of our backward hooks ran (its first forward ran
under ``no_grad``, so no unit output carried a hook), and a backward run outside the engine never tells the runtime
that it started or ended.

[Note: the root is gathered ahead of the next step]
The root unit (the parameters outside every block: embeddings, final norm, head) is the first one a forward needs,
and no unit before it can prefetch it: gathered at the root's pre-forward hook, its all-gather is the one stage 3
waits for with nothing to overlap (issue 23). So after an optimizer step, once the new shards are written, every rank
starts the root's gather (:meth:`UnitRuntime.prefetch_root`) and the next forward waits for it; it overlaps the data
loading and the loop's own work between steps, as hooks on the forward could not. Meanwhile user code may run
(callbacks, a checkpoint, evaluation), so the root's parameters keep refusing reads until the gather is waited for
(``Unit.start_gather(guarded=True)``, [Note: a released parameter raises, it never crashes] in ``guard.py``): what a
callback sees between steps is what it saw before, and every path that reads the root (its forward hook,
``gathered_parameters``, ``state_dict``, a refresh after ``load_state_dict``) waits for the gather first. The memory
is the root's, held from the step's end instead of from the next forward's start: after the step's peak, not on it.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from enum import Enum
from typing import TYPE_CHECKING, Any, Sequence

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from lightning_zero.core import collectives
from lightning_zero.core.compiled import eager_hook
from lightning_zero.stage3.lockstep import BACKWARD, FORWARD, RECOMPUTE, LockstepCheck, RanksOutOfStepError
from lightning_zero.stage3.plan import ROOT, UnitPlan, units_under_compile

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


class Unit:
    """One stage 3 unit: its gathers and frees over every storage holding its parameters, and its state."""

    def __init__(self, index: int, name: str, storages: Sequence["PartitionedStorage"]) -> None:
        self.index = index
        self.name = name
        self.storages = storages
        self.state = UnitState.SHARDED
        self.pending: list[Any] = []
        """The all-gathers in flight (``GATHERING``)."""
        self.grads_expected = 0
        """Parameters of the unit whose gradient backward produces (the unit is freed once all of them have)."""
        self.grads_seen = 0
        self.guarded_while_gathering = False
        """Whether the parameters refuse reads until :meth:`wait` (a gather started between steps)."""

    def _move(self, allowed: UnitState, to: UnitState, what: str) -> None:
        if self.state is not allowed:
            raise IllegalUnitTransition(f"stage 3 unit '{self.name}': cannot {what} while {self.state.value} "
                                        f"(only while {allowed.value}).")
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
        for storage in self.storages:
            storage.guard_unit(self.index, released)

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
    def gathered(self) -> bool:
        """Whether its buffers hold memory (``GATHERING`` or ``GATHERED``)."""
        return self.state is not UnitState.SHARDED


class UnitRuntime:
    """Gathers and frees units around their forward and backward (see [Note: gather, free, and autograd])."""

    def __init__(self, plan: UnitPlan, storages: list["PartitionedStorage"], prefetch_size: int,
                 lockstep_check: bool = True) -> None:
        self.plan = plan
        self.storages = storages
        self.prefetch_size = prefetch_size
        self.units = [Unit(index, name, storages) for index, name in enumerate(plan.names)]
        self.phase = TrainingPhase.IDLE
        self.forward_order: list[int] = []
        self.order_final = False
        """Whether :attr:`forward_order` is complete (from the end of the first backward on)."""
        self.peak_gathered_bytes = 0
        """High-water mark of gathered unit bytes (root, current unit, prefetch): bounded by options, not depth."""
        self._handles: list[Any] = []
        self.lockstep = LockstepCheck(plan.names) if lockstep_check else None  # a collective: every rank makes it
        for storage in storages:
            for j, p in enumerate(storage.params):
                unit = storage.param_units[j]
                self.units[unit].grads_expected += 1
                self._handles.append(p.register_post_accumulate_grad_hook(self._grad_hook(unit)))
        for unit, mod in enumerate(plan.modules):
            if mod is not None:
                self._handles.append(mod.register_forward_pre_hook(self._pre_forward_hook(unit)))
                self._handles.append(mod.register_forward_hook(self._post_forward_hook(unit)))

    # ------------------------------------------------------------------ gather / free
    def gather(self, unit: int, wait: bool = True) -> None:
        """All-gather ``unit`` (asynchronously unless ``wait``); waiting on a prefetched gather."""
        u = self.units[unit]
        if u.state is UnitState.SHARDED:
            backward = self.phase in (TrainingPhase.BACKWARD, TrainingPhase.RECOMPUTE)
            u.start_gather(compute=backward or self.phase is TrainingPhase.FORWARD, backward=backward)
            self._track_peak()
        if wait and u.state is UnitState.GATHERING:
            u.wait()

    def release(self, unit: int) -> None:
        """Free ``unit``'s gathered storage (the root stays until :meth:`end_step`; nothing while ``SUMMONED``)."""
        if unit != ROOT and self.phase is not TrainingPhase.SUMMONED:
            self._free(unit)

    def release_now(self, unit: int) -> None:
        """Free ``unit`` now, the root too, whatever the step is doing (the caller gathered it outside a step)."""
        self._free(unit)

    @contextmanager
    def all_gathered(self) -> Iterator[None]:
        """Every unit gathered inside (a collective), so that every parameter holds its full value; the units that
        were not gathered before are freed after. A forward inside frees nothing."""
        before = {u.index for u in self.units if u.gathered}
        for unit in range(len(self.units)):
            self.gather(unit)
        previous, self.phase = self.phase, TrainingPhase.SUMMONED
        try:
            yield
        finally:
            self.phase = previous
            for unit in range(len(self.units)):
                if unit not in before:
                    self._free(unit)

    def _free(self, unit: int) -> None:
        u = self.units[unit]
        if u.state is UnitState.SHARDED:
            return
        if u.state is UnitState.GATHERING:
            u.wait()  # a prefetch still in flight must land before its buffer goes
        u.release()

    def end_backward(self, include_root: bool) -> None:
        """After a backward: the forward order is known from now on; free what is still gathered."""
        self.order_final = bool(self.forward_order)
        self.phase = TrainingPhase.IDLE
        self.release_all(include_root)

    def prefetch_root(self) -> None:
        """After an optimizer step: start the root's gather for the next forward (see [Note: the root is gathered
        ahead of the next step]). A collective, as the step is; nothing before the forward order is known, with
        prefetching off, or when the root is still gathered (a step inside manual optimization)."""
        root = self.units[ROOT]
        if not self.order_final or self.prefetch_size <= 0 or root.state is not UnitState.SHARDED:
            return
        root.start_gather(compute=True, guarded=True)
        self._track_peak()

    def _track_peak(self) -> None:
        """Record the gathered bytes now if they are the most so far (after a gather starts)."""
        live = sum(storage.gathered_bytes for storage in self.storages)
        self.peak_gathered_bytes = max(self.peak_gathered_bytes, live)

    def end_step(self) -> None:
        """After an evaluation step or a manual-optimization training step: free everything, the root too."""
        self.phase = TrainingPhase.IDLE
        self.release_all(include_root=True)

    def release_all(self, include_root: bool) -> None:
        """Free every gathered unit (end of backward; with ``include_root`` also the end of a step) and drop hpZ's
        secondary copies (see [Note: hpZ, the secondary partition] in ``secondary.py``)."""
        self._drop_secondary()
        for u in self.units:
            u.grads_seen = 0
            if u.index != ROOT or include_root:
                self._free(u.index)

    def refresh(self) -> None:
        """After an optimizer step the gathered units hold old values: gather them again from the new shards."""
        self._drop_secondary()
        for u in self.units:
            if u.state is UnitState.GATHERING:
                u.wait()  # let a prefetch in flight land first
            if u.state is UnitState.GATHERED:
                u.regather()
                u.wait()

    def remove(self) -> None:
        """Remove every hook."""
        for handle in self._handles:
            handle.remove()
        self._handles = []

    # ------------------------------------------------------------------ hooks
    def _enter_forward(self) -> bool:
        """At a unit's forward: the phase it runs in (see [Note: a unit's state and the runtime's phase]); returns
        whether it is a recomputation inside backward."""
        recompute = _in_backward()
        if self.phase is not TrainingPhase.SUMMONED:
            self.phase = TrainingPhase.RECOMPUTE if recompute else TrainingPhase.FORWARD
        return recompute

    def _pre_forward_hook(self, unit: int) -> Any:
        def hook(module: nn.Module, args: Any) -> None:
            recompute = self._enter_forward()
            self._check_lockstep(unit, RECOMPUTE if recompute else FORWARD)
            if torch.is_grad_enabled() and not recompute and not self.order_final and unit not in self.forward_order:
                self.forward_order.append(unit)
            self.gather(unit)
            # a recomputed forward (activation checkpointing) runs inside backward: prefetch the units backward
            # needs next, not the ones after this unit, which backward has already finished with
            self._prefetch(unit, step=-1 if recompute else 1)

        return eager_hook(hook, "stage 3's pre-forward hook (gathers the unit)")

    def _post_forward_hook(self, unit: int) -> Any:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            if _in_backward():
                if self.phase is TrainingPhase.RECOMPUTE:
                    self.phase = TrainingPhase.BACKWARD
                return  # recomputation under activation checkpointing: backward needs the parameters next
            tensors = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
            for t in tensors:
                t.register_hook(self._pre_backward_hook(unit))
            self._keep_secondary(unit, module, bool(tensors))
            self.release(unit)

        return eager_hook(hook, "stage 3's post-forward hook (frees the unit)")

    def _keep_secondary(self, unit: int, module: nn.Module, needs_grad: bool) -> None:
        """hpZ: before a training forward frees ``unit``, keep its secondary copy for backward; otherwise drop any
        (see [Note: hpZ, the secondary partition] in ``secondary.py``)."""
        training = needs_grad or module.training
        keep = unit != ROOT and self.phase is TrainingPhase.FORWARD and training
        for storage in self.storages:
            storage.keep_secondary(unit) if keep else storage.drop_secondary(unit)

    def _drop_secondary(self) -> None:
        for storage in self.storages:
            storage.drop_secondary()

    def _pre_backward_hook(self, unit: int) -> Any:
        def hook(grad: torch.Tensor) -> None:
            if self.phase is not TrainingPhase.SUMMONED:
                self.phase = TrainingPhase.BACKWARD
            self._check_lockstep(unit, BACKWARD)
            self.gather(unit)
            self._prefetch(unit, step=-1)

        return eager_hook(hook, "stage 3's pre-backward hook (gathers the unit)")

    def _grad_hook(self, unit: int) -> Any:
        def hook(param: torch.Tensor) -> None:
            u = self.units[unit]
            u.grads_seen += 1
            if u.grads_seen == u.grads_expected:
                u.grads_seen = 0
                self.release(unit)

        return eager_hook(hook, "stage 3's gradient hook (frees the unit)")

    def _check_lockstep(self, unit: int, phase: int) -> None:
        """Fail on every rank at once if the ranks are about to run different units (see [Note: the lockstep check]).

        The prefetches in flight were issued by every rank alike (the check before them passed), so they complete:
        they are waited for before the error leaves, because teardown frees the buffers they write into."""
        if self.lockstep is None:
            return
        try:
            self.lockstep.check(unit, phase, self.forward_order)
        except RanksOutOfStepError:
            for u in self.units:
                u.drain()
            raise

    def _prefetch(self, unit: int, step: int) -> None:
        if unit not in self.forward_order or self.prefetch_size <= 0:
            return
        position = self.forward_order.index(unit) + step
        budget = self.prefetch_size
        while 0 <= position < len(self.forward_order):
            candidate = self.forward_order[position]
            size = sum(storage.unit_numel(candidate) for storage in self.storages)
            if size > budget:
                return
            if not self.units[candidate].gathered:
                self.gather(candidate, wait=False)
            budget -= size
            position += step


def _in_backward() -> bool:
    """Whether autograd is running a backward on this thread (see [Note: a unit's state and the runtime's phase])."""
    return torch._C._current_graph_task_id() != -1


def warn_if_units_compiled_inside(module: nn.Module, plan: UnitPlan) -> None:
    """Say once (rank 0) that a compiled region around stage 3 units is split at each of them."""
    inside = units_under_compile(module, plan)
    if inside and collectives.rank() == 0:
        shown = ", ".join(f"'{name}'" for name in inside[:4]) + (", ..." if len(inside) > 4 else "")
        warnings.warn(
            f"zero3: {len(inside)} stage 3 units ({shown}) run inside a region compiled by torch.compile (a compiled "
            "`forward` around them, `torch.compile(self.model)` or `module.compile()`). Their gather/free hooks "
            "issue collectives that dynamo cannot trace: they run eagerly and dynamo splits the compiled graph at each "
            "of them (results unchanged, compiled once, not every step; but the region is compiled in pieces, not "
            "as one graph). To compile whole blocks, compile the units themselves in `configure_model`: "
            "`self.blocks[i] = torch.compile(block)`.",
            UserWarning, stacklevel=4)
