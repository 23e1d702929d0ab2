"""The one place where ``ZeroConfig`` becomes what the components read.

[Note: one policy per component]
Each component below the engine reads a few options, through a small frozen policy of exactly those fields defined
in its own module: the store's ``StorePolicy``, the sharded optimizer's
``OptimizerPolicy`` (both holding the same
``OffloadPolicy``), stage 3's ``UnitPolicy``,
ZeRO-R's ``ActivationPolicy``, and the stage's
``StagePolicy``. ``policies_of`` derives them all once, and ``group_sizes``
resolves the process groups' sizes; nothing below ``engine/`` imports the configuration (``tests/test_layers.py``).
The options are validated by ``ZeroConfig`` alone, before any policy is made.
"""

from __future__ import annotations

from dataclasses import dataclass

from lightning_zero.activations.checkpointing import ActivationPolicy
from lightning_zero.comm.groups import GroupSizes
from lightning_zero.config import ZeroConfig, elements
from lightning_zero.shards.policy import OffloadPolicy, OptimizerPolicy, StorePolicy
from lightning_zero.stage3.plan import UnitPolicy, resolve_persistence_threshold
from lightning_zero.stages import StagePolicy, policy_for


@dataclass(frozen=True)
class Policies:
    """Every component's policy of one engine (see [Note: one policy per component])."""

    stage: StagePolicy
    store: StorePolicy
    optimizer: OptimizerPolicy
    units: UnitPolicy
    activations: ActivationPolicy

    @property
    def offload(self) -> OffloadPolicy:
        """Where the tiers live (the store's and the optimizers' one object)."""
        return self.store.offload


def policies_of(config: ZeroConfig) -> Policies:
    """The policies of the components under ``config`` (already validated)."""
    offload = OffloadPolicy(config.offload_optimizer, config.offload_params, config.offload_path)
    block = config.quantization_block_size
    return Policies(
        stage=policy_for(config.stage),
        store=StorePolicy(
            reduce_bucket_size=elements(config.reduce_bucket_size),
            bucket_buffers=config.bucket_buffers,
            overlap_comm=config.overlap_comm,
            gradient_block=block if config.quantized_gradients else None,
            weight_block=block if config.quantized_weights else None,
            offload=offload,
        ),
        optimizer=OptimizerPolicy(config.partition_whole_params, config.elementwise_optimizers, offload),
        units=unit_policy(config),
        activations=ActivationPolicy(
            activation_checkpointing=config.activation_checkpointing,
            activation_offload=config.activation_offload,
            activation_partition_group=config.activation_partition_group,
            contiguous_checkpoints=config.contiguous_checkpoints,
            unit_classes=config.unit_classes,
        ),
    )


def unit_policy(config: ZeroConfig) -> UnitPolicy:
    """Stage 3's unit policy under ``config`` (also what the memory estimate plans its units with)."""
    named_blocks = bool(config.unit_classes) and config.persistence_threshold is None
    return UnitPolicy(
        unit_classes=config.unit_classes,
        persistence_threshold=resolve_persistence_threshold(elements(config.persistence_threshold)),
        block_threshold=0 if named_blocks else None,  # see [Note: the blocks a user names are units] in plan.py
        prefetch_size=elements(config.prefetch_size),
        lockstep_check=config.lockstep_check,
    )


def group_sizes(config: ZeroConfig, world_size: int, devices_per_node: int, num_nodes: int) -> GroupSizes:
    """The group sizes of ``config``'s options over the job (see [Note: the group sizes are resolved in one place]
    in ``comm/groups.py``)."""
    return GroupSizes.resolve(
        config.shard_group_size,
        config.tensor_parallel_size,
        config.secondary_shard_group_size,
        world_size,
        devices_per_node,
        num_nodes,
    )
