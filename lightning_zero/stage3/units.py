"""Stage 3: the runtime that registers each unit group's hooks (see [Note: units] in ``plan.py``), which unshard the
unit around its use and reshard it after, and that holds what spans units: the order units run in, the prefetch
policy, the lockstep check and the phase; each unit, its buffers, hooks, hpZ copy, gradient count and state is a
``UnitGroup`` (``unit.py``, [Note: one object per unit group] and [Note: one vocabulary for stage 3]).

[Note: gather, free, and autograd]
Each unit's parameters are views of one flat buffer per storage; freeing resizes that buffer's *storage* to zero
and gathering resizes it back and all-gathers into it. The tensor objects never change, so the tensors autograd
saved in forward (the weights, and views of them such as ``W.t()``) read the re-gathered values in backward. A hook
on each unit output re-gathers the unit when the gradient reaches it; the unit is freed again once all of its
parameters have their gradient. Inside backward (activation checkpointing recomputes a forward) the post-forward
hook does not free: the backward that follows needs the parameters, and the pre-forward hook prefetches in backward
order. A block checkpointed by the strategy (``lightning_zero.activations.checkpointing``) recomputes its original
``forward`` without its hooks; the unit is gathered once in backward, by the hook on its output, before the
recomputation.

[Note: lockstep and prefetch]
Every rank must issue the same all-gathers in the same order. The order of units in the first forward is recorded;
afterwards the next units in that order (the previous ones in backward) are gathered asynchronously while the
current one computes, up to ``prefetch_size`` elements in flight. A rank whose control flow runs a different unit
than the others cannot be matched: every unit hook sends the unit it is about to run to every rank (see [Note: the
lockstep check] in ``lockstep.py``), and prefetches only from units that every rank has seen agree (see [Note: a
check is waited for one unit late] there), so every rank fails within one unit of where they differ, together, and
the error names the unit each rank ran and the units a rank skipped.

[Note: the root is gathered ahead of the next step]
The root unit (the parameters outside every block: embeddings, final norm, head) is the first one a forward needs, and
no unit before it can prefetch it: gathered at the root's pre-forward hook, its all-gather is the one stage 3 waits for
with nothing to overlap. So after an optimizer step, once the new shards are written, every rank starts the root's
gather (``UnitRuntime.prefetch_root``) and the next forward waits for it; it overlaps the data loading and the
loop's own work between steps, as hooks on the forward could not. Meanwhile user code may run (callbacks, a checkpoint,
evaluation), so the root's parameters keep refusing reads until the gather is waited for
(``UnitGroup.unshard(guarded=True)``, [Note: a released parameter raises, it never crashes] in ``guard.py``): what a
callback sees between steps is what it saw before, and every path that reads the root (its forward hook,
``gathered_parameters``, ``state_dict``) waits for the gather first; ``load_state_dict``, a checkpoint load and
``load_pretrained`` wait for it before they write the shards it reads (``UnitRuntime.wait_for_unshard``). The memory
is the root's, held from the step's end instead of from the next forward's start: after the step's peak, not on it.

[Note: the last unit stays gathered into backward]
Backward starts where forward ended: the first unit it needs is the last one forward ran. Freeing that unit after
its forward and gathering it again as backward's first act moves one unit per step for nothing (and waits for it with
nothing to overlap), so, as FSDP2 does not reshard the root's last module after forward, a training forward leaves
the last unit of the recorded order gathered (``UnitRuntime.keeps_for_backward``: once the order is known, only
when its output requires grad, never while recomputing or ``SUMMONED``); its pre-backward hook finds it gathered and
its gradient hook frees it as it frees every unit. Its hpZ copy is not kept: backward reads the gathered buffers. A
forward that no backward follows must not leave it behind: the next unit hook of another forward frees it
(``UnitRuntime._hand_over_kept``), as do the end of the backward, the end of a step and an optimizer step's refresh
gathers it again from the new shards. The values are those a backward gather would give (the same shards, the same
int8 blocks under qwZ), so nothing but the traffic changes: per step and micro-batch stage 3 all-gathers its units
once for forward and, for backward, every unit but the root and the last one.

[Note: backward finds every unit gathered, the root too]
The tensors autograd saved in a forward are views of the unit buffers' storages, so whatever backward reaches must be
gathered when it gets there, whatever freed it in between. Every unit but the root is gathered again by the hook on its
output. The root has no module of its own: it is gathered at the model's forward and normally stays gathered until its
backward ends. But it can be freed between the model's forward and its backward: with several models on one Fabric, a
backward through another model ends every model's backward (a GAN's discriminator step on ``fake.detach()`` frees the
generator's root while ``fake``'s graph, to be used by the generator's loss, still holds views of it), and so do
``end_step`` and every other path that frees it. So the model's own output carries a hook too (the root group's
``post_forward``, registered on the model): when backward reaches the output and finds the root not gathered, it checks
and gathers the root from the same shards as any unit's backward hook does (the values the forward used, unless an
optimizer step wrote new ones in between, which DDP refuses as an in-place change of a saved tensor). When the root is
gathered, as in every single-model step, the hook does nothing: no collective is added.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Optional, Union

from torch import nn

from lightning_zero.comm import collectives
from lightning_zero.stage3.lockstep import LockstepCheck, RanksOutOfStepError
from lightning_zero.stage3.plan import ROOT, UnitPlan, units_under_compile
from lightning_zero.stage3.unit import FORWARD, TrainingPhase, UnitGroup, UnitState, in_backward

if TYPE_CHECKING:
    from lightning_zero.stage3.partitioned import PartitionedStorage


class UnitRuntime:
    """Registers the unit groups' hooks and holds what spans units: the order, the prefetch, the lockstep check and
    the phase (see [Note: gather, free, and autograd] and [Note: one vocabulary for stage 3] in ``unit.py``)."""

    def __init__(
        self,
        plan: UnitPlan,
        storages: list["PartitionedStorage"],
        prefetch_size: int,
        lockstep_check: Union[bool, str] = True,
        model: Optional[nn.Module] = None,
    ) -> None:
        """``model``: the whole model, whose output gathers the root if backward finds it freed (see [Note: backward
        finds every unit gathered, the root too])."""
        self.plan = plan
        self.storages = storages
        self.prefetch_size = prefetch_size
        self.units = [UnitGroup(index, name, storages, self) for index, name in enumerate(plan.names)]
        """One group per unit of the plan, in its order (``units[0]``: the root)."""
        self.phase = TrainingPhase.IDLE
        self.forward_order: list[int] = []
        """The units' indices in the order of the first training forward (see [Note: lockstep and prefetch])."""
        self.order_final = False
        """Whether ``forward_order`` is complete (from the end of the first backward on)."""
        self.peak_gathered_bytes = 0
        """High-water mark of gathered unit bytes (root, current unit, prefetch): bounded by options, not depth."""
        self.kept: Optional[UnitGroup] = None
        """The unit a training forward ran last and left gathered for backward (see [Note: the last unit stays
        gathered into backward]); ``None`` once backward took it or it was freed."""
        # a collective: every rank makes it; with nobody to compare with, nothing to check
        check = LockstepCheck(plan.names, strict=lockstep_check == "strict") if lockstep_check else None
        self.lockstep = check if check is not None and check.active else None
        self._unverified: Optional[tuple[UnitGroup, int]] = None
        """The unit and prefetch direction of the check in flight (see [Note: a check is waited for one unit late]
        in ``lockstep.py``)."""
        self._held_back: Optional[tuple[UnitGroup, int]] = None
        """Those of a check waited for whose prefetch is still to be issued (at the next unit's hook)."""
        self._last_pass: Optional[TrainingPhase] = None
        self.checks_waited_at_once = 0
        """Lockstep checks waited for at the hook that sent them (a unit not prefetched, a pass's first unit)."""
        for storage in storages if self.lockstep is not None else ():
            storage.reducer.before_launch = self.wait_for_check  # a reduce-scatter follows from verified units
            storage.gathers_verified = True  # so does every gather: gloo may exchange pairwise (collectives.py)
        for storage in storages:
            for j, p in enumerate(storage.params):
                self.units[storage.param_units[j]].watch_grad(p)
        for group, mod in zip(self.units, plan.modules):
            if mod is not None:
                group.hook_module(mod)
        if model is not None:
            self.root.hook_module(model)

    @property
    def root(self) -> UnitGroup:
        """The root unit's group (see [Note: units] in ``plan.py``)."""
        return self.units[ROOT]

    def __repr__(self) -> str:
        gathered = [f"{u.name} ({u.state.value})" for u in self.units if u.gathered]
        order = "final" if self.order_final else f"recording ({len(self.forward_order)} so far)"
        return (
            f"UnitRuntime({len(self.units)} units, {self.phase.name.lower()}, order {order}, "
            f"prefetch_size={self.prefetch_size}, gathered: {gathered}, {self.gathered_bytes} bytes held)"
        )

    # ------------------------------------------------------------------ unshard / wait / reshard
    def unshard(self, group: UnitGroup, wait: bool = True) -> None:
        """Unshard ``group`` (asynchronously unless ``wait``; waiting on a prefetched gather). A collective, for code
        between steps: waits for the lockstep check in flight first."""
        self._end_check()
        self._unshard(group, wait)

    def _unshard(self, group: UnitGroup, wait: bool = True) -> None:
        """Unshard ``group`` for the phase the runtime is in (ZeRO++ applies to a forward or backward), and wait for
        it with ``wait``."""
        backward = self.phase in (TrainingPhase.BACKWARD, TrainingPhase.RECOMPUTE)
        compute = backward or self.phase is TrainingPhase.FORWARD
        if group.unshard(compute=compute, backward=backward):
            self._track_peak()
        if wait:
            group.wait_for_unshard()

    def wait_for_unshard(self) -> None:
        """Wait for every unshard in flight (the units stay gathered): before code that writes the shards they read."""
        self._end_check()
        for group in self.units:
            if group.state is UnitState.GATHERING:
                group.wait_for_unshard()

    def reshard(self, group: UnitGroup) -> None:
        """Reshard ``group`` now, the root too, whatever the step is doing (the caller unsharded it outside a step)."""
        if group is self.kept:
            self.kept = None
        group.reshard()

    def reshard_after_use(self, group: UnitGroup) -> None:
        """A unit's hook is done with it: reshard it, except the root (kept until ``end_step``) and anything
        while ``SUMMONED``."""
        if not group.is_root and self.phase is not TrainingPhase.SUMMONED:
            self.reshard(group)

    def reshard_all(self, include_root: bool) -> None:
        """Reshard every gathered unit (end of backward; with ``include_root`` also the end of a step) and drop hpZ's
        secondary copies (see [Note: hpZ, the secondary partition] in ``secondary.py``)."""
        self._drop_secondary_copies()
        self.kept = None
        for group in self.units:
            group.reset_grads()
            if not group.is_root or include_root:
                group.reshard()

    # ------------------------------------------------------------------ between passes and steps
    @contextmanager
    def all_gathered(self) -> Iterator[None]:
        """Every unit gathered inside (a collective), so that every parameter holds its full value; the units that
        were not gathered before are resharded after. A forward inside frees nothing."""
        self._end_check()
        before = {group.index for group in self.units if group.gathered}
        for group in self.units:
            self._unshard(group)
        previous, self.phase = self.phase, TrainingPhase.SUMMONED
        try:
            yield
        finally:
            self.phase = previous
            for group in self.units:
                if group.index not in before:
                    self.reshard(group)

    def end_backward(self, include_root: bool) -> None:
        """After a backward: the forward order is known from now on; reshard what is still gathered."""
        self._end_check()
        self.order_final = bool(self.forward_order)
        self.phase = TrainingPhase.IDLE
        self.reshard_all(include_root)

    def end_step(self) -> None:
        """After an evaluation step or a manual-optimization training step: reshard everything, the root too."""
        self._end_check()
        self.phase = TrainingPhase.IDLE
        self.reshard_all(include_root=True)

    def prefetch_root(self) -> None:
        """After an optimizer step: unshard the root for the next forward (see [Note: the root is gathered ahead of
        the next step]). A collective, as the step is; nothing before the forward order is known, with prefetching
        off, or when the root is still gathered (a step inside manual optimization)."""
        self._end_check()
        if not self.order_final or self.prefetch_size <= 0 or self.root.state is not UnitState.SHARDED:
            return
        self.root.unshard(compute=True, guarded=True)
        self._track_peak()

    def refresh(self) -> None:
        """After an optimizer step the gathered units hold old values: reshard them and unshard them again from the
        new shards (a prefetch in flight lands first)."""
        self._end_check()
        self._drop_secondary_copies()
        for group in self.units:
            if group.gathered:
                group.reshard()
                group.unshard()
                group.wait_for_unshard()

    def remove(self) -> None:
        """Remove every hook."""
        for group in self.units:
            group.remove_hooks()
        for storage in self.storages:
            storage.reducer.before_launch = None
            storage.gathers_verified = False

    @property
    def gathered_bytes(self) -> int:
        """Bytes of unit buffers gathered now, over every storage."""
        return sum(storage.gathered_bytes for storage in self.storages)

    def _track_peak(self) -> None:
        """Record the gathered bytes now if they are the most so far (after an unshard starts)."""
        self.peak_gathered_bytes = max(self.peak_gathered_bytes, self.gathered_bytes)

    def _drop_secondary_copies(self) -> None:
        for storage in self.storages:
            storage.drop_secondary()

    # ------------------------------------------------------------------ what the groups' hooks call
    def enter_forward(self) -> bool:
        """At a unit's forward: the phase it runs in (see [Note: a unit's state and the runtime's phase] in
        ``unit.py``); returns whether it is a recomputation inside backward."""
        recompute = in_backward()
        if self.phase is not TrainingPhase.SUMMONED:
            self.phase = TrainingPhase.RECOMPUTE if recompute else TrainingPhase.FORWARD
        return recompute

    def keeps_for_backward(self, group: UnitGroup, needs_grad: bool) -> bool:
        """Whether a forward leaves ``group`` gathered for the backward that follows: the last unit of the recorded
        order, in a training forward whose output backward will reach (see [Note: the last unit stays gathered into
        backward])."""
        return (
            needs_grad
            and self.phase is TrainingPhase.FORWARD
            and self.order_final
            and not group.is_root
            and group.index == self.forward_order[-1]
        )

    def before_use(self, group: UnitGroup, pass_: TrainingPhase, record: bool = False) -> None:
        """A unit's pre-forward or pre-backward hook: check it against the other ranks, unshard it, prefetch the ones
        after it (before it in backward, and in a forward recomputed inside backward: those are the ones backward
        needs next). ``record``: a training forward, whose order is recorded until the first backward ends."""
        step = 1 if pass_ is FORWARD else -1
        self._wait_for_previous_check()  # the previous unit's check: from here on, it is agreed
        self._hand_over_kept(group, pass_)
        # prefetched from agreed units: its gather issues no collective. A pass's first unit waits for its check and
        # prefetches from itself: the check before it was of another pass, which says nothing of what comes next
        ahead = group.gathered and self._last_pass is pass_
        self._last_pass = pass_
        check = self.lockstep
        if check is not None:
            check.start(group.index, pass_, self.forward_order)
        if record and not self.order_final and group.index not in self.forward_order:
            self.forward_order.append(group.index)
        if check is not None and ahead and not check.strict:
            self._unverified = (group, step)  # waited for at the next hook, which prefetches from it
            self._unshard(group)
            return
        if check is not None:
            self.checks_waited_at_once += 1
            self._finish_check()
        self._unshard(group)
        self._prefetch(group, step)

    def _hand_over_kept(self, group: UnitGroup, pass_: TrainingPhase) -> None:
        """At a unit's hook: backward takes the kept unit over (its gradient hook reshards it, or the end of
        backward); a forward that runs another unit first was not followed by backward, so the kept unit is resharded
        as its own forward would have done (see [Note: the last unit stays gathered into backward])."""
        if self.kept is None:
            return
        if pass_ is not FORWARD:
            self.kept = None
        elif group is not self.kept:
            self.reshard_after_use(self.kept)  # nothing while ``SUMMONED``: every unit stays gathered there

    # ------------------------------------------------------------------ the lockstep check
    def _end_check(self) -> None:
        """Between passes and steps: wait for the lockstep check in flight, and drop the prefetch it held back (the
        pass it was for is over). A collective."""
        self.wait_for_check()
        self._held_back = None

    def _wait_for_previous_check(self) -> None:
        """At a unit's hook: wait for the lockstep check in flight, then prefetch from its unit what it held back:
        the units after its successor (see [Note: a check is waited for one unit late] in ``lockstep.py``)."""
        self.wait_for_check()
        if self._held_back is not None:
            (group, step), self._held_back = self._held_back, None
            self._prefetch(group, step, beyond_next=True)

    def wait_for_check(self) -> None:
        """Wait for the lockstep check in flight, and leave its prefetch to the next hook (before a reduce-scatter,
        inside the unit's backward: its prefetch there would hold one unit more at once)."""
        if self._unverified is None:
            return
        self._held_back, self._unverified = self._unverified, None
        self._finish_check()

    def _finish_check(self) -> None:
        """Wait for the lockstep check in flight: every rank fails together if the ranks sent different units.

        What is in flight was issued by every rank alike (from agreed checks only), so it completes: it is waited
        for before the error leaves, because teardown frees the buffers the gathers write into."""
        if self.lockstep is None or not self.lockstep.in_flight:
            return
        try:
            self.lockstep.finish(self.forward_order)
        except RanksOutOfStepError:
            for group in self.units:
                if group.state is UnitState.GATHERING:
                    group.wait_for_unshard()
            raise

    def _prefetch(self, group: UnitGroup, step: int, beyond_next: bool = False) -> None:
        """Unshard the units after ``group`` in the recorded order (``step`` -1: before it, in backward's order), up
        to ``prefetch_size`` elements; ``beyond_next``: counted from the next unit instead (the next one too, on top
        of the budget)."""
        order = self.forward_order if step > 0 else self.forward_order[::-1]
        if group.index not in order or self.prefetch_size <= 0:
            return
        ahead = [self.units[index] for index in order[order.index(group.index) + 1 :]]
        budget = self.prefetch_size + (ahead[0].numel if beyond_next and ahead else 0)
        for candidate in ahead:
            size = candidate.numel
            if size > budget:
                return
            if not candidate.gathered:
                with collectives.profiler_label("prefetch", f"{candidate.name} (from {group.name})"):
                    self._unshard(candidate, wait=False)
            budget -= size


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
            UserWarning,
            stacklevel=4,
        )
