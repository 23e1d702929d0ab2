"""One rank of the parity suite: the same model, seed and data under ddp, zero1 and zero2, one after the other in the
same processes (which also exercises fresh Trainers after earlier ones). Saves losses and final weights per run."""

from __future__ import annotations

import sys
import warnings
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.plugins.precision import MixedPrecision, Precision

import lightning_zero
from lightning_zero import LossScaler, ZeroPrecision, ZeroStrategy
from tests.models import OverflowOnRank1, TinyGAN, TinyGPT, TinyLM

warnings.filterwarnings("ignore")

BUCKETS = 12  # per model: parameters span buckets and several buckets fill at once (thousands more would only add
# gloo latency: 50-element buckets made a 39k-parameter GPT issue ~800 reduce-scatters per micro-batch)


def bucket_size(model: L.LightningModule) -> int:
    """Elements per bucket for about :data:`BUCKETS` buckets over ``model``'s parameters (at least 50)."""
    return max(50, sum(p.numel() for p in model.parameters()) // BUCKETS)


def strategy(name: str, **kwargs: Any) -> Any:
    if name == "ddp":
        return "ddp_find_unused_parameters_true"
    if name == "zero3":
        kwargs.setdefault("persistence_threshold", 0)  # tiny test blocks must still be real units
        # stage 3 issues one all-gather per bucket twice per step, so few buckets keep it quick on 2 cores; 1500
        # elements still split each of the GPT's 12.6k-element blocks into several
        kwargs["reduce_bucket_size"] = 1500
    return ZeroStrategy(stage=int(name[-1]), **kwargs)


def run(name: str, model: L.LightningModule, world_size: int, precision: Any = "32-true", **trainer_kwargs: Any) -> dict:
    plugins = [precision] if isinstance(precision, Precision) else None
    trainer = L.Trainer(
        strategy=strategy(name, reduce_bucket_size=bucket_size(model)),
        accelerator="cpu", devices=world_size, precision=None if plugins else precision, plugins=plugins,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        **trainer_kwargs,
    )
    trainer.fit(model)
    return {
        "losses": list(model.losses),
        "params": {n: p.detach().float().cpu().clone() for n, p in model.named_parameters()},
        "lr": [g["lr"] for g in trainer.optimizers[0].param_groups],
    }


def run_fp16_overflow(name: str, world_size: int) -> dict:
    if name == "ddp":
        return {}
    precision = ZeroPrecision("16-mixed", loss_scaler=LossScaler(init_scale=1024.0, growth_interval=3))
    result = run(name, OverflowOnRank1(scheduler=False), world_size, precision=precision, max_steps=6)
    result["scaler"] = precision.scaler.state_dict()
    return result


def run_fp16_overflow_whole(name: str, world_size: int) -> dict:
    """Adafactor (stepped in one call on whole tensors) under ``16-mixed``, rank 1 overflowing at step 2; DDP runs
    Lightning's own ``16-mixed`` with a ``GradScaler`` of the same settings as the oracle."""
    if name == "ddp":
        scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=3)
        precision: Any = MixedPrecision("16-mixed", "cpu", scaler=scaler)
    else:
        precision = ZeroPrecision("16-mixed", loss_scaler=LossScaler(init_scale=1024.0, growth_interval=3))
    result = run(name, OverflowOnRank1(optimizer="adafactor", scheduler=False), world_size, precision=precision,
                 max_steps=6)
    if name == "ddp":
        result["scaler"] = {"scale": scaler.get_scale(), "skipped_steps": None}
    else:
        result["scaler"] = precision.scaler.state_dict()
    return result


def run_checkpoint(name: str, world_size: int, out: Path, optimizer: str) -> dict:
    """Train 2 epochs and save; resume under zero1 for a third; compare with 3 uninterrupted epochs (zero2)."""
    fit = dict(limit_train_batches=4, accumulate_grad_batches=2, gradient_clip_val=0.05)
    ckpt = out / f"{name}-{optimizer}.ckpt"

    def trainer(kind: str, epochs: int) -> L.Trainer:
        with torch.device("meta"):  # counted without drawing from the generator
            bucket = bucket_size(TinyLM(optimizer=optimizer))
        return L.Trainer(strategy=strategy(kind, reduce_bucket_size=bucket), accelerator="cpu",
                         devices=world_size, max_epochs=epochs, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, **fit)

    L.seed_everything(0, verbose=False)
    first = trainer(name, 2)
    first.fit(TinyLM(optimizer=optimizer))
    first.save_checkpoint(ckpt)
    if name == "ddp":
        return {"ckpt": str(ckpt)}
    L.seed_everything(0, verbose=False)
    resumed = TinyLM(optimizer=optimizer)
    trainer("zero1", 3).fit(resumed, ckpt_path=ckpt)
    L.seed_everything(0, verbose=False)
    straight = TinyLM(optimizer=optimizer)
    trainer(name, 3).fit(straight)
    return {"ckpt": str(ckpt), "resumed": resumed.losses, "straight": straight.losses[-len(resumed.losses):]}


def scenarios(world_size: int) -> dict[str, Any]:
    fit = dict(max_steps=6, gradient_clip_val=0.05, accumulate_grad_batches=2)
    return {
        "adamw": lambda s: run(s, TinyLM(frozen=True), world_size, **fit),
        "gpt": lambda s: run(s, TinyGPT(), world_size, limit_val_batches=2, val_check_interval=4, **fit),
        "gpt_checkpointing": lambda s: run(s, TinyGPT(checkpointing=True), world_size, **fit),
        "sgd_value_clip": lambda s: run(s, TinyLM(optimizer="sgd", frozen=True), world_size, max_steps=5,
                                        gradient_clip_val=0.01, gradient_clip_algorithm="value"),
        "adafactor": lambda s: run(s, TinyLM(optimizer="adafactor"), world_size, **fit),
        "gan_manual": lambda s: run(s, TinyGAN(), world_size, max_steps=10),
        # lr 1e-2: one update is several bf16 roundings of a weight, so a working copy that misses one shows
        "bf16_mixed": lambda s: run(s, TinyLM(scheduler=False, lr=1e-2), world_size, precision="bf16-mixed",
                                    max_steps=6),
        "fp16_overflow": lambda s: run_fp16_overflow(s, world_size),
        "fp16_overflow_whole": lambda s: run_fp16_overflow_whole(s, world_size),
        "checkpoint_adamw": lambda s: run_checkpoint(s, world_size, OUT, "adamw"),
        "checkpoint_adafactor": lambda s: run_checkpoint(s, world_size, OUT, "adafactor"),
    }


OUT = Path(".")


def main() -> None:
    global OUT
    out = OUT = Path(sys.argv[1])
    names = sys.argv[2].split(",")
    strategies = sys.argv[3].split(",")
    world_size = torch.distributed.get_world_size() if torch.distributed.is_initialized() else int(
        __import__("os").environ["WORLD_SIZE"])
    table = scenarios(world_size)
    results: dict[str, dict[str, Any]] = {}
    for name in names:
        for s in strategies:
            L.seed_everything(0, verbose=False)
            results.setdefault(name, {})[s] = table[name](s)
    torch.save(results, out / f"rank{torch.distributed.get_rank()}.pt")


if __name__ == "__main__":
    assert lightning_zero.__version__
    main()
