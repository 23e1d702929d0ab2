"""One rank of ``benchmarks.zeropp_loss``: the demo's GPT (``examples/gpt.py``) trained by ``ZeroEngine`` under zero3
exactly and with qwZ / qgZ / both, on the same seed and data order; per-step training loss, the validation loss
after the last step, and the bytes per step by collective kind."""

from __future__ import annotations

import os
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
from gpt import GPT, ShakespeareData  # noqa: E402

from lightning_zero import ZeroEngine  # noqa: E402

warnings.filterwarnings("ignore")

MODES: dict[str, dict[str, Any]] = {
    "exact": {},
    "qwz": {"quantized_weights": True},
    "qgz": {"quantized_gradients": True},
    "qwz+qgz": {"quantized_weights": True, "quantized_gradients": True},
}


def run(mode: str, steps: int, val_batches: int) -> dict[str, Any]:
    torch.manual_seed(0)
    model = GPT(n_layer=2, dropout=0.0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    engine = ZeroEngine(model, [optimizer], stage=3, device=torch.device("cpu"), **MODES[mode])
    traffic = engine.shard_groups.traffic
    data = ShakespeareData()
    data.setup("fit")
    sampler = DistributedSampler(data.train_set, shuffle=True, seed=0)
    loader = DataLoader(data.train_set, batch_size=data.hparams.batch_size, sampler=sampler, drop_last=True)
    losses, bytes_per_step, start = [], [], time.perf_counter()
    batches = iter(loader)
    for _ in range(steps):
        inputs, targets = next(batches)
        traffic.reset()
        loss = model.loss((inputs, targets))
        engine.backward(loss)
        engine.step(clip_grad_norm=1.0)
        losses.append(loss.item())
        bytes_per_step.append(dict(traffic.bytes))
    seconds = (time.perf_counter() - start) / steps
    model.eval()
    val_sampler = DistributedSampler(data.val_set, shuffle=False)
    total = torch.zeros(2)
    with torch.no_grad():
        for i, (inputs, targets) in enumerate(DataLoader(data.val_set, batch_size=16, sampler=val_sampler)):
            if i == val_batches:
                break
            total += torch.tensor([model.loss((inputs, targets)).item(), 1.0])
            engine.end_step()
    dist.all_reduce(total)
    engine.teardown()
    return {"losses": losses, "val_loss": (total[0] / total[1]).item(), "bytes": bytes_per_step[-1],
            "seconds_per_step": seconds, "params": sum(p.numel() for p in model.parameters())}


def main() -> None:
    out, steps, val_batches = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    results = {mode: run(mode, steps, val_batches) for mode in MODES}
    torch.save(results, out / f"rank{dist.get_rank()}.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
