"""One node's launcher of a 2-node job on one machine, run as a user runs it on each node: ``python nodes.py OUT``
with ``NODE_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT`` set; Lightning's script launcher starts the node's second
rank. On the same seed and data: ddp, then zero3 with the default layout (sharded over all 4 ranks) and with
``shard_group_size="node"`` (sharded over each node's 2 ranks, replicated across the 2 nodes).

Saves per run the losses, the final weights, the shard group size and replicas the strategy resolved, T and the
shard size of the storages, and the setup summary line.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path
from typing import Any, Optional, Union

import lightning as L
import torch

from lightning_zero import ZeroStrategy
from tests.models import TinyLM

warnings.filterwarnings("ignore")

NODES, DEVICES = 2, 2
FIT = dict(max_steps=3, limit_train_batches=3, gradient_clip_val=0.05)


def fit(name: str, shard_group_size: Optional[Union[int, str]] = None) -> dict[str, Any]:
    """Train ``TinyLM`` for a few steps on 2 nodes of 2 ranks under ``name`` (``"ddp"`` or ``"zero3"``)."""
    L.seed_everything(0, verbose=False)
    model = TinyLM()
    options: dict[str, Any] = {} if shard_group_size is None else {"shard_group_size": shard_group_size}
    strategy = "ddp" if name == "ddp" else ZeroStrategy(stage=3, persistence_threshold=0, reduce_bucket_size=1500,
                                                        **options)
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=DEVICES, num_nodes=NODES, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, **FIT)
    trainer.fit(model)
    run: dict[str, Any] = {"losses": list(model.losses), "global_rank": trainer.global_rank,
                           "node_rank": trainer.node_rank, "world_size": trainer.world_size}
    run["params"] = {n: p.detach().clone() for n, p in model.named_parameters()}  # whole again after fit
    if isinstance(trainer.strategy, ZeroStrategy):
        engine, storages = trainer.strategy.engine, trainer.strategy.storages
        assert engine is not None
        run.update(shard_group_size=trainer.strategy.shard_group_size,
                   replicas=trainer.strategy.shard_groups.replicas, summary=engine.summary(),
                   padded=sum(s.layout.total for s in storages), shard=sum(s.layout.shard_size for s in storages))
    return run


def main() -> None:
    out = Path(sys.argv[1])
    runs = {"ddp": fit("ddp"), "default": fit("zero3"), "node": fit("zero3", "node")}
    torch.save(runs, out / f"rank{torch.distributed.get_rank()}.pt")


if __name__ == "__main__":
    main()
