"""The user's own optimizer, stepping on this rank's shard of the master weights.

[Note: what the user's optimizer sees]
:class:`ShardedOptimizer` keeps the user's optimizer object (its class, hyperparameters, param groups, LR schedulers
and any ``param_groups[i]["lr"]`` edits all stay live) and only swaps the tensors in ``param_groups[i]["params"]``:
an elementwise optimizer (SGD, Adam, AdamW, ...) gets one flat master tensor per bucket of the group, any other
optimizer (Adafactor, unknown classes) gets the whole parameters this rank owns, shaped as the parameters. Its state
(``exp_avg`` ...) is therefore created for the shard only: the 12Ψ/N of the paper.

[Note: gradients live until zero_grad]
As under DDP, the reduced gradients stay (in the gradient shard) until ``zero_grad()``: a second optimizer can step
on the same backward, and a backward without ``zero_grad`` accumulates into them. ``zero_grad()`` clears them, which
matters with several optimizers (a GAN's generator gradients produced by the discriminator's backward must be
discarded by ``opt_g.zero_grad()`` exactly as under DDP). The master tensors carry a ``.grad`` only from
:meth:`ShardedOptimizer.prepare_step` to :meth:`ShardedOptimizer.after_step` (views of the shard, or fp32 copies
under mixed precision); the shard stays the one source of truth. Because Lightning calls ``zero_grad`` on a
``LightningOptimizer`` whose class is derived from the optimizer's class, the hook has to be on the class: the
optimizer's class is swapped for a subclass that adds it (``isinstance`` checks still hold).

Parameters held by several optimizers are owned by one engine and borrowed by the others: see [Note: parameters
shared by several optimizers] in ``sharing.py``.
"""

from __future__ import annotations

from typing import Any, Callable, ClassVar, Optional, Sequence

import torch
from torch import Tensor
from torch.optim import Optimizer

from lightning_zero.core import collectives
from lightning_zero.core.groups import ShardGroups
from lightning_zero.core import disk, offload
from lightning_zero.core.buckets import GradientReducer
from lightning_zero.core.compiled import eager_hook
from lightning_zero.config import ZeroConfig
from lightning_zero.core.layout import Bucket, FlatLayout, MasterSlot, plan_layout, plan_master_slots
from lightning_zero.core.optimizer_support import (
    backward_order,
    check_optimizer,
    check_params,
    is_elementwise,
    step_in_pieces,
    steps_in_pieces,
    zero_subclass,
)
from lightning_zero.core.sharing import borrowed_slots, split_members
from lightning_zero.stages import StagePolicy
from lightning_zero.core.slices import tensor_parallel_slice


class ShardedOptimizer:
    """Installs ZeRO on one user optimizer: layout, master shard, gradient reducer, and the step on the shard.

    [Note: two storages, one step]
    What differs between the stages is where the working parameters live, so that is what the two subclasses hold:
    :class:`~lightning_zero.core.flat.FlatShardedOptimizer` (stages 1 and 2: one full flat working buffer on every
    rank, refreshed by an all-gather after the step) and :class:`~lightning_zero.stage3.partitioned.PartitionedOptimizer`
    (stage 3: a working shard, units gathered around their use). Everything else, the layout, the reduction of
    gradients, the master tensors the user's optimizer steps on, ``zero_grad`` and borrowing, is this class's.

    ``owners`` are the engines of earlier optimizers: parameters one of them already holds are borrowed from it,
    not laid out again (see [Note: parameters shared by several optimizers] in ``sharing.py``). ``whole_params``
    overrides whether the optimizer gets whole tensors (default: unless it is elementwise). ``groups`` are the
    process groups it shards over and replicates across (default: shard over the world; see [Note: hybrid sharding
    and its traffic] in ``groups.py``).
    """

    def __init__(
        self,
        optimizer: Optimizer,
        policy: StagePolicy,
        config: ZeroConfig,
        working_dtype: torch.dtype,
        master_dtype: torch.dtype,
        device: torch.device,
        module: Optional[torch.nn.Module] = None,
        unit_of: Optional[Callable[[Tensor], int]] = None,
        groups: Optional[ShardGroups] = None,
        unit_names: Sequence[str] = (),
        owners: Sequence["ShardedOptimizer"] = (),
        whole_params: Optional[bool] = None,
    ) -> None:
        check_optimizer(optimizer)
        if config.offload_optimizer:
            offload.check_steps_on_host(optimizer)
        self.optimizer = optimizer
        self.policy = policy
        self.groups = groups if groups is not None else ShardGroups()
        self.group = group = self.groups.shard
        self.rank, self.world_size = collectives.rank(group), collectives.world_size(group)
        self.canonical: list[Tensor] = [p for g in optimizer.param_groups for p in g["params"]]
        self.group_sizes = [len(g["params"]) for g in optimizer.param_groups]
        check_params(self.canonical, optimizer)
        members = split_members(self.canonical, owners)
        self.managed = members.managed
        """Canonical index (in the user's param groups) of each member: owned parameters first, then borrowed."""
        self.members = [self.canonical[i] for i in self.managed]
        """The trainable parameters of the optimizer: ``params``, then those borrowed from earlier engines."""
        self.params = self.members[: members.owned]
        """The parameters this engine owns: laid out, stored and reduced here."""
        self.sources: list[ShardedOptimizer] = [self, *members.owners]
        """This engine and the engines it borrows from, whose gradients its step needs (the same on every rank)."""
        self._borrowed = members.borrowed
        group_of = {id(p): g for g, grp in enumerate(optimizer.param_groups) for p in grp["params"]}
        self.param_units = [unit_of(p) if unit_of is not None else 0 for p in self.params]
        self.bucket_elements = config.bucket_elements(sum(p.numel() for p in self.params))
        self.layout: FlatLayout = plan_layout(
            [p.numel() for p in self.params],
            [group_of[id(p)] for p in self.params],
            self.world_size,
            self.bucket_elements,
            whole_params=not is_elementwise(optimizer, config) if whole_params is None else whole_params,
            ready_order=backward_order(self.params, module),
            units=self.param_units if self.by_units else None,
        )
        self._flat_order = sorted(range(len(self.params)), key=lambda j: self.layout.offsets[j])
        self.slots = plan_master_slots(self.layout, self.rank, [tuple(p.shape) for p in self.params])
        self.device = device
        moved = config.offload_optimizer  # see [Note: what lives where with offload_optimizer=True] in offload.py
        self.host_grads: Optional[offload.HostGrads] = offload.HostGrads(
            self.layout.shard_size, master_dtype, device, max((b.chunk_size for b in self.layout.buckets), default=0),
            config.bucket_buffers) if moved else None
        """With ``offload_optimizer``, the gradient shard itself (the reducer keeps none on the device)."""
        self.master_storage: Optional[Tensor] = None
        """The master shard (``None`` where the working shard doubles as the master: stages 1 and 2, one dtype)."""
        self._make_storage(working_dtype, master_dtype, moved, config)
        self.windowed: Optional[disk.WindowedStep] = disk.WindowedStep(optimizer, config.offload_path) \
            if config.offload_optimizer == disk.DISK else None
        """With ``offload_optimizer="disk"``: the step window by window (see [Note: the step one window at a time])."""
        self.slot_sources: list[ShardedOptimizer] = [self] * len(self.slots)
        """The engine whose shard each slot's ``start`` refers to (``self``, or the owner of borrowed parameters)."""
        for source, slot in borrowed_slots(self.members, members.owned, group_of, self.sources[1:]):
            self.slots.append(slot)
            self.slot_sources.append(source)
        self.masters = [source._master_view(s) for source, s in zip(self.slot_sources, self.slots)]
        self.reducer = GradientReducer(
            self.layout, self.rank, working_dtype, device, config.bucket_buffers, config.overlap_comm, self.groups,
            unit_names if self.by_units else (), sink=self.host_grads,
        )
        self._hooks: list[Any] = []
        self._prepared = False
        self._overflow = False
        self.uninstalled = False
        self._install_into(optimizer)
        if policy.grad_hooks_at_setup:
            self.install_grad_hooks()

    by_units: ClassVar[bool] = False
    """Whether the layout follows stage 3's units (each bucket within one unit)."""

    def _make_storage(self, working_dtype: torch.dtype, master_dtype: torch.dtype, offload_optimizer: bool,
                      config: ZeroConfig) -> None:
        """Make the working storage and ``master_storage`` (see [Note: two storages, one step])."""
        raise NotImplementedError

    def _master_view(self, slot: MasterSlot) -> Tensor:
        """The master tensor of ``slot``: a view of this engine's master shard (or of the working buffer)."""
        raise NotImplementedError

    def refresh_working(self) -> None:
        """Bring the master shard's values to the working parameters (after a step, or a checkpoint load)."""
        raise NotImplementedError

    def gather_full_master(self) -> Tensor:
        """Every rank gets the full flat buffer in the master dtype (a collective; used to hand fp32 weights back)."""
        assert self.master_storage is not None
        full = torch.zeros(self.layout.total, dtype=self.master_storage.dtype, device=self.device)
        for bucket in self.layout.buckets:
            b0, b1 = self.layout.bucket_range(bucket)
            c0, _ = self.layout.chunk_range(bucket, self.rank)
            chunk = self.master_storage[bucket.shard_offset : bucket.shard_offset + bucket.chunk_size]
            full[c0 : c0 + bucket.chunk_size].copy_(chunk)
            collectives.all_gather(full[b0:b1], full[c0 : c0 + bucket.chunk_size], group=self.group)
        return full

    def _hand_back(self, gather: bool) -> None:
        """At uninstall: give the parameters full storage again (``gather``), or leave none dangling."""
        raise NotImplementedError

    def settle(self) -> None:
        """Wait for copies still reading host memory that a step or load is about to write (stage 3 offload)."""

    @property
    def working_shard(self) -> Optional[Tensor]:
        """Stage 3's persistent working shard (``None`` for the flat buffer of stages 1 and 2)."""
        return None

    @property
    def params_offloaded(self) -> bool:
        """Whether the working shard lives in host memory (``offload_params``)."""
        return False

    def install_grad_hooks(self) -> None:
        """Stages 2 and 3: hand each gradient to the reducer as soon as it is accumulated, then drop ``.grad``.

        Stage 3 calls this once the parameters are materialized (materialization swaps tensors, hooks and all).
        """
        what = "the gradient hook of stages 2 and 3"
        self._hooks = [p.register_post_accumulate_grad_hook(eager_hook(self._make_hook(j), what))
                       for j, p in enumerate(self.params)]

    # ------------------------------------------------------------------ setup
    def _copy_pieces(self, buckets: list[Bucket], shard: Tensor) -> None:
        """Write this rank's pieces of the (full) parameters in ``buckets`` into a shard-shaped tensor."""
        with torch.no_grad():
            for bucket in buckets:
                for pc in self.layout.pieces(bucket, self.rank):
                    values = self.params[pc.param].detach().reshape(-1)[pc.param_start : pc.param_start + pc.length]
                    at = bucket.shard_offset + pc.chunk_offset
                    shard[at : at + pc.length].copy_(values)
                disk.evict([shard[bucket.shard_offset : bucket.shard_offset + bucket.chunk_size]])

    def _install_into(self, optimizer: Optimizer) -> None:
        for g, group in enumerate(optimizer.param_groups):
            group["params"] = [m for m, s in zip(self.masters, self.slots) if s.group == g]
        optimizer.__class__ = zero_subclass(type(optimizer))
        optimizer._zero_engine = self  # type: ignore[attr-defined]

    def _make_hook(self, index: int) -> Any:
        def hook(param: Tensor) -> None:
            if param.grad is not None:
                self.reducer.add_grad(index, param.grad)
                param.grad = None

        return hook

    # ------------------------------------------------------------------ step
    def finish_backward(self) -> None:
        """End of one backward pass: stage 2 launches the partly filled buckets and waits for all of them."""
        if self.policy.reduces_in_backward and not self.uninstalled:
            self.reducer.flush(force=True)
            self.reducer.wait()

    def prepare_step(self, unscale: Optional[Callable[[list[Tensor]], bool]] = None) -> bool:
        """Reduce what is left (here and in the engines lending parameters) and give every master tensor its averaged
        gradient (in the master dtype); ``unscale`` (``16-mixed``) then unscales them and tells whether any rank
        overflowed, which is returned.

        Idempotent until the step: manual optimization may clip (which needs the reduced gradients) before
        ``optimizer.step()`` prepares again.
        """
        if self._prepared:
            return self._overflow
        self._prepared = True
        for source in self.sources:  # the step may write a host master that is also the host parameter shard
            source.settle()
        shards = {id(source): source.reduce_grads() for source in self.sources}
        for slot, master, source in zip(self.slots, self.masters, self.slot_sources):
            grad = shards[id(source)][slot.start : slot.start + slot.length].view(slot.shape)
            master.grad = grad if grad.dtype == master.dtype else grad.to(master.dtype)
        self._overflow = unscale(self.grads()) if unscale is not None else False
        return self._overflow

    def reduce_grads(self) -> Tensor:
        """Reduce the owned parameters' gradients not reduced yet (a collective); returns this rank's gradient shard,
        which keeps the sum until :meth:`zero_grad` (with ``offload_optimizer`` it lives in host memory, see
        ``offload.py``)."""
        if not self.policy.reduces_in_backward:
            for j in self._flat_order:
                p = self.params[j]
                if p.grad is not None:
                    self.reducer.add_grad(j, p.grad)
                    p.grad = None
        # stage 2 flushed at the end of every backward; only a backward run outside Lightning can have left work
        shard = self.reducer.finalize(force=not self.policy.reduces_in_backward)
        self.reducer.release_buffers()  # the step needs none: their memory is free for its temporaries
        return shard

    def own_masters(self) -> list[tuple[MasterSlot, Tensor]]:
        """The slots in this engine's own shard (its owned parameters) with their master tensors."""
        return [(slot, master) for slot, master, source in zip(self.slots, self.masters, self.slot_sources)
                if source is self]

    def step(self, call: Callable[[], Any]) -> Any:
        """Run the user's ``optimizer.step`` (``call``): for elementwise optimizers in pieces of at most one bucket's
        elements, so that its temporaries stay that small (see [Note: the step in constant-size pieces])."""
        if self.windowed is not None:
            limit = None if self.layout.whole_params else self.bucket_elements
            return self.windowed.run(call, limit, self._piece_stepped())
        if self.layout.whole_params:
            return call()
        return step_in_pieces(self.optimizer, self.bucket_elements, call, self._piece_stepped())

    def step_once(self, call: Callable[[], Any]) -> Any:
        """Run the user's ``optimizer.step`` (``call``) as one call (:attr:`steps_once`), as one window on disk."""
        return self.windowed.run(call, None) if self.windowed is not None else call()

    def _piece_stepped(self) -> Optional[Callable[[list[Tensor]], None]]:
        """What to do with the master tensors of each piece once it is stepped (stages 1 and 2 start their refresh);
        ``None``: nothing before :meth:`after_step`."""
        return None

    @property
    def steps_once(self) -> bool:
        """Whether :meth:`step` makes one ``optimizer.step`` call (not pieces: see [Note: the step in constant-size
        pieces] in ``optimizer_support.py``)."""
        return self.layout.whole_params or not steps_in_pieces(self.optimizer, self.bucket_elements)

    def grads(self) -> list[Tensor]:
        """The master gradients of this rank (valid between :meth:`prepare_step` and :meth:`after_step`)."""
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
        """Drop the master gradients (the shard keeps the reduced sum, see [Note: gradients live until zero_grad])
        and, if the optimizer stepped, bring the update to the working parameters of every engine it stepped on:
        stages 1 and 2 all-gather it into the full buffer, stage 3 casts it into the working shard."""
        self._prepared = False
        for m in self.masters:
            m.grad = None
        if stepped:
            for source in self.sources:
                source.refresh_working()

    def zero_grad(self) -> None:
        """Drop the gradients of every parameter of the optimizer: master grads, stage 1's full ``.grad`` and the
        reduced gradients, here and, for borrowed parameters, in their owners' shards (no communication)."""
        for m in self.masters:
            m.grad = None
        self.clear_grads(None)
        for source in self.sources[1:]:
            source.clear_grads(self._borrowed[id(source)])

    def clear_grads(self, indices: Optional[Sequence[int]]) -> None:
        """Drop the gradients of the owned parameters ``params[j]`` for ``j`` in ``indices`` (``None``: all)."""
        self._prepared = False
        for _, m in self.own_masters():
            m.grad = None
        if indices is None or len(set(indices)) == len(self.params):
            for p in self.params:
                p.grad = None
            # [Note: the gradient shard is freed at zero_grad] as ``set_to_none`` frees ``.grad``: Lightning calls
            # zero_grad between forward and backward, so a kept shard (4Ψ/N bytes in fp32) would sit on top of the
            # activations at the start of backward, the peak of a step; it is made again by the first reduction.
            self.reducer.clear()
            return
        for j in indices:
            self.params[j].grad = None
        self.reducer.clear_params(indices)

    def remove_hooks(self) -> None:
        """Remove the gradient hooks (the shards stay as they are)."""
        for handle in self._hooks:
            handle.remove()
        self._hooks = []

    # ------------------------------------------------------------------ teardown
    def uninstall(self, gather: bool = True) -> None:
        """Remove the hooks and, with ``gather`` (a collective), give the parameters their full fp32 storage back.

        The master shard and the optimizer state stay, so a checkpoint can still be saved after ``fit`` returns.
        Without ``gather`` (after an exception, see [Note: teardown after an exception]) nothing waits on or talks to
        the other ranks.
        """
        if self.uninstalled:
            return
        self.uninstalled = True
        self.remove_hooks()
        if gather:
            for m in self.masters:
                m.grad = None
            self.clear_grads(None)
            self.reducer.release_buffers()
        self._hand_back(gather)

    def _full_values_back(self) -> None:
        """Make every parameter a view of the full master buffer (the gathered fp32 values)."""
        if any(p.is_meta for p in self.params):
            return  # setup failed before the parameters were materialized: nothing to hand back
        full = self.gather_full_master()
        for p, offset in zip(self.params, self.layout.offsets):
            p.data = full[offset : offset + p.numel()].view(p.shape)
