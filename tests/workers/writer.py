"""One job writing a sharded checkpoint directory, alone (no process group): the concurrent-writers test runs two.

``argv``: the checkpoint path, then the value every element of its one tensor gets (the test tells the writers apart
by it). ``LIGHTNING_ZERO_FAULT=point=save.written,signal=SIGSTOP`` stops it after its shard is written, holding its
staging directory, until the test continues it.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from lightning_zero.checkpoints.shards import Shard
from lightning_zero.checkpoints.storage import FORMAT, KEY, save_sharded


def main() -> None:
    path, value = Path(sys.argv[1]), float(sys.argv[2])
    meta = {"global_step": int(value), KEY: {"format": FORMAT, "stage": 3, "world_size": 1}}
    save_sharded(path, {"step": int(value)}, {"w": Shard.whole(torch.full((1000,), value))}, meta)
    print(f"saved {value}", flush=True)


if __name__ == "__main__":
    main()
