"""The one-line summary of what an engine's ranks hold, next to what DDP would hold (``ZeroEngine.summary``)."""

from __future__ import annotations

from lightning_zero.comm import collectives
from lightning_zero.comm.groups import ShardGroups
from lightning_zero.config import ZeroConfig
from lightning_zero.shards.accounting import (
    expected_disk_bytes,
    expected_model_state_bytes,
    expected_offload_bytes,
    human_bytes,
)


def model_state_summary(
    config: ZeroConfig, groups: ShardGroups, mode: str, *, trainable: int, units: int, skipped_steps: int
) -> str:
    """One line: what each rank of an engine holds, next to what DDP would hold (the expected model states of
    ``shards/accounting.py``, with the shard group's size k in place of N under hybrid sharding; under tensor
    parallelism of this rank's slices, over the data dimension).

    ``config``, ``groups`` and ``mode`` (its precision) are the engine's; ``trainable``: the elements of the
    parameters its optimizers hold (this rank's slices under tensor parallelism); ``units``: stage 3's unit count;
    ``skipped_steps``: the optimizer steps the non-finite guard skipped."""
    t = groups.tensor_size
    n = collectives.world_size() // t  # the data-parallel ranks (all ranks without tensor parallelism)
    k = n // groups.replicas
    psi = trainable
    zero = expected_model_state_bytes(psi, k, config.stage, mode)
    ddp = expected_model_state_bytes(psi, n, 0, mode)
    if not ddp:
        return "no trainable parameters"
    where = ""
    moved = [name for name in ("offload_optimizer", "offload_params") if getattr(config, name)]
    if moved:  # see [Note: what lives where with offload_optimizer=True] in offload.py
        zero, host = expected_offload_bytes(psi, k, config.stage, mode, config.offload_optimizer, config.offload_params)
        where = f" on the device + {human_bytes(host)} in host memory ({', '.join(moved)})"
        if config.offload_optimizer == "disk":  # see [Note: what lives on disk] in disk.py
            zero, host, files = expected_disk_bytes(psi, k, config.stage, mode, config.offload_params == "disk")
            where = (
                f" on the device + {human_bytes(host)} in host memory + {human_bytes(files)} in files under "
                f"{config.offload_path or 'the temporary directory'} ({', '.join(moved)})"
            )
    # the layout that runs: the paper's N (every data-parallel rank), or hybrid sharding (`shard_group_size`)
    hybrid = (
        f" (hybrid: sharded over groups of {k}, replicated {n // k}x)"
        if k != n
        else f" (sharded over all {n})"
        if n > 1
        else ""
    )
    ranks = f"{n} rank{'s' if n != 1 else ''}" if t == 1 else f"{n} data-parallel x {t} tensor-parallel ranks"
    own = "" if t == 1 else " (this rank's tensor-parallel slices)"
    whole = ""
    if config.stage == 3 and units == 1:  # see [Note: one algorithm at every size] in plan.py
        whole = "; parameters gathered as one unit, once per step (see `persistence_threshold`)"
    skipped = ""
    if skipped_steps:  # see [Note: the non-finite guard] in engine.py
        skipped = f"; {skipped_steps} optimizer step(s) skipped for non-finite gradients"
    return (
        f"ZeRO stage {config.stage} on {ranks}{hybrid}, precision {mode}: {psi:,} trainable parameters{own}; "
        f"model states {human_bytes(zero)}{where} per rank (DDP: {human_bytes(ddp)}, {zero / ddp:.0%} of it)"
        f"{whole}{skipped}"
    )
