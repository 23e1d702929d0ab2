"""Bad input fails at construction or setup with a message that says what to do."""

import lightning as L
import pytest
import torch

import lightning_zero  # noqa: F401  (registers the strategy names)
from lightning_zero import ZeroConfig, ZeroPrecision, ZeroStrategy
from tests.models import TinyLM


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"stage": 4}, ValueError, "no stage 4"),
        ({"stage": 0}, ValueError, "no stage 0"),
        ({"persistence_threshold": -1}, ValueError, "persistence_threshold"),
        ({"unit_classes": "Block"}, TypeError, "unit_classes"),
        ({"stage": "2"}, TypeError, "must be an int"),
        ({"reduce_bucket_size": -5}, ValueError, "positive number of elements"),
        ({"reduce_bucket_size": 1.5}, TypeError, "positive int"),
        ({"bucket_buffers": 0}, ValueError, "positive"),
        ({"overlap_comm": "yes"}, TypeError, "bool"),
        ({"elementwise_optimizers": "MyAdam"}, TypeError, "list of class names"),
    ],
)
def test_config_rejects_bad_values(kwargs, error, match):
    with pytest.raises(error, match=match):
        ZeroConfig(**kwargs)
    with pytest.raises(error, match=match):
        ZeroStrategy(**kwargs)


def test_start_method_is_checked():
    with pytest.raises(ValueError, match="start_method"):
        ZeroStrategy(start_method="thread")


@pytest.mark.parametrize("precision", ["64-true", "16-true", "transformer-engine"])
def test_unsupported_precision_fails_at_trainer_construction(precision):
    with pytest.raises((ValueError, ImportError), match="precision|transformer"):
        L.Trainer(strategy="zero2", accelerator="cpu", devices=1, precision=precision)


def test_unsupported_precision_plugin_name():
    with pytest.raises(ValueError, match="does not support precision='64-true'"):
        ZeroPrecision("64-true")


def test_unsupported_accelerator_is_refused():
    from lightning.pytorch.accelerators import MPSAccelerator

    strategy = ZeroStrategy()
    with pytest.raises(ValueError, match="runs on CPU .* not on MPSAccelerator"):
        strategy.accelerator = MPSAccelerator()


def test_registered_names_resolve():
    for name, stage in [("zero1", 1), ("zero2", 2), ("zero3", 3), ("zero2_spawn", 2)]:
        trainer = L.Trainer(strategy=name, accelerator="cpu", devices=1, logger=False)
        assert isinstance(trainer.strategy, ZeroStrategy)
        assert trainer.strategy.config.stage == stage
    assert isinstance(L.Trainer(strategy="zero1", accelerator="cpu", devices=1,
                                precision="bf16-mixed").strategy.precision_plugin, ZeroPrecision)


class _LBFGSModel(TinyLM):
    def configure_optimizers(self):
        return torch.optim.LBFGS(self.parameters())


@pytest.mark.parametrize(("model", "error", "match"), [
    (_LBFGSModel, TypeError, "cannot shard torch.optim.LBFGS: .* Train with LBFGS under `strategy='ddp'`"),
])
def test_bad_optimizers_fail_before_the_first_step(model, error, match):
    module = model()
    before = {n: p.detach().clone() for n, p in module.named_parameters()}
    trainer = L.Trainer(strategy="zero2", accelerator="cpu", devices=1, max_steps=2, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    with pytest.raises(error, match=match):
        trainer.fit(module)
    assert all(torch.equal(before[n], p) for n, p in module.named_parameters())


def test_storage_options_are_refused_with_the_reason(tmp_path):
    # a deviation from ddp that Lightning's fsdp and deepspeed strategies share: no CheckpointIO gets the checkpoint
    trainer = L.Trainer(strategy="zero2", accelerator="cpu", devices=1, max_steps=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(TinyLM(scheduler=False))
    with pytest.raises(TypeError, match="no rank holds the whole model.*without `storage_options`"):
        trainer.save_checkpoint(tmp_path / "x.ckpt", storage_options={"compress": True})
    assert not (tmp_path / "x.ckpt").exists()
