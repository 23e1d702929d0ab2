"""Lightning integration in one process (world size 1, a user debugging on a laptop) and with the spawn launcher."""

from __future__ import annotations

import functools
from pathlib import Path

import lightning as L
import pytest
import torch
import torchmetrics
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader

import lightning_zero  # noqa: F401
from lightning_zero import ZeroPrecision, ZeroStrategy
from tests.compare import assert_params_close
from tests.models import TinyLM, token_data


def _trainer(strategy="zero2", **kwargs) -> L.Trainer:
    defaults = dict(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                    enable_progress_bar=False, enable_model_summary=False)
    return L.Trainer(strategy=strategy, **{**defaults, **kwargs})


class MetricLM(TinyLM):
    """Logs a torchmetrics metric in validation and returns logits from predict."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.val_acc = torchmetrics.classification.MulticlassAccuracy(num_classes=37)

    def validation_step(self, batch, batch_idx):
        super().validation_step(batch, batch_idx)
        tokens, targets = batch
        self.val_acc(self(tokens).argmax(-1).reshape(-1), targets.reshape(-1))
        self.log("val_acc", self.val_acc, on_epoch=True)

    def test_step(self, batch, batch_idx):
        self.validation_step(batch, batch_idx)

    def predict_step(self, batch, batch_idx):
        return self(batch[0])

    def predict_dataloader(self):
        return DataLoader(token_data(n=8, seed=5), batch_size=4)

    def test_dataloader(self):
        return self.val_dataloader()


def _fit_validate_test_predict(strategy: str) -> tuple[MetricLM, dict]:
    """fit (validating every 4 steps), then validate, test and predict with fresh Trainers; what each returned."""
    L.seed_everything(0)
    model = MetricLM()
    trainer = _trainer(strategy, max_steps=8, val_check_interval=4, limit_val_batches=2)
    trainer.fit(model)
    return model, {
        "losses": model.losses, "fit": {k: float(v) for k, v in trainer.callback_metrics.items()},
        "validate": _trainer(strategy).validate(model)[0], "test": _trainer(strategy).test(model)[0],
        "predict": _trainer(strategy).predict(model),
    }


@functools.cache
def _ddp_reference() -> dict:
    return _fit_validate_test_predict("ddp")[1]


@pytest.mark.parametrize("strategy", ["zero1", "zero2", "zero3"])
def test_fit_validate_test_predict(strategy):
    # DDP is the oracle: the same seed and data under `ddp` give the metrics every stage must reproduce (fp32, one
    # rank: only the order of floating-point sums may differ)
    model, zero = _fit_validate_test_predict(strategy)
    ddp = _ddp_reference()
    assert len(zero["losses"]) == 8 and zero["losses"][-1] < zero["losses"][0]
    assert zero["losses"] == pytest.approx(ddp["losses"], rel=1e-5)
    for stage in ("fit", "validate", "test"):
        assert zero[stage].keys() == ddp[stage].keys() and {"val_loss", "val_acc"} <= zero[stage].keys(), stage
        assert zero[stage] == pytest.approx(ddp[stage], rel=1e-5, abs=1e-6), stage
    assert len(zero["predict"]) == len(ddp["predict"]) == 2
    for predicted, reference in zip(zero["predict"], ddp["predict"]):
        torch.testing.assert_close(predicted, reference, rtol=1e-5, atol=1e-6)
    expected = model(token_data(n=8, seed=5).tensors[0][:4])
    torch.testing.assert_close(zero["predict"][0], expected)


def test_second_fit_on_fresh_trainer_continues_from_trained_weights():
    L.seed_everything(0)
    model = TinyLM(scheduler=False)
    _trainer("zero2", max_steps=4, precision="bf16-mixed").fit(model)
    assert all(p.dtype == torch.float32 for p in model.parameters())  # fp32 handed back after a mixed run
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    _trainer("zero1", max_steps=2).fit(model)
    assert any(not torch.equal(weights[n], p) for n, p in model.named_parameters())


def _fit_losses(tmp_path, epochs, ckpt_path=None, save_at=None, precision="32-true", strategy="zero2"):
    """Train ``epochs`` epochs of 4 batches (2 optimizer steps each); the data restarts at each epoch boundary."""
    L.seed_everything(0)
    model = TinyLM()
    trainer = _trainer(strategy, max_epochs=epochs, limit_train_batches=4, precision=precision,
                       accumulate_grad_batches=2, gradient_clip_val=0.5)
    trainer.fit(model, ckpt_path=ckpt_path)
    if save_at:
        trainer.save_checkpoint(save_at)
    return model.losses


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_checkpoint_resume_is_exact(tmp_path, precision):
    full = _fit_losses(tmp_path, 6, precision=precision)
    ckpt = tmp_path / "half.ckpt"
    first = _fit_losses(tmp_path, 3, save_at=ckpt, precision=precision)
    second = _fit_losses(tmp_path, 6, ckpt_path=ckpt, precision=precision)
    assert len(first) == len(second) == 12 and first + second == full  # bit for bit: weights and optimizer state are restored exactly

    assert ckpt.is_dir() and (ckpt / "meta.pt").is_file()  # sharded: a directory
    checkpoint = lightning_zero.load_full_checkpoint(ckpt)
    assert all(v.dtype == torch.float32 for v in checkpoint["state_dict"].values())  # fp32 masters, not bf16
    assert set(checkpoint["optimizer_states"][0]["state"]) == set(range(len(list(TinyLM().parameters()))))
    lightning_zero.consolidate(ckpt, tmp_path / "one.ckpt")
    restored = TinyLM.load_from_checkpoint(tmp_path / "one.ckpt")  # a plain Lightning checkpoint
    assert isinstance(restored, TinyLM)


def test_sharded_checkpoint_says_what_it_is_and_how_to_read_it(tmp_path):
    L.seed_everything(0)
    callback = ModelCheckpoint(dirpath=tmp_path, save_last=True)
    _trainer("zero2", max_steps=2, enable_checkpointing=True, callbacks=[callback]).fit(TinyLM())
    last = tmp_path / "last.ckpt"
    readme = (last / "README.txt").read_text()
    assert "sharded lightning-zero checkpoint" in readme and "zero2 on\n1 process at epoch 0, global step 2" in readme
    assert 'lightning_zero.load_from_checkpoint(MyModule, "last.ckpt"' in readme
    assert "lightning-zero consolidate last.ckpt model.ckpt" in readme
    assert (Path(callback.best_model_path) / "README.txt").is_file()  # every checkpoint ModelCheckpoint writes
    # what README.txt is there for: torch.load cannot open a directory (Lightning's own loader can, once
    # lightning_zero is imported: tests/test_checkpoint_safety.py)
    with pytest.raises(IsADirectoryError):
        torch.load(last)
    assert isinstance(lightning_zero.load_from_checkpoint(TinyLM, last), TinyLM)
    assert lightning_zero.inspect_checkpoint(last, verify=True)["global_step"] == 2  # not a checksummed file


@pytest.mark.parametrize("state_dict_type", ["sharded", "full"])
def test_checkpoint_resumes_across_stages_and_under_ddp_format(tmp_path, state_dict_type):
    ckpt = tmp_path / "zero2.ckpt"
    _fit_losses(tmp_path, 3, save_at=ckpt, strategy=ZeroStrategy(stage=2, state_dict_type=state_dict_type))
    full = _fit_losses(tmp_path, 6)
    for stage in (1, 3):
        resumed = _fit_losses(tmp_path, 6, ckpt_path=ckpt, strategy=f"zero{stage}")
        assert len(resumed) == 12 and resumed == full[len(full) - len(resumed):], stage
    checkpoint = lightning_zero.load_full_checkpoint(ckpt) if ckpt.is_dir() else torch.load(ckpt, weights_only=False)
    plain = TinyLM().configure_optimizers()["optimizer"]  # what DDP would restore into
    plain.load_state_dict(checkpoint["optimizer_states"][0])  # same form as DDP's


def test_loss_scaler_state_is_saved(tmp_path):
    L.seed_everything(0)
    precision = ZeroPrecision("16-mixed")
    trainer = _trainer("zero2", plugins=[precision], max_steps=2)
    trainer.fit(TinyLM(scheduler=False))
    trainer.save_checkpoint(tmp_path / "fp16.ckpt")
    saved = lightning_zero.load_full_checkpoint(tmp_path / "fp16.ckpt")["ZeroPrecision"]
    assert saved["scale"] == precision.scaler.scale and saved["good_steps"] == 2


def test_optimizer_state_of_another_model_is_refused(tmp_path):
    ckpt = tmp_path / "small.ckpt"
    _fit_losses(tmp_path, 2, save_at=ckpt, strategy=ZeroStrategy(stage=2, state_dict_type="full"))
    checkpoint = torch.load(ckpt, weights_only=False)
    checkpoint["optimizer_states"][0]["param_groups"][0]["params"].append(999)
    torch.save(checkpoint, ckpt)
    model = TinyLM()
    with pytest.raises(ValueError, match="param groups of sizes"):
        _trainer("zero2", max_steps=4).fit(model, ckpt_path=ckpt)


def _spawned_fit(strategy, monkeypatch) -> dict[str, torch.Tensor]:
    """Fit a seeded TinyLM for 3 steps on 2 spawned ranks; the weights the main process holds afterwards."""
    # Earlier tests left this process's world-size-1 group (and its port) behind; spawn needs a fresh rendezvous.
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    monkeypatch.delenv("MASTER_PORT", raising=False)
    L.seed_everything(0)
    model = TinyLM(scheduler=False)
    _trainer(strategy, devices=2, max_steps=3).fit(model)
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.timeout(300)
def test_spawn_launcher_returns_trained_weights(monkeypatch):
    # the main process gets rank 0's full weights back, though during fit each rank held only its shard: the same
    # weights DDP's spawn launcher returns from the same seed and data, within fp32 rounding (test_parity's bound)
    zero3 = _spawned_fit(ZeroStrategy(stage=3, start_method="spawn", persistence_threshold=0), monkeypatch)
    ddp = _spawned_fit("ddp_spawn", monkeypatch)
    L.seed_everything(0)
    initial = dict(TinyLM(scheduler=False).named_parameters())
    assert all(not torch.equal(initial[n], p) for n, p in ddp.items() if p.dim() > 1)  # the reference trained
    assert_params_close(zero3, ddp, 1e-5)


class _FreezeByLearningRate(TinyLM):
    """Sets the no-decay group's learning rate to zero by editing ``param_groups`` directly."""

    def on_train_batch_start(self, batch, batch_idx):
        self.optimizers().param_groups[1]["lr"] = 0.0


@pytest.mark.parametrize("strategy", ["zero1", "zero3"])
def test_learning_rate_edits_take_effect(strategy):
    L.seed_everything(0)
    model = _FreezeByLearningRate(scheduler=False)
    no_decay = {n: p.detach().clone() for n, p in model.named_parameters() if p.dim() < 2}
    _trainer(ZeroStrategy(stage=int(strategy[-1]), persistence_threshold=0), max_steps=3).fit(model)
    for name, p in model.named_parameters():
        if name in no_decay:
            assert torch.equal(p, no_decay[name]), name  # lr 0: unchanged
