"""One rank of ``benchmarks.zeropp_loss``: the demo's GPT (``examples/gpt.py``) trained by ``ZeroEngine`` under zero3
exactly and with qwZ / qgZ / both, on the same seed and data order, with the demo's AdamW groups and warm-up +
cosine schedule; per-step training loss, the validation loss after the last step, and the bytes per step by
collective kind."""

from __future__ import annotations

import functools
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
from gpt import GPT, ShakespeareData, lr_factor  # noqa: E402

from lightning_zero import ZeroEngine  # noqa: E402

warnings.filterwarnings("ignore")

MODES: dict[str, dict[str, Any]] = {
    "exact": {},
    "qwz": {"quantized_weights": True},
    "qgz": {"quantized_gradients": True},
    "qwz+qgz": {"quantized_weights": True, "quantized_gradients": True},
}


def run(mode: str, steps: int, val_batches: int, block: int, seed: int) -> dict[str, Any]:
    torch.manual_seed(seed)
    model = GPT(dropout=0.0)  # the demo's GPT and optimizer (no dropout: the runs differ by quantization alone)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": model.hparams.weight_decay},
                                   {"params": no_decay, "weight_decay": 0.0}], lr=model.hparams.lr)
    warmup = model.hparams.warmup_steps  # then cosine decay over the run, as the demo's `configure_optimizers`
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, functools.partial(
        lr_factor, warmup=warmup, total=max(steps, warmup + 1)))
    options = dict(MODES[mode], quantization_block_size=block) if MODES[mode] else {}
    engine = ZeroEngine(model, [optimizer], stage=3, device=torch.device("cpu"), **options)
    traffic = engine.shard_groups.traffic
    data = ShakespeareData()
    data.setup("fit")
    sampler = DistributedSampler(data.train_set, shuffle=True, seed=seed)
    loader = DataLoader(data.train_set, batch_size=data.hparams.batch_size, sampler=sampler, drop_last=True)
    losses, bytes_per_step, start = [], [], time.perf_counter()
    batches = iter(loader)
    for _ in range(steps):
        inputs, targets = next(batches)
        traffic.reset()
        loss = model.loss((inputs, targets))
        engine.backward(loss)
        engine.step(clip_grad_norm=1.0)
        schedule.step()
        losses.append(loss.item())
        bytes_per_step.append(dict(traffic.bytes))
    seconds = (time.perf_counter() - start) / steps
    model.eval()
    val_loss = validate(model, data, val_batches, engine)  # the forward's gathers as in training (qwZ: int8)
    engine.teardown()  # the exact fp32 masters back in the module: what a checkpoint loaded for inference holds
    exact_weights_val_loss = validate(model, data, val_batches, None)
    return {"losses": losses, "val_loss": val_loss, "exact_weights_val_loss": exact_weights_val_loss,
            "bytes": bytes_per_step[-1], "seconds_per_step": seconds,
            "params": sum(p.numel() for p in model.parameters())}


def validate(model: GPT, data: ShakespeareData, batches: int, engine: ZeroEngine | None) -> float:
    """The mean validation loss over ``batches`` batches per rank (every rank's, averaged)."""
    sampler = DistributedSampler(data.val_set, shuffle=False)
    total = torch.zeros(2)
    with torch.no_grad():
        for i, (inputs, targets) in enumerate(DataLoader(data.val_set, batch_size=16, sampler=sampler)):
            if i == batches:
                break
            total += torch.tensor([model.loss((inputs, targets)).item(), 1.0])
            if engine is not None:
                engine.end_step()
    dist.all_reduce(total)
    return (total[0] / total[1]).item()


def main() -> None:
    out, steps, val_batches, block, seed = Path(sys.argv[1]), *(int(a) for a in sys.argv[2:6])
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    results = {mode: run(mode, steps, val_batches, block, seed) for mode in MODES}
    torch.save(results, out / f"rank{dist.get_rank()}.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
