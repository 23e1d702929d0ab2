"""The user's own optimizer, stepping on this rank's shard of the master weights.

[Note: what the user's optimizer sees]
``ShardedOptimizer`` keeps the user's optimizer object (its class, hyperparameters, param groups, LR schedulers
and any ``param_groups[i]["lr"]`` edits all stay live) and only swaps the tensors in ``param_groups[i]["params"]``:
an elementwise optimizer (SGD, Adam, AdamW, ...) gets one flat master tensor per bucket of the group, any other
optimizer (Adafactor, unknown classes) gets the whole parameters this rank owns, shaped as the parameters. Its state
(``exp_avg`` ...) is therefore created for the shard only: the 12Ψ/N of the paper.

[Note: gradients live until zero_grad]
As under DDP, the reduced gradients stay (in the gradient shard) until ``zero_grad()``: a second optimizer can step
on the same backward, and a backward without ``zero_grad`` accumulates into them. ``zero_grad()`` clears them, which
matters with several optimizers (a GAN's generator gradients produced by the discriminator's backward must be
discarded by ``opt_g.zero_grad()`` exactly as under DDP). The master tensors carry a ``.grad`` only from
``ShardedOptimizer.reduce`` to ``ShardedOptimizer.after_step`` (views of the shard, or fp32 copies
under mixed precision); the shard stays the one source of truth. Because Lightning calls ``zero_grad`` on a
``LightningOptimizer`` whose class is derived from the optimizer's class, the hook has to be on the class: the
optimizer's class is swapped for a subclass that adds it (``isinstance`` checks still hold). This is the only way
found: torch's ``Optimizer`` has no ``zero_grad`` hook, and an instance attribute ``optimizer.zero_grad`` is not seen
by Lightning's and Fabric's wrappers (``LightningOptimizer``, ``_FabricOptimizer``), which resolve ``zero_grad`` on
their own class, made at wrap time from the optimizer's class, and call it with the wrapper as ``self``.

Parameters held by several optimizers are owned by one storage (the first optimizer's) and borrowed by the others:
see [Note: parameters shared by several optimizers] in ``sharing.py``.
"""

from __future__ import annotations

from enum import Enum
from typing import Any, Callable, Optional, Sequence

import torch
from torch import Tensor
from torch.optim import Optimizer

from lightning_zero.shards import disk, offload
from lightning_zero.shards.layout import FlatLayout, MasterSlot
from lightning_zero.shards.optimizer_support import (
    check_optimizer,
    check_params,
    is_elementwise,
    step_in_pieces,
    steps_in_pieces,
    zero_subclass,
)
from lightning_zero.shards.policy import OptimizerPolicy
from lightning_zero.shards.sharing import borrowed_slots, split_members
from lightning_zero.shards.slices import tensor_parallel_slice
from lightning_zero.shards.store import ShardedStorage

MakeStorage = Callable[[list[Tensor], list[int], bool], ShardedStorage]
"""Lays out and stores ``(params, param group of each, whole_params)`` (the engine's store makes it)."""


class StepPhase(Enum):
    """Where an optimizer is in its step (see [Note: the phases of one optimizer step])."""

    ACCUMULATING = "accumulating"
    REDUCED = "reduced"


class ShardedOptimizer:
    """ZeRO on one user optimizer: its master slots (views of the store's master shards) and the step on them.

    The parameters it is the first to hold are laid out in a storage of their own, made by ``make_storage`` and kept
    in the engine's store (see [Note: the store and the optimizers] in ``store.py``); those a storage in ``lenders``
    already holds (an earlier optimizer's) are borrowed from it, not laid out again (see [Note: parameters shared by
    several optimizers] in ``sharing.py``). ``whole_params`` overrides whether the optimizer gets whole tensors
    (default: unless it is elementwise).

    [Note: the phases of one optimizer step]
    An optimizer is ``ACCUMULATING`` (backward adds gradients into the storages) until ``reduce`` finishes the
    reduction and gives every master its averaged gradient: it is then ``REDUCED`` until ``after_step`` (or a
    ``zero_grad`` that clears its storage's gradients) takes it back to ``ACCUMULATING``. Everything that needs the
    reduced gradients (clipping, gradient norms, the step) asks for ``reduce``; it reduces only from
    ``ACCUMULATING`` and otherwise returns the overflow found then, so manual optimization may clip before
    ``optimizer.step()`` and the step does not reduce twice.
    """

    def __init__(
        self,
        optimizer: Optimizer,
        policy: OptimizerPolicy,
        make_storage: MakeStorage,
        lenders: Sequence[ShardedStorage] = (),
        module: Optional[torch.nn.Module] = None,
        whole_params: Optional[bool] = None,
    ) -> None:
        check_optimizer(optimizer)
        if policy.offload.offload_optimizer:
            offload.check_steps_on_host(optimizer)
        self.optimizer = optimizer
        self.canonical: list[Tensor] = [p for g in optimizer.param_groups for p in g["params"]]
        self.group_sizes = [len(g["params"]) for g in optimizer.param_groups]
        check_params(self.canonical, optimizer)
        members = split_members(self.canonical, lenders)
        self.managed = members.managed
        """Canonical index (in the user's param groups) of each member: owned parameters first, then borrowed."""
        self.members = [self.canonical[i] for i in self.managed]
        """The trainable parameters of the optimizer: those of its own storage, then the borrowed ones."""
        group_of = {id(p): g for g, grp in enumerate(optimizer.param_groups) for p in grp["params"]}
        owned = self.members[: members.owned]
        whole = not is_elementwise(optimizer, policy) if whole_params is None else whole_params
        self.storage: ShardedStorage = make_storage(owned, [group_of[id(p)] for p in owned], whole)
        """The storage of the parameters this optimizer owns (laid out for it)."""
        self.sources: list[ShardedStorage] = [self.storage, *members.owners]
        """Its own storage and the storages it borrows from, whose gradients its step needs (the same on every rank)."""
        self._borrowed = members.borrowed
        self.slots: list[MasterSlot] = list(self.storage.slots)
        self.slot_sources: list[ShardedStorage] = [self.storage] * len(self.slots)
        """The storage whose shard each slot's ``start`` refers to (its own, or the owner of borrowed parameters)."""
        self.masters: list[Tensor] = list(self.storage.masters)
        for source, slot in borrowed_slots(self.members, members.owned, group_of, self.sources[1:]):
            self.slots.append(slot)
            self.slot_sources.append(source)
            self.masters.append(source.master_view(slot))
        self.windowed: Optional[disk.WindowedStep] = (
            disk.WindowedStep(optimizer, policy.offload.offload_path)
            if policy.offload.offload_optimizer == disk.DISK
            else None
        )
        """With ``offload_optimizer="disk"``: the step window by window (see [Note: the step one window at a time])."""
        self.phase = StepPhase.ACCUMULATING
        self._reduced_at = -1  # the storage's clear count when it was reduced
        self._overflow = False
        self._install_into(optimizer)

    @property
    def params(self) -> list[Tensor]:
        """The parameters this optimizer owns (its storage's)."""
        return self.storage.params

    @property
    def layout(self) -> FlatLayout:
        """The layout of its own storage (the borrowed masters follow their owners', cut the same way)."""
        return self.storage.layout

    def _install_into(self, optimizer: Optimizer) -> None:
        for g, group in enumerate(optimizer.param_groups):
            group["params"] = [m for m, s in zip(self.masters, self.slots) if s.group == g]
        optimizer.__class__ = zero_subclass(type(optimizer))
        optimizer._zero_sharded = self  # type: ignore[attr-defined]

    # ------------------------------------------------------------------ step
    def reduce(self, unscale: Optional[Callable[[list[Tensor]], bool]] = None) -> bool:
        """``ACCUMULATING`` to ``REDUCED`` (see [Note: the phases of one optimizer step]): reduce what is left in its
        own storage and those it borrows from and give every master tensor its averaged gradient (in the master
        dtype); ``unscale`` (``16-mixed``) then unscales them and tells whether any rank overflowed, which is
        returned. Already ``REDUCED``: returns that overflow, reducing nothing."""
        if self.phase is StepPhase.REDUCED and self._reduced_at == self.storage.clears:
            return self._overflow
        for source in self.sources:  # the step may write a host master that is also the host parameter shard
            source.settle()
        shards = {id(source): source.reduce_grads() for source in self.sources}
        for slot, master, source in zip(self.slots, self.masters, self.slot_sources):
            grad = shards[id(source)][slot.start : slot.start + slot.length].view(slot.shape)
            master.grad = grad if grad.dtype == master.dtype else grad.to(master.dtype)
        self._overflow = unscale(self.grads()) if unscale is not None else False
        self.phase, self._reduced_at = StepPhase.REDUCED, self.storage.clears
        return self._overflow

    def step(self, call: Callable[[], Any]) -> Any:
        """Run the user's ``optimizer.step`` (``call``): for elementwise optimizers in pieces of at most one bucket's
        elements, so that its temporaries stay that small (see [Note: the step in constant-size pieces])."""
        # see [Note: the refresh follows the step piece by piece] in flat.py
        stepped = self.storage.refresh_as_stepped() if len(self.sources) == 1 else None
        if self.windowed is not None:
            limit = None if self.layout.whole_params else self.storage.bucket_elements
            return self.windowed.run(call, limit, stepped)
        if self.layout.whole_params:
            return call()
        return step_in_pieces(self.optimizer, self.storage.bucket_elements, call, stepped)

    def step_once(self, call: Callable[[], Any]) -> Any:
        """Run the user's ``optimizer.step`` (``call``) as one call (``steps_once``), as one window on disk."""
        return self.windowed.run(call, None) if self.windowed is not None else call()

    @property
    def steps_once(self) -> bool:
        """Whether ``step`` makes one ``optimizer.step`` call (not pieces: see [Note: the step in constant-size
        pieces] in ``optimizer_support.py``)."""
        return self.layout.whole_params or not steps_in_pieces(self.optimizer, self.storage.bucket_elements)

    def grads(self) -> list[Tensor]:
        """The master gradients of this rank (valid while ``REDUCED``)."""
        return [m.grad for m in self.masters if m.grad is not None]

    def grads_by_kind(self) -> tuple[list[Tensor], list[Tensor]]:
        """Under tensor parallelism: the master gradients of this rank split into views of the tensor-parallel
        slices and of the replicated parameters (see [Note: the norm over both dimensions] in ``amp.py``)."""
        sliced: list[Tensor] = []
        replicated: list[Tensor] = []
        for slot, master in zip(self.slots, self.masters):
            if master.grad is None:
                continue
            flat = master.grad.view(-1)
            for p, _, length, offset in slot.pieces:
                kind = sliced if tensor_parallel_slice(self.members[p]) is not None else replicated
                kind.append(flat[offset : offset + length])
        return sliced, replicated

    def after_step(self, stepped: bool) -> None:
        """``REDUCED`` to ``ACCUMULATING``: drop the master gradients (the shard keeps the reduced sum, see [Note:
        gradients live until zero_grad]) and, if the optimizer stepped, bring the update to the working parameters
        of every storage it stepped on: stages 1 and 2 all-gather it into the full buffer, stage 3 casts it into
        the working shard."""
        self.phase = StepPhase.ACCUMULATING
        for m in self.masters:
            m.grad = None
        if stepped:
            for source in self.sources:
                source.refresh_working()

    def zero_grad(self) -> None:
        """Drop the gradients of every parameter of the optimizer: master grads, stage 1's full ``.grad`` and the
        reduced gradients, in its own storage and, for borrowed parameters, in their owners' (no communication)."""
        self.phase = StepPhase.ACCUMULATING
        for m in self.masters:
            m.grad = None
        self.storage.clear_grads(None)
        for source in self.sources[1:]:
            source.clear_grads(self._borrowed[id(source)])

    def own_masters(self) -> list[tuple[MasterSlot, Tensor]]:
        """The slots in its own storage's shard with their master tensors."""
        return self.storage.own_masters()

    def uninstall(self) -> None:
        """Drop the master gradients (the storage hands the parameters back; the optimizer state stays, so a
        checkpoint can still be saved after ``fit`` returns)."""
        self.phase = StepPhase.ACCUMULATING
        for m in self.masters:
            m.grad = None
