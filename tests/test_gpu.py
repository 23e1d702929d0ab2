"""The CUDA paths on one GPU (NCCL at world size 1): skipped where no GPU is, run where one is.

What the gloo/CPU suite cannot reach: the CUDA events, pinned staging and side streams of ``offload_optimizer`` /
``offload_params``, the asynchronous upload of the update, ``activation_offload`` to pinned host memory, torch.compile
with inductor's GPU kernels, and the fp16/bf16 paths on CUDA. DDP on the same seed and data is the oracle, as in the
CPU suite: in fp32 every stage and offload matches it (``RTOL``: only kernel choice differs; the offloaded step runs
the CPU AdamW), under the mixed precisions the losses stay within ``MIXED_RTOL`` of DDP's (the masters are fp32 in
both, the working copies round differently). At world size 1 nothing is partitioned, so these tests check the
device paths, not the sharding (the CPU suite does that at 2 to 4 ranks).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint
import pytest
import torch

from lightning_zero import ZeroStrategy
from examples.tiny_gpt import TinyGPT
from tests.compare import assert_losses_close, assert_params_close

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

RTOL = 1e-4
MIXED_RTOL = 2e-2
STEPS = 8
OFFLOADS = {
    "zero1": [{}, {"offload_optimizer": True}],
    "zero2": [{}, {"offload_optimizer": True}],
    "zero3": [{}, {"offload_optimizer": True}, {"offload_params": True},
              {"offload_optimizer": True, "offload_params": True}],
}


class Probe(L.Callback):
    """Where the tensors live during training: the parameters on the GPU; with offload the optimizer's states on the
    host, and the master shard it steps on in pinned memory (what the update is uploaded from)."""

    def __init__(self) -> None:
        self.seen: dict[str, Any] = {}

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        if self.seen:
            return
        states = [v for state in trainer.optimizers[0].state.values() for v in state.values()
                  if isinstance(v, torch.Tensor) and v.dim() > 0]
        self.seen = {"param_devices": {p.device.type for p in pl_module.parameters()},
                     "state_devices": {t.device.type for t in states},
                     "masters_pinned": all(p.is_pinned() for group in trainer.optimizers[0].param_groups
                                           for p in group["params"] if p.device.type == "cpu")}


def train(strategy: Any, precision: str = "32-true", steps: int = STEPS, ckpt_path: str | None = None,
          save_at: Path | None = None, model_class: type[TinyGPT] = TinyGPT) -> tuple[TinyGPT, Probe, L.Trainer]:
    """Train the tests' GPT on the GPU; returns the module (its ``losses``), the probe and the trainer."""
    L.seed_everything(0, verbose=False)
    model = model_class(width=64, depth=3)
    probe = Probe()
    saving = [ModelCheckpoint(dirpath=save_at, every_n_train_steps=STEPS // 2, save_top_k=-1)] if save_at else []
    trainer = L.Trainer(strategy=strategy, accelerator="gpu", devices=1, precision=precision, max_steps=steps,
                        logger=False, enable_checkpointing=bool(saving), enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
                        limit_train_batches=STEPS // 2, callbacks=[probe, *saving])
    trainer.fit(model, ckpt_path=ckpt_path)
    return model, probe, trainer


def params_of(model: L.LightningModule) -> dict[str, torch.Tensor]:
    """The whole parameters after ``fit`` (the strategy hands them back at teardown), on the host."""
    return {n: p.detach().float().cpu().clone() for n, p in model.named_parameters()}


def zero(stage: int, **options: Any) -> ZeroStrategy:
    """``ZeroStrategy``; under stage 3 the tiny blocks are real units, split into several buckets."""
    if stage == 3:
        options = {"persistence_threshold": 0, "reduce_bucket_size": 4000, **options}
    return ZeroStrategy(stage=stage, **options)


@pytest.fixture(scope="module")
def ddp_fp32() -> tuple[list[float], dict[str, torch.Tensor]]:
    model, _, _ = train("ddp")
    return model.losses, params_of(model)


@pytest.mark.parametrize(("stage", "options"), [(s, o) for s, opts in OFFLOADS.items() for o in opts],
                         ids=lambda v: str(v) if not isinstance(v, dict) else "+".join(v) or "plain")
def test_fp32_matches_ddp_on_cuda(ddp_fp32, stage, options):
    model, probe, trainer = train(zero(int(stage[-1]), **options))
    assert_losses_close(model.losses, ddp_fp32[0], RTOL)
    assert_params_close(params_of(model), ddp_fp32[1], RTOL)
    assert probe.seen["param_devices"] == {"cuda"}
    if options.get("offload_optimizer"):
        assert probe.seen["state_devices"] == {"cpu"} and probe.seen["masters_pinned"], probe.seen
    else:
        assert probe.seen["state_devices"] == {"cuda"}, probe.seen


@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed"])
@pytest.mark.parametrize("options", [{"stage": 1}, {"stage": 2}, {"stage": 3},
                                     {"stage": 3, "offload_optimizer": True, "offload_params": True}],
                         ids=lambda o: "+".join(f"{k}={v}" for k, v in o.items()))
def test_mixed_precision_tracks_ddp_on_cuda(precision, options):
    expected, _, _ = train("ddp", precision)
    model, _, _ = train(zero(**options), precision)
    assert all(math.isfinite(x) for x in model.losses)
    assert_losses_close(model.losses, expected.losses, MIXED_RTOL)
    assert model.losses[-1] < model.losses[0]


@pytest.mark.parametrize("offload", [False, True])
def test_activation_checkpointing_and_offload_match_ddp_on_cuda(ddp_fp32, offload):
    from examples.gpt import Block

    strategy = zero(3, activation_checkpointing=(Block,), activation_offload=offload, contiguous_checkpoints=offload)
    model, _, _ = train(strategy)
    assert_losses_close(model.losses, ddp_fp32[0], RTOL)
    assert_params_close(params_of(model), ddp_fp32[1], RTOL)


class CompiledGPT(TinyGPT):
    """The tests' GPT with each block compiled (inductor) in ``configure_model``, as a LightningModule does."""

    def configure_model(self) -> None:
        super().configure_model()
        for i, block in enumerate(self.blocks):
            self.blocks[i] = torch.compile(block)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_compiled_blocks_match_eager_on_cuda(ddp_fp32, stage):
    model, _, _ = train(zero(stage), model_class=CompiledGPT)
    assert_losses_close(model.losses, ddp_fp32[0], 1e-3)  # inductor's kernels fuse differently from eager


@pytest.mark.parametrize("options", [{"stage": 2}, {"stage": 3},
                                     {"stage": 3, "offload_optimizer": True, "offload_params": True}],
                         ids=lambda o: "+".join(f"{k}={v}" for k, v in o.items()))
def test_checkpoint_resume_on_cuda_matches_uninterrupted(tmp_path, ddp_fp32, options):
    # the checkpoint written halfway through (the ModelCheckpoint callback, as users save; an epoch is half the run,
    # so the plain DataLoader resumes at its start), then a new run resumed from it: its steps are DDP's second half,
    # its final parameters DDP's
    train(zero(**options), save_at=tmp_path)
    (half,) = sorted(tmp_path.glob(f"*step={STEPS // 2}*"))
    resumed, _, _ = train(zero(**options), ckpt_path=str(half))
    assert_losses_close(resumed.losses, ddp_fp32[0][STEPS // 2:], RTOL)
    assert_params_close(params_of(resumed), ddp_fp32[1], RTOL)
