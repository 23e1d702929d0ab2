"""Bad input fails at construction or setup with a message that says what to do."""

import math
import warnings
from datetime import timedelta

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
        ({"host_mmap_threshold": -1}, ValueError, "host_mmap_threshold"),
        ({"unit_classes": "Block"}, TypeError, "unit_classes"),
        ({"stage": "2"}, TypeError, "must be an int"),
        ({"reduce_bucket_size": -5}, ValueError, "positive number of elements"),
        ({"reduce_bucket_size": 1.5}, ValueError, "whole number of elements"),
        ({"bucket_buffers": 0}, ValueError, "positive number of buffers"),
        ({"overlap_comm": "yes"}, TypeError, "bool"),
        ({"elementwise_optimizers": "MyAdam"}, TypeError, "list of class names"),
    ],
)
def test_config_rejects_bad_values(kwargs, error, match):
    with pytest.raises(error, match=match):
        ZeroConfig(**kwargs)
    with pytest.raises(error, match=match):
        ZeroStrategy(**kwargs)


def test_host_mmap_threshold_leaves_glibc_alone_by_default(monkeypatch):
    """``None`` (the default) and 0 change nothing; a number fixes the threshold, never over the environment's (see
    [Note: no allocator setting decides speed or memory] in memory/host_memory.py)."""
    from lightning_zero.memory import host_memory

    assert ZeroConfig().host_mmap_threshold is None
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "131072")
    assert host_memory._glibc() is None  # a threshold set in the environment wins
    calls = []

    class FakeLibc:
        def mallopt(self, option, value):
            calls.append((option, value))
            return 1

        def malloc_trim(self, pad):
            calls.append(("trim", pad))

    monkeypatch.setattr(host_memory, "_glibc", lambda: FakeLibc())
    assert not host_memory.release_freed_memory(None) and not host_memory.release_freed_memory(0) and not calls
    assert host_memory.release_freed_memory(131_072)
    assert calls == [(-3, 131_072), ("trim", 0)]
    calls.clear()
    assert host_memory.fix_threshold(FakeLibc(), host_memory.FIXED_THRESHOLD)
    assert calls == [(-3, host_memory.FIXED_THRESHOLD)]  # 128 KiB: the trim threshold stays glibc's
    calls.clear()
    assert host_memory.fix_threshold(FakeLibc(), 4 * 2**20)
    assert calls == [(-3, 4 * 2**20), (-1, 8 * 2**20)]  # above it the heap keeps its top, as glibc's adjustment does


def test_start_method_is_checked():
    with pytest.raises(ValueError, match="start_method"):
        ZeroStrategy(start_method="thread")


@pytest.mark.parametrize(("timeout", "expected"), [
    (5, timedelta(seconds=5)), (2.5, timedelta(seconds=2.5)), (timedelta(minutes=2), timedelta(minutes=2)),
    (None, None),
])
def test_timeout_in_seconds_or_timedelta(timeout, expected):
    # torch.distributed takes only a timedelta: an int used to reach it and crash every rank at launch
    assert ZeroStrategy(timeout=timeout)._timeout == expected
    assert ZeroStrategy()._timeout == timedelta(minutes=30)  # Lightning's default


@pytest.mark.parametrize(("timeout", "error"), [
    ("5", TypeError), (True, TypeError), (0, ValueError), (-1.0, ValueError), (timedelta(0), ValueError),
    (math.inf, ValueError), (math.nan, ValueError),
])
def test_bad_timeout_is_refused_at_construction(timeout, error):
    with pytest.raises(error, match="`timeout` must be"):
        ZeroStrategy(timeout=timeout)


@pytest.mark.parametrize("kwargs", [{"unit_classes": ["Block"]}, {"prefetch_size": 0},
                                    {"persistence_threshold": 0, "prefetch_size": 10}])
@pytest.mark.parametrize("stage", [1, 2])
def test_stage3_options_warn_below_stage3(kwargs, stage):
    with pytest.warns(UserWarning, match=f"only acts? at stage 3 and (is|are) ignored at stage {stage}") as caught:
        ZeroStrategy(stage=stage, **kwargs)
    assert all(f"`{name}`" in str(caught[0].message) for name in kwargs)


def test_a_stage3_option_below_stage3_warns_once_from_the_users_line_on_rank_zero_only(monkeypatch):
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ZeroStrategy(stage=2, persistence_threshold=5)  # this line, not the dataclass's generated `<string>` __init__
        monkeypatch.setenv("LOCAL_RANK", "1")  # another rank started by Lightning's launcher builds it too: silent
        ZeroStrategy(stage=2, persistence_threshold=5)
    assert len(caught) == 1, [str(w.message) for w in caught]
    assert caught[0].filename == __file__ and "persistence_threshold" in str(caught[0].message)


@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("offload_optimizer", [False, True])
def test_offload_params_below_stage3_is_an_error(stage, offload_optimizer):
    # unlike the tuning options above it changes where the model lives: ignoring it would silently keep every
    # parameter on the device, so it is refused, and the message says what to use instead
    for make in (ZeroConfig, ZeroStrategy):
        with pytest.raises(ValueError, match=rf"`offload_params=True` offloads stage 3's .* stage {stage} keeps full "
                                             r"parameters.*`stage=3`.*`offload_optimizer=True` alone"):
            make(stage=stage, offload_params=True, offload_optimizer=offload_optimizer)
    with pytest.raises(TypeError, match="`offload_params` must be a bool"):
        ZeroConfig(stage=3, offload_params=1)
    assert ZeroStrategy(stage=3, offload_params=True).config.offload_params is True
    assert ZeroConfig(stage=stage, offload_params=False).offload_params is False


def test_lockstep_check_takes_a_bool_or_strict():
    assert ZeroConfig(stage=3, lockstep_check="strict").lockstep_check == "strict"
    assert ZeroStrategy(stage=3, lockstep_check=False).config.lockstep_check is False
    for wrong in ("lagged", 1, None):
        with pytest.raises(TypeError, match=r"`lockstep_check` must be True, False or 'strict'"):
            ZeroConfig(stage=3, lockstep_check=wrong)


@pytest.mark.parametrize("kwargs", [
    {"stage": 3, "unit_classes": ["Block"], "prefetch_size": 0, "persistence_threshold": 0},
    {"stage": 2},
    {"stage": 1, "prefetch_size": 5_000_000},  # the default, written out
    {"stage": 2, "unit_classes": ["Block"], "activation_checkpointing": True},  # picks the blocks to recompute
    {"stage": 3, "offload_params": True, "offload_optimizer": True},
])
def test_no_warning_where_the_options_are_used_or_default(kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ZeroStrategy(**kwargs)


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


def test_sizes_may_be_whole_floats_and_shutdown_timeout_is_checked():
    config = ZeroConfig(stage=3, reduce_bucket_size=1e6, persistence_threshold=0.0)
    assert (config.reduce_bucket_size, config.persistence_threshold) == (1_000_000, 0)
    assert type(config.reduce_bucket_size) is int
    from lightning_zero.engine.policies import policies_of

    policies = policies_of(ZeroConfig(stage=3, reduce_bucket_size=1e6, prefetch_size=2e6))  # the policies get ints
    assert (policies.store.reduce_bucket_size, policies.units.prefetch_size) == (1_000_000, 2_000_000)
    assert type(policies.store.reduce_bucket_size) is int and type(policies.units.prefetch_size) is int
    with pytest.raises(ValueError, match="whole number of elements, got 2.5"):
        ZeroConfig(prefetch_size=2.5)
    assert ZeroConfig().shutdown_timeout == 120 and ZeroConfig(shutdown_timeout=None).shutdown_timeout is None
    for bad in (0, -1, float("inf"), "2"):
        with pytest.raises(ValueError, match="`shutdown_timeout` must be a positive number of seconds or None"):
            ZeroConfig(shutdown_timeout=bad)


def test_each_component_policy_holds_the_options_it_reads():
    # see [Note: one policy per component] in engine/policies.py: the engine derives every policy from the options
    # once; a field mapped from the wrong option (or left at a default) would run with another setting than asked
    from lightning_zero.engine.policies import policies_of

    config = ZeroConfig(
        stage=3, reduce_bucket_size=1000, bucket_buffers=3, overlap_comm=False, quantized_weights=True,
        quantized_gradients=True, quantization_block_size=64, offload_optimizer=True, offload_params=True,
        partition_whole_params=True, elementwise_optimizers=["MyAdam"], unit_classes=("Block",),
        persistence_threshold=7, prefetch_size=11, lockstep_check="strict", activation_checkpointing=True,
        activation_offload=True, activation_partition_group=[0, 1], contiguous_checkpoints=True,
    )
    policies = policies_of(config)
    store, optimizer, units, activations = policies.store, policies.optimizer, policies.units, policies.activations
    assert (store.reduce_bucket_size, store.bucket_buffers, store.overlap_comm) == (1000, 3, False)
    assert (store.gradient_block, store.weight_block, store.bucket_elements(10**9)) == (64, 64, 1000)
    assert (store.offload.offload_optimizer, store.offload.offload_params, store.offload.offload_path) == (True,) * 2 + (None,)
    assert optimizer.offload is store.offload  # see [Note: one offload policy for the store and the optimizers]
    assert (optimizer.partition_whole_params, optimizer.elementwise_optimizers) == (True, ("MyAdam",))
    assert (units.unit_classes, units.persistence_threshold, units.prefetch_size, units.lockstep_check) == (
        ("Block",), 7, 11, "strict")
    assert (activations.activation_checkpointing, activations.activation_offload) == (True, True)
    assert (activations.activation_partition_group, activations.contiguous_checkpoints) == ((0, 1), True)
    assert activations.unit_classes == ("Block",) and policies.stage.stage == 3
    plain = policies_of(ZeroConfig(stage=2, quantized_gradients=True, offload_optimizer="disk"))
    assert (plain.store.gradient_block, plain.store.weight_block, plain.offload.on_disk) == (256, None, True)
    assert plain.store.bucket_elements(10**9) == ZeroConfig().bucket_elements(10**9)  # the same default size
