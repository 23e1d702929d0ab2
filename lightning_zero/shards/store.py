"""The parameter store: where the managed parameters live, with or without optimizers.

[Note: the store and the optimizers]
``ParameterStore`` belongs to the engine and exists from setup on, whether or not optimizers were given. It
holds one ``ShardedStorage`` per layout: the layout itself, the working storage (stages 1 and 2: one full flat
buffer; stage 3: the working shard and the unit buffers), the master shard of the laid-out parameters, the gradient
reducer and the gradient hooks. An optimizer (``ShardedOptimizer``) keeps only
its master slots (views of a storage's master shard: its own storage's and those it borrows) and its step.

The layout depends on the optimizer: its param groups (a bucket never mixes two) and whether it is elementwise
(flat slices) or needs whole tensors. So there is one storage per optimizer that owns parameters, laid out for it.
Evaluation under stage 3 (no optimizer) gets one storage over the trainable parameters, laid out as one group of
flat slices, and no optimizer object at all. Optimizers set up later (Fabric's ``setup_module`` then
``setup_optimizers``) get storages laid out for them, and the weights move from the evaluation storage one unit at a
time (``move_units``: gathered, filled into the new storages, freed), so no
rank ever holds more than one unit in full. The alternative, keeping the evaluation layout and mapping each
optimizer's master slots onto it, would save that one move but needs a layout that serves every param group
split and whole-tensor optimizers at once (buckets cut at group boundaries the store cannot know before the
optimizers exist); the move happens once per run, so the store is re-laid out instead.
"""

from __future__ import annotations

from typing import Any, Callable, ClassVar, Optional, Sequence

import torch
from torch import Tensor

from lightning_zero.comm import collectives
from lightning_zero.comm.groups import ShardGroups
from lightning_zero.memory.heap_pin import HeapPin
from lightning_zero.shards import disk, offload
from lightning_zero.shards.buckets import GradientReducer
from lightning_zero.shards.compiled import eager_hook
from lightning_zero.shards.layout import Bucket, FlatLayout, MasterSlot, plan_layout, plan_master_slots
from lightning_zero.shards.optimizer_support import backward_order
from lightning_zero.shards.policy import StorePolicy
from lightning_zero.stages import StagePolicy


class ShardedStorage:
    """One layout's storage: the working parameters, the master shard, the gradient reducer and the gradient hooks
    of ``params`` (see [Note: the store and the optimizers]).

    [Note: two storages, one step]
    What differs between the stages is where the working parameters live, so that is what the two subclasses hold:
    ``FlatStorage`` (stages 1 and 2: one full flat working buffer on every rank,
    refreshed by an all-gather after the step) and ``PartitionedStorage``
    (stage 3: a working shard, units gathered around their use). The layout, the reduction of gradients and the
    master shard are this class's; the step on the masters is the optimizer's.

    ``param_groups[j]`` is the optimizer param group of ``params[j]`` (a bucket never mixes two); ``whole_params``
    whether the master slots are whole tensors rather than flat slices. ``groups`` are the process groups it shards
    over and replicates across (default: the world; see [Note: hybrid sharding and its traffic] in ``groups.py``).
    """

    by_units: ClassVar[bool] = False
    """Whether the layout follows stage 3's units (each bucket within one unit)."""

    def __init__(
        self,
        params: list[Tensor],
        param_groups: Sequence[int],
        whole_params: bool,
        policy: StagePolicy,
        store_policy: StorePolicy,
        working_dtype: torch.dtype,
        master_dtype: torch.dtype,
        device: torch.device,
        module: Optional[torch.nn.Module] = None,
        unit_of: Optional[Callable[[Tensor], int]] = None,
        groups: Optional[ShardGroups] = None,
        unit_names: Sequence[str] = (),
    ) -> None:
        self.policy = policy
        self.store_policy = store_policy
        self.groups = groups if groups is not None else ShardGroups()
        self.group = self.groups.shard
        self.rank, self.world_size = collectives.rank(self.group), collectives.world_size(self.group)
        self.params = params
        """The parameters laid out, stored and reduced here (each in one storage only)."""
        self.param_units = [unit_of(p) if unit_of is not None else 0 for p in params]
        self.bucket_elements = store_policy.bucket_elements(sum(p.numel() for p in params))
        self.layout: FlatLayout = plan_layout(
            [p.numel() for p in params],
            list(param_groups),
            self.world_size,
            self.bucket_elements,
            whole_params=whole_params,
            ready_order=backward_order(params, module),
            units=self.param_units if self.by_units else None,
        )
        self._flat_order = sorted(range(len(params)), key=lambda j: self.layout.offsets[j])
        self.slots = plan_master_slots(self.layout, self.rank, [tuple(p.shape) for p in params])
        """This rank's master slots of ``params`` (an optimizer steps on them, see ``optimizer.py``)."""
        self.device = device
        moved = (
            store_policy.offload.offload_optimizer
        )  # see [Note: what lives where with offload_optimizer=True] in offload.py
        self.host_grads: Optional[offload.HostGrads] = (
            offload.HostGrads(
                self.layout.shard_size,
                master_dtype,
                device,
                max((b.chunk_size for b in self.layout.buckets), default=0),
                store_policy.bucket_buffers,
            )
            if moved
            else None
        )
        """With ``offload_optimizer``, the gradient shard itself (the reducer keeps none on the device)."""
        self.master_storage: Optional[Tensor] = None
        """The master shard (``None`` where the working storage doubles as the master: stages 1 and 2, one dtype)."""
        self._make_storage(working_dtype, master_dtype)
        self.masters = [self.master_view(s) for s in self.slots]
        """The master tensor of each slot (the owning optimizer steps on these very tensors)."""
        self.reducer = GradientReducer(
            self.layout,
            self.rank,
            working_dtype,
            device,
            store_policy.bucket_buffers,
            store_policy.overlap_comm,
            self.groups,
            unit_names if self.by_units else (),
            sink=self.host_grads,
            quantize_block=store_policy.gradient_block,
            heap_pin=HeapPin() if self._pins_heap(device) else None,
        )
        self._hooks: list[Any] = []
        self.holding = False
        """Inside ``no_backward_sync`` under stage 1: the gradients stay in ``.grad`` (see [Note: stage 1 reduces
        in the backward the step follows])."""
        self._reduced_in_backward = False  # the last backward reduced every gradient: nothing is left for the step
        self.uninstalled = False
        self.clears = 0
        """How many times ``clear_grads`` ran (an optimizer's reduced gradients are stale once it moved)."""

    def _pins_heap(self, device: torch.device) -> bool:
        """Whether the reducer keeps a pin at the top of the host heap (see [Note: the heap pin] in ``heap_pin.py``):
        every stage on a CPU (stage 3's gathered units come from its pool, but the activations are the heap's)."""
        return device.type == "cpu"

    def _make_storage(self, working_dtype: torch.dtype, master_dtype: torch.dtype) -> None:
        """Make the working storage and ``master_storage`` in the tiers of ``store_policy.offload`` (see [Note: two
        storages, one step])."""
        raise NotImplementedError

    def master_view(self, slot: MasterSlot) -> Tensor:
        """The master tensor of ``slot``: a view of this storage's master shard (or of the working buffer)."""
        raise NotImplementedError

    def own_masters(self) -> list[tuple[MasterSlot, Tensor]]:
        """This rank's slots of the parameters laid out here, with their master tensors."""
        return list(zip(self.slots, self.masters))

    def refresh_working(self) -> None:
        """Bring the master shard's values to the working parameters (after a step, or a checkpoint load)."""
        raise NotImplementedError

    def refresh_as_stepped(self) -> Optional[Callable[[list[Tensor]], None]]:
        """What to do with the master tensors of each piece of a step in pieces once it is stepped (stages 1 and 2
        start their refresh); ``None``: nothing before ``refresh_working``."""
        return None

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
        self._hooks = [
            p.register_post_accumulate_grad_hook(eager_hook(self._make_hook(j), what))
            for j, p in enumerate(self.params)
        ]

    def _make_hook(self, index: int) -> Any:
        def hook(param: Tensor) -> None:
            if param.grad is not None and not self.holding:
                self.reducer.add_grad(index, param.grad)
                param.grad = None

        return hook

    def remove_hooks(self) -> None:
        """Remove the gradient hooks (the shards stay as they are)."""
        for handle in self._hooks:
            handle.remove()
        self._hooks = []

    def _copy_pieces(self, buckets: Sequence[Bucket], shard: Tensor) -> None:
        """Write this rank's pieces of the (full) parameters in ``buckets`` into a shard-shaped tensor."""
        with torch.no_grad():
            for bucket in buckets:
                for pc in self.layout.pieces(bucket, self.rank):
                    values = self.params[pc.param].detach().reshape(-1)[pc.param_start : pc.param_start + pc.length]
                    at = bucket.shard_offset + pc.chunk_offset
                    shard[at : at + pc.length].copy_(values)
                disk.evict([shard[bucket.shard_offset : bucket.shard_offset + bucket.chunk_size]])

    # ------------------------------------------------------------------ gradients
    def hold_grads(self, holding: bool) -> None:
        """Enter (``True``) or leave ``no_backward_sync``: under stage 1 the next backwards keep full ``.grad``.

        [Note: stage 1 reduces in the backward the step follows]
        Stage 1 reduce-scatters in buckets during backward, as stage 2 does (DDP overlaps its all-reduce with backward
        the same way), whenever the step follows that backward. Inside ``no_backward_sync`` (Lightning's
        ``accumulate_grad_batches``, ``fabric.no_backward_sync``, ``ZeroEngine.no_backward_sync``) the hooks leave
        the gradients in ``.grad``, where autograd accumulates them, and the backward after it reduces them once: one
        reduce-scatter per step whatever the accumulation (stage 2 reduces every backward). Entering it frees the
        gradient shard kept between steps if it holds nothing yet, so full gradients and the shard are never held at
        once: the paper's 4Ψ + 4Ψ + 8Ψ/N (fp32). Without the context every backward reduces, which is always
        correct (the shard accumulates), as DDP all-reduces every backward without ``no_sync``.
        """
        self.holding = holding and self.policy.holds_grads_when_accumulating
        if self.holding:
            self.reducer.release_unwritten_shard()

    def finish_backward(self) -> None:
        """End of one backward pass: launch the partly filled buckets and wait for all of them (stage 1: unless it
        holds its gradients, after adding those an earlier held backward left that this one did not reach)."""
        if self.uninstalled or not self.policy.reduces_in_backward:
            return
        if self.holding:
            self._reduced_in_backward = False
            return
        self._add_held_grads()
        self.reducer.flush(force=True)
        self.reducer.wait()
        self._reduced_in_backward = True

    def _add_held_grads(self) -> None:
        """Hand the gradients still in ``.grad`` (stage 1: held by ``no_backward_sync``) to the reducer."""
        if not self.policy.holds_grads_when_accumulating:
            return
        for j in self._flat_order:
            p = self.params[j]
            if p.grad is not None:
                self.reducer.add_grad(j, p.grad)
                p.grad = None

    def reduce_grads(self) -> Tensor:
        """Reduce the gradients not reduced yet (a collective); returns this rank's gradient shard, which keeps the
        sum until ``clear_grads`` (with ``offload_optimizer`` it lives in host memory, see ``offload.py``)."""
        # every backward run through the engine reduced already; stage 1 reduces here what a held backward (or one
        # run outside Lightning and the engine) left, launching every bucket not launched yet on every rank
        late = self.policy.holds_grads_when_accumulating and not self._reduced_in_backward
        if late:
            self._add_held_grads()
        # the bucket buffers stay for the next step (see [Note: constant memory] in buckets.py)
        return self.reducer.finalize(force=late)

    def clear_grads(self, indices: Optional[Sequence[int]]) -> None:
        """Drop the gradients of ``params[j]`` for ``j`` in ``indices`` (``None``: all), master grads included."""
        self.clears += 1
        self._reduced_in_backward = False
        for m in self.masters:
            m.grad = None
        if indices is None or len(set(indices)) == len(self.params):
            for p in self.params:
                p.grad = None
            # [Note: the gradient shard is kept] ``set_to_none`` frees each ``.grad``, but the gradient shard stays
            # allocated: made again each step it would be a fresh allocation of 4Ψ/N bytes (in fp32), above glibc's
            # mmap threshold from tens of millions of parameters on, so a page fault per 4 KiB of it every step. It
            # costs 4Ψ/N bytes during forward, less than DDP's own reducer keeps for the whole run (its buckets, 4Ψ).
            # Clearing only marks it unwritten: each bucket's next reduction overwrites its slice. Stage 1 frees it
            # when its gradients are held instead (see [Note: stage 1 reduces in the backward the step follows]),
            # also when the gradients are cleared inside the hold (Lightning zeroes them in its first accumulating
            # micro-batch, after entering the hold).
            self.reducer.clear(keep_shard=not self.holding)
            return
        for j in indices:
            self.params[j].grad = None
        self.reducer.clear_params(indices)

    # ------------------------------------------------------------------ teardown
    def uninstall(self, gather: bool = True) -> None:
        """Remove the hooks and, with ``gather`` (a collective), give the parameters their full fp32 storage back.

        The master shard stays, so a checkpoint can still be saved after ``fit`` returns. Without ``gather`` (after an
        exception, see [Note: teardown after an exception]) nothing waits on or talks to the other ranks.
        """
        if self.uninstalled:
            return
        self.uninstalled = True
        self.remove_hooks()
        if gather:
            self.clear_grads(None)
            self.reducer.release_buffers()
        try:
            self._hand_back(gather)
        except RuntimeError:
            if gather:  # a peer did not join the gather: no parameter may be left without readable values
                self._hand_back(False)
            raise

    def _full_values_back(self) -> Optional[Tensor]:
        """Make every parameter a view of the full master buffer (the gathered fp32 values); returns that buffer
        (``None`` where nothing was materialized)."""
        if any(p.is_meta for p in self.params):
            return None  # setup failed before the parameters were materialized: nothing to hand back
        full = self.gather_full_master()
        for p, offset in zip(self.params, self.layout.offsets):
            p.data = full[offset : offset + p.numel()].view(p.shape)
        return full


class ParameterStore:
    """The engine's storages of the managed parameters, with or without optimizers (see [Note: the store and the
    optimizers]); each managed parameter lies in exactly one of them."""

    def __init__(self) -> None:
        self.storages: list[ShardedStorage] = []

    def add(self, storage: ShardedStorage) -> ShardedStorage:
        """Take ``storage`` (its parameters must not be in the store yet)."""
        self.storages.append(storage)
        return storage

    @property
    def params(self) -> list[Tensor]:
        """Every managed parameter, storage by storage."""
        return [p for storage in self.storages for p in storage.params]

    def param_units(self) -> dict[int, int]:
        """``id(param)`` to its stage 3 unit, for every managed parameter."""
        return {id(p): unit for storage in self.storages for p, unit in zip(storage.params, storage.param_units)}

    def hold_grads(self, holding: bool) -> None:
        """Enter or leave ``no_backward_sync`` in every storage (see ``ShardedStorage.hold_grads``)."""
        for storage in self.storages:
            storage.hold_grads(holding)

    def finish_backward(self) -> None:
        """After one backward: every storage launches its partly filled buckets and waits for them."""
        for storage in self.storages:
            storage.finish_backward()

    def uninstall(self, gather: bool) -> None:
        """Uninstall every storage (see ``ShardedStorage.uninstall``); once a gather fails, the storages after it
        are uninstalled without one, and the failure is raised after."""
        failure: Optional[RuntimeError] = None
        for storage in self.storages:
            try:
                storage.uninstall(gather and failure is None)
            except RuntimeError as error:
                failure = failure or error
        if failure is not None:
            raise failure
