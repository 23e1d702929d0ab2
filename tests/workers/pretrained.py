"""One rank: fill a tiny Hugging Face GPT-2 from a ``save_pretrained`` directory under zero3, zero2 and zero1.

Usage: ``pretrained.py OUT DIR``. The model is built as it is (HF ``Conv1D`` has no ``reset_parameters``; zero3
replays its construction). Each run records the logits of its sanity-check validation step on ``FIXED_INPUT`` (before any update) and
the loss of one training step; the zero3 runs record the host memory of the load.

[Note: measuring a load's peak host memory]
The resident set's high-water mark (``VmHWM`` in ``/proc/self/status``) is reset by writing ``5`` to
``/proc/self/clear_refs`` (Linux >= 4.0) right before the load and read right after it; the launcher sets
``MALLOC_MMAP_THRESHOLD_`` so that freed tensors leave the resident set. The peak counts pages of memory-mapped weight
files a rank has touched and not yet unmapped (safetensors reads are views of the mapped file), so it is an upper
bound of what the load holds. ``baseline`` is the resident set before setup, when the zero3 model is still on the meta
device: the peak minus it is the rank's shards, the load's own transient memory, and what setup keeps besides (about
12.5 MiB here, the same for a model three times larger).
"""

from __future__ import annotations

import gc
import sys
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Optional

import lightning as L
import torch
import transformers
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_zero import ZeroStrategy, load_pretrained
from lightning_zero.pretrained import loading as pretrained

warnings.filterwarnings("ignore")
transformers.logging.set_verbosity_error()

CONFIG = dict(n_layer=2, n_embd=128, n_head=4, vocab_size=32768, n_positions=64, bos_token_id=0, eos_token_id=0)
FIXED_INPUT = torch.randint(0, CONFIG["vocab_size"], (2, 16), generator=torch.Generator().manual_seed(0))


def status_mib(field: str) -> float:
    """A field of ``/proc/self/status`` (``VmRSS``, ``VmHWM``) in MiB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    raise KeyError(field)


def reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


@contextmanager
def peak(record: dict[str, float]) -> Iterator[None]:
    """Record the resident set before, and its peak during, the ``with`` block (see [Note: measuring ...])."""
    gc.collect()  # garbage of earlier runs in this process is not the load's
    record["before"] = status_mib("VmRSS")
    reset_peak()
    yield
    record["peak"] = status_mib("VmHWM")
    record["after"] = status_mib("VmRSS")


class FineTune(L.LightningModule):
    """A Hugging Face GPT-2 as ``self.lm``, filled from ``source`` at the moment ``when`` says."""

    def __init__(self, source: str, when: str) -> None:
        super().__init__()
        self.source, self.when = source, when
        self.lm: Optional[nn.Module] = None
        if when in ("init", "fit_start"):
            torch.manual_seed(123)
            self.lm = transformers.GPT2LMHeadModel(transformers.GPT2Config(**CONFIG))
        self.logits: Optional[torch.Tensor] = None
        self.loss: Optional[float] = None
        self.memory: dict[str, float] = {}

    def setup(self, stage: str) -> None:
        self.memory["baseline"] = status_mib("VmRSS")

    def configure_model(self) -> None:
        if self.when == "configure_model" and self.lm is None:
            self.lm = transformers.GPT2LMHeadModel(transformers.GPT2Config(**CONFIG))
            load_pretrained(self.lm, self.source)

    def on_fit_start(self) -> None:
        if self.when == "fit_start":
            with peak(self.memory):
                load_pretrained(self.lm, self.source)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = self.lm(batch[0], labels=batch[0]).loss
        self.loss = float(loss)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        if self.logits is None:
            self.logits = self.lm(FIXED_INPUT).logits.detach().clone()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)

    def train_dataloader(self) -> DataLoader:
        ids = torch.randint(0, CONFIG["vocab_size"], (8, 16), generator=torch.Generator().manual_seed(1))
        return DataLoader(TensorDataset(ids), batch_size=2)

    def val_dataloader(self) -> DataLoader:
        return self.train_dataloader()


def run(source: str, strategy: str, when: str) -> dict[str, Any]:
    """One fit of one step; what the rank saw and held."""
    model = FineTune(source, when)
    engines: list[Any] = []
    held: list[int] = []
    original = pretrained.fill_pending

    def measured_fill(root: nn.Module, engs: Any, runtime: Any) -> None:  # the load at zero3 setup
        engines.extend(engs)
        if when != "configure_model":
            original(root, engs, runtime)
        else:
            model.memory["construction_peak"] = status_mib("VmHWM")
            with peak(model.memory):
                original(root, engs, runtime)
        held.append(_shard_bytes(engs))  # now: the hand-back at teardown drops the shards

    pretrained.fill_pending = measured_fill
    try:
        trainer = L.Trainer(strategy=ZeroStrategy(stage=int(strategy[-1])), accelerator="cpu", devices=2,
                            max_steps=1, limit_val_batches=1, num_sanity_val_steps=1, logger=False,
                            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
        trainer.fit(model)
    finally:
        pretrained.fill_pending = original
    shard_bytes = held[0] if held else _shard_bytes(trainer.strategy.storages)
    return {"logits": model.logits, "loss": model.loss, "memory": model.memory, "shard_bytes": shard_bytes}


def _shard_bytes(storages: Any) -> int:
    """Bytes of the master and working shards of ``storages`` (one tensor where they are the same)."""
    total = sum(e.master_storage.numel() * e.master_storage.element_size() for e in storages
                if e.master_storage is not None)
    return total + sum(e.working_shard.numel() * e.working_shard.element_size() for e in storages
                       if e.working_shard is not None and e.working_shard is not e.master_storage)


def main() -> None:
    out, source = Path(sys.argv[1]), sys.argv[2]
    results: dict[str, Any] = {}
    for strategy, when in [("zero3", "configure_model"), ("zero3", "fit_start"), ("zero2", "configure_model"),
                           ("zero1", "fit_start")]:
        results[f"{strategy}/{when}"] = run(source, strategy, when)
    torch.save(results, out / f"rank{torch.distributed.get_rank()}.pt")


if __name__ == "__main__":
    main()
