"""One rank of ``python -m benchmarks.checkpoint_io``: save and resume times and peak memory.

Usage (through ``lightning_zero.testing.launch``): ``_checkpoint_rank.py OUT STRATEGY WIDTH DEPTH``. Trains one step of a TinyGPT,
saves a checkpoint (``ddp``: Lightning's own single file; zero1-3: the sharded directory), then resumes it in a new
Trainer. Memory is the peak resident-set growth during the save and during the load hooks, sampled every 2 ms.
"""

from __future__ import annotations

import os
import sys
import threading
import time
import warnings
from pathlib import Path
from typing import Any, Callable

import lightning as L
import torch

from lightning_zero import ZeroStrategy
from examples.tiny_gpt import TinyGPT

warnings.filterwarnings("ignore")
WORLD_SIZE = int(os.environ["WORLD_SIZE"])
PAGE = os.sysconf("SC_PAGE_SIZE")


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


class PeakRSS:
    """Samples the resident set size in a thread while active; ``growth`` is the peak above the start."""

    def __init__(self) -> None:
        self.growth = 0
        self.seconds = 0.0

    def __enter__(self) -> "PeakRSS":
        self._start, self._peak, self._stop = rss(), 0, threading.Event()
        self._t0 = time.perf_counter()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.002):
            self._peak = max(self._peak, rss())

    def __exit__(self, *exc: Any) -> None:
        self.seconds += time.perf_counter() - self._t0
        self._stop.set()
        self._thread.join()
        self.growth = max(self.growth, max(self._peak, rss()) - self._start)


def make_trainer(name: str, steps: int) -> L.Trainer:
    strategy = "ddp" if name == "ddp" else ZeroStrategy(stage=int(name[-1]), persistence_threshold=0)
    return L.Trainer(strategy=strategy, accelerator="cpu", devices=WORLD_SIZE, max_steps=steps, logger=False,
                     enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)


def timed(probe: PeakRSS, fn: Callable[..., Any]) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with probe:
            return fn(*args, **kwargs)

    return wrapper


def main() -> None:
    out, name, width, depth = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    L.seed_everything(0, verbose=False)
    trainer = make_trainer(name, 1)
    trainer.fit(TinyGPT(width=width, depth=depth, meta_init=True))
    path = out / f"{name}.ckpt"
    save = PeakRSS()
    torch.distributed.barrier()
    with save:
        trainer.save_checkpoint(path)
    load = PeakRSS()
    resumed = make_trainer(name, 1)
    for hook in ("load_checkpoint", "load_model_state_dict", "load_optimizer_state_dict"):
        setattr(resumed.strategy, hook, timed(load, getattr(resumed.strategy, hook)))
    resumed.fit(TinyGPT(width=width, depth=depth, meta_init=True), ckpt_path=path)
    result = {"save_s": save.seconds, "save_rss": save.growth, "load_s": load.seconds, "load_rss": load.growth,
              "path": str(path)}
    torch.save(result, out / f"rank{torch.distributed.get_rank()}.pt")


if __name__ == "__main__":
    main()
