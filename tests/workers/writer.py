"""One job writing a sharded checkpoint directory, alone (no process group): the concurrent-writers test runs two.

``argv``: the checkpoint path, then the value every element of its one tensor gets (the test tells the writers apart
by it), and optionally a directory with two FIFOs: then, once its shard is written (the fault point ``save.written``,
holding its staging directory), it writes a line to ``<dir>/paused`` and waits for a line on ``<dir>/go``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from lightning_zero.checkpoints import storage
from lightning_zero.checkpoints.shards import Shard
from lightning_zero.checkpoints.storage import FORMAT, KEY, save_sharded


def pause_at_save_written(fifos: Path) -> None:
    """At ``save.written``: say so on ``fifos/paused``, then wait for ``fifos/go``."""
    original = storage.fault_point

    def point(name: str) -> None:
        original(name)
        if name == "save.written":
            with open(fifos / "paused", "w") as paused:
                paused.write("paused\n")
            with open(fifos / "go") as go:
                go.readline()

    storage.fault_point = point


def main() -> None:
    path, value = Path(sys.argv[1]), float(sys.argv[2])
    if len(sys.argv) > 3:
        pause_at_save_written(Path(sys.argv[3]))
    meta = {"global_step": int(value), KEY: {"format": FORMAT, "stage": 3, "world_size": 1}}
    save_sharded(path, {"step": int(value)}, {"w": Shard.whole(torch.full((1000,), value))}, meta)
    print(f"saved {value}", flush=True)


if __name__ == "__main__":
    main()
