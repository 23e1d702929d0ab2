"""ZeRO-R for activations: which blocks recompute in backward, and where their checkpoints live.

[Note: wrapping a block without changing the user's module]
A chosen block keeps its class, parameters, hooks and state-dict keys; only its *instance* gets a ``forward``
attribute that runs the original ``forward`` under non-reentrant ``torch.utils.checkpoint`` with the RNG state
preserved (dropout draws the same mask when recomputed; autocast is replayed by checkpoint itself). Module hooks run
in ``nn.Module.__call__`` around ``forward``, so they stay outside the checkpoint: stage 3's pre-forward hook gathers
the unit once for the real forward and its post-forward hook frees it; in backward the hook on the block's output
gathers it once more, before the recomputation reads the parameters, so a checkpointed unit costs one all-gather in
backward, as without checkpointing. Wrapping is idempotent and ``ActivationCheckpointing.remove`` undoes it.
Under ``torch.no_grad`` (validation) a block runs plainly.

[Note: what a checkpoint holds]
Non-reentrant checkpointing keeps nothing of the block's interior: it saves the block's *inputs* through the default
saved-tensor hooks, then pushes its own hooks for everything inside. ``ActivationStore``'s hooks are pushed
around each checkpoint call only, so they see exactly the block inputs (the paper's activation checkpoints) and
decide where these live: on the device as they are (no copy), in host memory (Pa+cpu), as this rank's 1/k slice (Pa),
and/or inside one preallocated buffer (MD). Autograd reattaches the input's ``grad_fn`` on unpack, so unpack only has
to return the right values. On a CPU-only machine the host *is* the device: offload keeps the tensor where it is.

[Note: Pa, partitioned checkpoints]
Partitioning saves memory only where k ranks hold *identical* activations: tensor (model) parallelism, where every
rank of a TP group sees the same block input. Each rank keeps slice ``rank`` of the flattened input (padded to a
multiple of k); the slices are all-gathered before the recomputation, in backward order, which every rank of the group
follows. The data-parallel ranks see different data, so no group of them holds identical activations: with
``tensor_parallel_size=t`` Pa partitions over the tensor group by default (the paper's Pa: ZeRO over the data
dimension, model parallelism inside the node); ``activation_partition_group`` names the group of a module that runs
its own tensor parallelism otherwise. The first checkpoint of every store is compared across the group (a
fingerprint all-reduce), and a mismatch fails with an error instead of silently training on another rank's values.

[Note: contiguous checkpoints (MD)]
With ``contiguous=True`` the checkpoints of a forward are copied end to end into one preallocated buffer instead of
being many separate allocations that live from forward to backward between short-lived temporaries (the allocator's
fragmentation pattern). The buffer is sized after the first step (the bytes that step needed, aligned) and grown only
if a later step needs more; a checkpoint that does not fit is allocated on its own and counted in ``fallbacks``. The
buffer is written from its start again only once no checkpoint is alive (the backward is over, the whole graph and
any recomputed tensor viewing the buffer is gone), so a retained graph can never be overwritten.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence, Union

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from lightning_zero.activations.blocks import find_blocks
from lightning_zero.comm import collectives

PartitionGroup = Union[Sequence[int], Sequence[Sequence[int]], Callable[[], Any], None]
_ALIGN = 64  # bytes; every checkpoint in the contiguous buffer starts at a multiple of this


@dataclass
class ActivationStats:
    """What the checkpoints of this rank hold and did, since the store was made."""

    packed: int = 0
    """Block inputs checkpointed (one per checkpointed block per forward)."""
    unpacked: int = 0
    """Block inputs brought back for a recomputation."""
    live_bytes: int = 0
    """Bytes this rank holds for checkpoints right now (device or host)."""
    peak_bytes: int = 0
    full_bytes: int = 0
    """Bytes the live checkpoints would take whole (equals ``live_bytes`` unless partitioned)."""
    peak_full_bytes: int = 0
    host_bytes: int = 0
    """Of ``live_bytes``, bytes copied to host memory (0 on a CPU-only machine, see [Note: what a checkpoint holds])."""
    gathers: int = 0
    """All-gathers of partitioned checkpoints (Pa)."""
    buffer_bytes: int = 0
    """Size of the contiguous checkpoint buffer (MD)."""
    in_buffer: int = 0
    """Checkpoints copied into the contiguous buffer."""
    fallbacks: int = 0
    """Checkpoints that did not fit the contiguous buffer once it existed."""


class _Saved:
    """One checkpointed tensor as this rank keeps it; releases its bytes from the stats when autograd drops it."""

    def __init__(self, store: "ActivationStore", data: Tensor, like: Tensor, chunk: int) -> None:
        self.store, self.data, self.chunk = store, data, chunk
        self.shape, self.device, self.numel = like.shape, like.device, like.numel()
        self.bytes = data.numel() * data.element_size()
        self.full = like.numel() * like.element_size()
        self.on_host = data.device != like.device

    def __del__(self) -> None:
        self.store._release(self)


class _Buffer:
    """The contiguous checkpoint buffer (see [Note: contiguous checkpoints (MD)])."""

    def __init__(self) -> None:
        self.data: Optional[Tensor] = None
        self.offset = 0
        self.needed = 0

    def place(self, t: Tensor, device: torch.device) -> Optional[Tensor]:
        """A view of the buffer on ``device`` shaped like ``t`` (to copy ``t`` into); ``None`` if it does not fit."""
        nbytes = t.numel() * t.element_size()
        size = -(-nbytes // _ALIGN) * _ALIGN
        self.needed += size
        if self.data is None or self.data.device != device or self.offset + size > self.data.numel():
            return None
        view = self.data[self.offset : self.offset + nbytes].view(t.dtype).view(t.shape)
        self.offset += size
        return view

    def restart(self, device: Optional[torch.device]) -> None:
        """No checkpoint is alive: grow to what the last round needed, write from the start again."""
        if device is not None and (self.data is None or self.needed > self.data.numel()):
            self.data = None  # the old one goes before the new one comes
            pin = device.type == "cpu" and torch.cuda.is_available()
            self.data = torch.empty(self.needed, dtype=torch.uint8, device=device, pin_memory=pin)
        self.offset = 0
        self.needed = 0


class ActivationStore:
    """Saved-tensor hooks for checkpoint inputs: offload (Pa+cpu), partition (Pa), contiguous buffer (MD)."""

    def __init__(self, offload: bool = False, group: Optional[Any] = None, contiguous: bool = False) -> None:
        self.offload = offload
        self.group = group if collectives.world_size(group) > 1 else None
        self.contiguous = contiguous
        self.stats = ActivationStats()
        self._buffer = _Buffer() if contiguous else None
        self._buffer_device: Optional[torch.device] = None
        self._live = 0
        self._verified = False
        self._stream: Optional[Any] = None

    def __deepcopy__(self, memo: dict) -> "ActivationStore":
        return self  # a deep copy of the module (EMA callbacks) checkpoints into the same store

    def saving(self) -> Any:
        """The context in which checkpoint saves the block inputs (see [Note: what a checkpoint holds])."""
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)

    # ------------------------------------------------------------------ pack
    def pack(self, t: Tensor) -> Union[Tensor, _Saved]:
        """Keep ``t`` where the options say; parameters and empty tensors are kept as they are."""
        if isinstance(t, nn.Parameter) or t.numel() == 0:
            return t
        data, chunk = t.detach(), 0
        if self.group is not None and t.is_floating_point():
            if not self._verified:
                self._check_identical(data)
            data, chunk = self._own_slice(data)
        target = torch.device("cpu") if self.offload else data.device
        placed = self._buffer.place(data, target) if self._buffer is not None else None
        if placed is not None:
            self._stream = _copy(placed, data, self._stream)
            data = placed
            self.stats.in_buffer += 1
        else:
            if self._buffer is not None and self._buffer.data is not None:
                self.stats.fallbacks += 1
            self._buffer_device = target
            data = self._to(data, target, copy=chunk > 0)
        saved = _Saved(self, data, t, chunk)
        self._live += 1
        stats = self.stats
        stats.packed += 1
        stats.live_bytes += saved.bytes
        stats.full_bytes += saved.full
        stats.host_bytes += saved.bytes if saved.on_host else 0
        stats.peak_bytes = max(stats.peak_bytes, stats.live_bytes)
        stats.peak_full_bytes = max(stats.peak_full_bytes, stats.full_bytes)
        return saved

    def _own_slice(self, data: Tensor) -> tuple[Tensor, int]:
        """This rank's slice of the flattened tensor (a view: the caller copies it) and the slice length."""
        k, r = collectives.world_size(self.group), collectives.rank(self.group)
        chunk = -(-data.numel() // k)
        return data.reshape(-1)[r * chunk : (r + 1) * chunk], chunk

    def _check_identical(self, data: Tensor) -> None:
        """Fail unless every rank of the group holds this same tensor (see [Note: Pa, partitioned checkpoints])."""
        x = data.reshape(-1).double()
        weights = torch.arange(x.numel(), dtype=torch.float64, device=x.device) % 97 + 1
        fingerprint = torch.stack([x.sum(), (x * weights).sum()])
        both = collectives.all_reduce(torch.cat([fingerprint, -fingerprint]), op=collectives.MAX, group=self.group)
        if not torch.equal(both[:2], -both[2:]):
            raise RuntimeError(
                "activation_partition_group: the ranks of the group hold different checkpointed activations, so "
                "each cannot keep a slice of them. Name only ranks that see identical block inputs (a tensor-"
                "parallel group); data-parallel ranks see different data."
            )
        self._verified = True

    def _to(self, data: Tensor, device: torch.device, copy: bool) -> Tensor:
        if data.device == device:
            return data.clone() if copy else data
        out = torch.empty(data.shape, dtype=data.dtype, device=device, pin_memory=device.type == "cpu" and data.is_cuda)
        self._stream = _copy(out, data, self._stream)
        return out

    # ------------------------------------------------------------------ unpack
    def unpack(self, saved: Union[Tensor, _Saved]) -> Tensor:
        """The checkpoint's values on its device, whole (all-gathered under Pa)."""
        if isinstance(saved, Tensor):
            return saved
        self.stats.unpacked += 1
        data = saved.data
        if data.device != saved.device:
            if self._stream is not None:
                torch.cuda.current_stream(saved.device).wait_stream(self._stream)
            data = data.to(saved.device, non_blocking=True)
        if saved.chunk:
            data = self._gather(data, saved.chunk)[: saved.numel]
        return data.view(saved.shape)

    def _gather(self, local: Tensor, chunk: int) -> Tensor:
        k, r = collectives.world_size(self.group), collectives.rank(self.group)
        full = torch.empty(chunk * k, dtype=local.dtype, device=local.device)
        mine = full[r * chunk : (r + 1) * chunk]
        mine[: local.numel()].copy_(local.reshape(-1))
        collectives.all_gather(full, mine, group=self.group)
        self.stats.gathers += 1
        return full

    def _release(self, saved: _Saved) -> None:
        stats = self.stats
        stats.live_bytes -= saved.bytes
        stats.full_bytes -= saved.full
        stats.host_bytes -= saved.bytes if saved.on_host else 0
        self._live -= 1
        if self._live == 0 and self._buffer is not None:
            self._buffer.restart(self._buffer_device)
            stats.buffer_bytes = self._buffer.data.numel() if self._buffer.data is not None else 0


def _copy(dst: Tensor, src: Tensor, stream: Optional[Any] = None) -> Optional[Any]:
    """Copy ``src`` into ``dst``; a device-to-host copy runs on a side CUDA stream, overlapping compute.

    Returns the side stream (made on first use) that later readers of ``dst`` must wait for.
    """
    if not (src.is_cuda and dst.device.type == "cpu"):
        dst.copy_(src)
        return stream
    stream = stream or torch.cuda.Stream(src.device)
    stream.wait_stream(torch.cuda.current_stream(src.device))
    with torch.cuda.stream(stream):
        dst.copy_(src, non_blocking=True)
    src.record_stream(stream)  # the allocator must not reuse src before the copy has read it
    return stream


class _CheckpointedForward:
    """Stands in for a block's ``forward``: the original one, under non-reentrant checkpointing."""

    def __init__(self, original: Callable[..., Any], store: ActivationStore, own_attribute: bool) -> None:
        self.original = original
        self.store = store
        self.own_attribute = own_attribute
        """Whether the user had set ``forward`` on the instance (restored by unwrapping)."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return self.original(*args, **kwargs)
        with self.store.saving():
            return checkpoint(self.original, *args, use_reentrant=False, preserve_rng_state=True, **kwargs)


class ActivationCheckpointing:
    """The blocks of one module that recompute in backward, and the store their checkpoints go to."""

    def __init__(self, blocks: Sequence[tuple[str, nn.Module]], store: ActivationStore) -> None:
        self.store = store
        self.names = [name for name, _ in blocks]
        self._blocks = [block for _, block in blocks]
        for block in self._blocks:
            current = block.__dict__.get("forward")
            if isinstance(current, _CheckpointedForward):
                current.store = store  # wrapped before (an earlier fit): idempotent
            else:
                block.forward = _CheckpointedForward(block.forward, store, own_attribute=current is not None)

    @property
    def stats(self) -> ActivationStats:
        return self.store.stats

    def remove(self) -> None:
        """Give every block its own ``forward`` back."""
        for block in self._blocks:
            current = block.__dict__.get("forward")
            if isinstance(current, _CheckpointedForward):
                if current.own_attribute:
                    block.forward = current.original
                else:
                    del block.forward
        self._blocks = []


def checkpoint_blocks(
    module: nn.Module,
    blocks: Union[bool, Sequence[Union[type, str]]] = True,
    offload: bool = False,
    partition_group: Optional[Any] = None,
    contiguous: bool = False,
    unit_classes: Sequence[Union[type, str]] = (),
) -> ActivationCheckpointing:
    """Checkpoint ``module``'s blocks in place: ``True`` for the repeated blocks (``unit_classes`` if given, else
    the children of ``nn.ModuleList`` / ``nn.Sequential``), or the block classes (or class names) to checkpoint.

    ``partition_group`` is a process group (see ``resolve_partition_group``) of ranks holding identical block
    inputs. Also usable without Lightning.
    """
    classes = unit_classes if blocks is True else tuple(blocks)  # type: ignore[arg-type]
    found = find_blocks(module, classes, "unit_classes" if blocks is True else "activation_checkpointing")
    if not found:
        what = (
            f"no module of the classes {list(classes)}"
            if classes
            else "no repeated block (no child of an nn.ModuleList or nn.Sequential with parameters)"
        )
        raise ValueError(
            f"activation_checkpointing: {type(module).__name__} has {what}. Pass the block classes, "
            "e.g. `activation_checkpointing=[MyBlock]` or `['MyBlock']`."
        )
    return ActivationCheckpointing(found, ActivationStore(offload, partition_group, contiguous))


@dataclass(frozen=True)
class ActivationPolicy:
    """What ZeRO-R's activation checkpointing reads of the options, derived once by the engine
    (``engine/policies.py``); the fields are the options of the same names."""

    activation_checkpointing: Union[bool, tuple[Union[type, str], ...]]
    """``True`` for the repeated blocks, the block classes (or names) to checkpoint, or ``False``: off."""
    activation_offload: bool
    """Pa+cpu: the checkpointed block inputs wait in host memory."""
    activation_partition_group: PartitionGroup
    """Pa: the ranks holding identical block inputs (see ``resolve_partition_group``)."""
    contiguous_checkpoints: bool
    """MD: the checkpointed block inputs live in one preallocated buffer."""
    unit_classes: tuple[Union[type, str], ...]
    """The blocks ``activation_checkpointing=True`` picks when given (stage 3's units)."""


def activations_from_policy(
    module: nn.Module,
    policy: ActivationPolicy,
    tensor_group: Optional[Any] = None,
) -> Optional[ActivationCheckpointing]:
    """What ``policy`` asks for (``None`` without ``activation_checkpointing``); collective when a partition group is
    named (every rank must call it). Under tensor parallelism Pa partitions over ``tensor_group`` unless
    ``activation_partition_group`` names another group: the paper's Pa, whose ranks hold the same block inputs."""
    if not policy.activation_checkpointing:
        return None
    spec = policy.activation_partition_group
    group = resolve_partition_group(spec) if spec is not None else tensor_group
    return checkpoint_blocks(
        module,
        policy.activation_checkpointing,
        policy.activation_offload,
        group,
        policy.contiguous_checkpoints,
        policy.unit_classes,
    )


def resolve_partition_group(spec: PartitionGroup) -> Optional[Any]:
    """This rank's group for Pa: ``None``; a callable returning a process group; a list of global ranks (one
    group); or a list of such lists (one group each; every rank must belong to one or none)."""
    if spec is None:
        return None
    if callable(spec):
        return spec()
    key = tuple(tuple(r) if not isinstance(r, int) else r for r in spec)
    flat = [r for r in spec if isinstance(r, int)]
    lists = [flat] if len(flat) == len(spec) else [list(r) for r in spec if not isinstance(r, int)]
    # made once per job: a second fit reuses the groups of the first (see [Note: process groups are made once per job])
    return collectives.job_group(("partition", key), lambda: collectives.new_group(lists))
