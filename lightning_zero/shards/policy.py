"""What the parameter store, its storages and the sharded optimizer read of the options: one small frozen policy
each, derived once from ``ZeroConfig`` by the engine (``engine/policies.py``), so that nothing
in ``shards/`` (or ``stage3/``'s storage) sees the whole configuration. They have no defaults: the options' defaults
are ``ZeroConfig``'s alone.

[Note: one offload policy for the store and the optimizers]
Where the master shard lives (the store allocates it) and where the step runs (the optimizer steps on it) must
agree, so both are handed the same ``OffloadPolicy`` object inside their own policies.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional, Union

#: ``reduce_bucket_size=None`` (the default) picks ``clamp(Ψ / AUTO_BUCKET_FRACTION, MIN, MAX)`` elements per bucket
#: for an optimizer of Ψ parameters: see ``auto_bucket_elements``.
MIN_AUTO_BUCKET_ELEMENTS = 1_000_000
MAX_AUTO_BUCKET_ELEMENTS = 4_000_000
AUTO_BUCKET_FRACTION = 32

#: Where a tier lives: the device (``False``), (pinned) host memory (``True``) or files (``"disk"``).
Tier = Union[bool, Literal["disk"]]


def auto_bucket_elements(numel: int) -> int:
    """The default bucket size for ``numel`` trainable parameters.

    [Note: the default bucket size]
    Bucket buffers are memory that does not fall with N, so their default must be small next to the model states
    of every model, and still large enough that collectives are not dominated by their per-call cost. On gloo, a
    model's gradients all-reduced in pieces of fewer than about 1M elements take measurably longer than in larger
    pieces (the sweep over piece sizes: benchmarks/RESULTS.md, "Memory at 1/N", "What changed"). Above that,
    ``Ψ / 32`` keeps the number of buckets near 32 for mid-size models, and the 4M-element cap (16 MiB in fp32, 32
    MiB for the two pooled buffers) bounds the buffers of any larger model. The former default, 25M elements, made
    each buffer as large as a whole 25M-parameter model.
    """
    return max(MIN_AUTO_BUCKET_ELEMENTS, min(MAX_AUTO_BUCKET_ELEMENTS, -(-numel // AUTO_BUCKET_FRACTION)))


@dataclass(frozen=True)
class OffloadPolicy:
    """Where the master shard, the optimizer states and (stage 3) the working shard live (see [Note: what lives where
    with offload_optimizer=True] in ``offload.py`` and [Note: what lives on disk] in ``disk.py``)."""

    offload_optimizer: Tier
    """The master shard, the optimizer states and the step."""
    offload_params: Tier
    """Stage 3: the working parameter shard."""
    offload_path: Optional[str]
    """The directory of the files of the tiers on disk (``None``: the system's temporary directory)."""

    @property
    def on_disk(self) -> bool:
        """Whether a tier lives on disk."""
        return "disk" in (self.offload_optimizer, self.offload_params)


@dataclass(frozen=True)
class StorePolicy:
    """What a ``ShardedStorage`` reads: the buckets of its layout and reducer, its
    tiers, and the block sizes of ZeRO++'s quantized collectives."""

    reduce_bucket_size: Optional[int]
    """Elements per bucket (``None``: ``auto_bucket_elements`` of the storage's parameters)."""
    bucket_buffers: int
    """Bucket-sized buffers that may be in flight at once."""
    overlap_comm: bool
    """Launch each bucket's reduction while backward goes on."""
    gradient_block: Optional[int]
    """qgZ: the elements per block of the int8 gradient reduction (``None``: exact reduce-scatters)."""
    weight_block: Optional[int]
    """Stage 3, qwZ: the elements per block of the int8 all-gathers for compute (``None``: exact gathers)."""
    offload: OffloadPolicy
    """Where the storage's master and working shards live (see [Note: one offload policy for the store and the
    optimizers])."""

    def bucket_elements(self, numel: int) -> int:
        """Elements per bucket for a storage of ``numel`` parameters."""
        return self.reduce_bucket_size if self.reduce_bucket_size is not None else auto_bucket_elements(numel)


@dataclass(frozen=True)
class OptimizerPolicy:
    """What a ``ShardedOptimizer`` reads: whether its optimizer is stepped on
    flat slices or whole tensors, and where its step runs."""

    partition_whole_params: Optional[bool]
    """Whole tensors (``True``) or flat slices (``False``) for every optimizer; ``None``: whole tensors only for
    optimizers not known to be elementwise."""
    elementwise_optimizers: tuple[str, ...]
    """Extra optimizer class names (dotted or bare) whose update is elementwise."""
    offload: OffloadPolicy
    """Where the step runs (see [Note: one offload policy for the store and the optimizers])."""
