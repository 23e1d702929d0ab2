"""ZeRO-Offload of the optimizer (``offload_optimizer=True``): DDP is still the oracle, the host buffers are storages
of their own, and checkpoints move freely between offloaded and non-offloaded runs.

Every multi-rank scenario runs in one launch of ``tests/workers/offload.py`` on 2 gloo ranks (imports alone cost
seconds per launch); the tests compare what it saved.
"""

from __future__ import annotations

from contextlib import nullcontext
from pathlib import Path

import lightning as L
import pytest
import torch

from lightning_zero import ZeroConfig, ZeroStrategy
from lightning_zero.engine.memory import expected_offload_bytes
from lightning_zero.engine.buckets import GradientReducer
from lightning_zero.engine.layout import plan_layout
from lightning_zero.engine.offload import HostGrads, allocate_master, check_steps_on_host, fused_hint
from tests.launch import launch
from tests.models import TinyLM

STAGES = ["zero1+offload", "zero2+offload", "zero3+offload"]
PARAMS = ["zero3+params", "zero3+offload+params"]  # offload_params without and with offload_optimizer
RTOL = 1e-5  # fp32: only the reduction order differs from DDP (see test_parity.py)


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list[dict]:
    return launch("offload.py", 2, tmp_path_factory.mktemp("offload"), timeout=300)


def _assert_losses_close(actual: list[float], expected: list[float], rtol: float) -> None:
    assert len(actual) == len(expected) > 0
    for step, (a, e) in enumerate(zip(actual, expected)):
        assert abs(a - e) <= rtol * abs(e), f"step {step}: loss {a} vs reference {e}"


def _assert_params_close(actual: dict, expected: dict, rtol: float) -> None:
    assert actual.keys() == expected.keys()
    for name, e in expected.items():
        e = e.double()
        err = (actual[name].double() - e).norm() / e.norm().clamp_min(1e-12)
        assert err <= rtol, f"{name}: relative difference {err:.2e} > {rtol:.0e}"


@pytest.mark.parametrize(("scenario", "stage"), [(scenario, stage) for scenario in ("adamw", "gan_manual")
                                                  for stage in STAGES]
                         + [("shared_adafactor", stage) for stage in STAGES[1:]]
                         + [(scenario, p) for scenario in ("adamw", "gan_manual") for p in PARAMS]
                         + [("shared_adafactor", PARAMS[1])])
def test_fp32_offloaded_matches_ddp_step_for_step(results, scenario, stage):
    # adamw: two param groups, a frozen norm, an LR schedule, accumulation over 2 micro-batches, norm clipping;
    # gan_manual: manual optimization with two optimizers (Adam, SGD) and `clip_gradients`; shared_adafactor: three
    # optimizers sharing parameters (SGD with a closure, Adam after clipping, Adafactor stepping on whole tensors)
    for rank in results:
        _assert_losses_close(rank[scenario][stage]["losses"], rank[scenario]["ddp"]["losses"], RTOL)
        _assert_params_close(rank[scenario][stage]["params"], rank[scenario]["ddp"]["params"], RTOL)
    for name, value in results[1][scenario][stage]["params"].items():
        assert torch.equal(value, results[0][scenario][stage]["params"][name]), f"{name} differs between ranks"


@pytest.mark.parametrize("stage", STAGES + PARAMS)
def test_validation_during_and_after_fit_matches_ddp(results, stage):
    # adamw validates every 4 batches during fit, then `trainer.validate` sets the (sharded) model up again
    for rank in results:
        assert rank["adamw"][stage]["val_loss"] == pytest.approx(rank["adamw"]["ddp"]["val_loss"], rel=RTOL)


@pytest.mark.parametrize("stage", STAGES + PARAMS[1:])
@pytest.mark.parametrize("scenario", ["adamw", "bf16_mixed"])
def test_host_buffers_are_separate_and_carry_the_gradients(results, scenario, stage):
    # Checked before each optimizer step on every rank: the master shard and the optimizer states are CPU tensors
    # that share no storage with the working parameters, the flat buffer or the device gradient shard; the
    # masters' gradients are views of the host gradient buffer, which holds the device shard's values.
    for rank in results:
        seen = rank[scenario][stage]["probe"]
        assert len(seen) == 6 if scenario == "adamw" else len(seen) == 4
        failed = [(step, check) for step, checks in enumerate(seen) for check, ok in checks.items() if not ok]
        assert not failed, failed


@pytest.mark.parametrize("scenario", ["adamw", "bf16_mixed"])
@pytest.mark.parametrize("stage", PARAMS)
def test_host_parameter_shards_are_separate_and_units_freed_after_each_step(results, scenario, stage):
    # Checked after every training batch on every rank: the working parameter shard is a CPU tensor sharing no
    # storage with the parameters, the unit buffers or the gradient shard; with the optimizer offloaded too in fp32
    # it is the host master itself (no second host copy); every unit but the root holds no memory; the batch's
    # gathers uploaded at least this rank's whole shard from the host.
    for rank in results:
        seen = rank[scenario][stage]["param_probe"]
        assert len(seen) == (12 if scenario == "adamw" else 4)
        failed = [(step, check) for step, checks in enumerate(seen) for check, ok in checks.items() if not ok]
        assert not failed, failed


@pytest.mark.parametrize("stage", STAGES + PARAMS)
@pytest.mark.parametrize(("scenario", "precision"), [("adamw", "32-true"), ("bf16_mixed", "bf16-mixed")])
def test_device_and_host_bytes_match_the_formula(results, scenario, precision, stage):
    # measured after the second backward (optimizer states exist); padding and a frozen norm stay within 5%
    for rank in results:
        states = rank[scenario][stage]["states"]
        device, host = expected_offload_bytes(states["numel"], 2, int(stage[4]), precision, "+offload" in stage,
                                              "+params" in stage)
        assert abs(states["device_model_states"] - device) <= 0.05 * device, (states, device)
        assert abs(states["host"] - host) <= 0.05 * host, (states, host)


def test_bf16_mixed_offloaded_close_to_ddp_amp(results):
    # the bound of test_parity.py's bf16 test: bf16 working weights against DDP's fp32 weights under autocast
    for rank in results:
        runs = rank["bf16_mixed"]
        for stage in STAGES + PARAMS:
            _assert_losses_close(runs[stage]["losses"], runs["ddp"]["losses"], 1e-2)
            assert all(v.dtype == torch.float32 for v in runs[stage]["params"].values())
        # stages 1 and 2 do the same arithmetic in the same order, offloaded or not
        _assert_losses_close(runs["zero2+offload"]["losses"], runs["zero1+offload"]["losses"], 1e-6)
        _assert_params_close(runs["zero2+offload"]["params"], runs["zero1+offload"]["params"], 1e-6)
        # where the parameter shard lives changes no arithmetic: with the optimizer offloaded in both, bit for bit
        assert runs["zero3+offload+params"]["losses"] == runs["zero3+offload"]["losses"]
        _assert_params_close(runs["zero3+offload+params"]["params"], runs["zero3+offload"]["params"], 0.0)


def test_fp16_loss_scaling_skips_the_overflowed_step_on_every_rank(results):
    scalers = [rank["fp16_overflow"]["zero2+offload"]["scaler"] for rank in results]
    assert all(s["skipped_steps"] == 1 and s["scale"] == 1024.0 and s["good_steps"] == 3 for s in scalers), scalers
    assert all(torch.isfinite(torch.tensor(results[0]["fp16_overflow"]["zero2+offload"]["losses"])))


def test_checkpoint_round_trip_offloaded_plain_offloaded(results):
    # zero2+offload saves one full file, zero3 without offload resumes from it and saves a sharded directory,
    # zero1+offload resumes from that: the same losses as three epochs in one run without offload
    for rank in results:
        run = rank["round_trip"]["zero"]
        _assert_losses_close(run["resumed"], run["straight"], RTOL)


def test_checkpoint_round_trip_offloaded_params_plain_offloaded_params(results):
    # zero3 + offload_params saves a sharded directory, zero2 resumes from it and saves one full file, zero3 with
    # offload_params and offload_optimizer resumes from that: the same losses as three epochs in one run
    for rank in results:
        run = rank["round_trip"]["zero"]
        _assert_losses_close(run["resumed_params"], run["straight"], RTOL)


# ---------------------------------------------------------------------- one process
def test_option_is_checked_and_reaches_the_config():
    assert ZeroStrategy(stage=3, offload_optimizer=True).config.offload_optimizer is True
    assert ZeroConfig().offload_optimizer is False
    with pytest.raises(TypeError, match="`offload_optimizer` must be a bool"):
        ZeroStrategy(offload_optimizer="yes")


def test_option_from_yaml(tmp_path: Path):
    from lightning.pytorch.cli import LightningCLI

    config = tmp_path / "offload.yaml"
    config.write_text("trainer:\n  accelerator: cpu\n  devices: 1\n  logger: false\n  strategy:\n    class_path: "
                      "lightning_zero.ZeroStrategy\n    init_args: {stage: 3, offload_optimizer: true, offload_params: "
                      "true}\n")
    cli = LightningCLI(TinyLM, args=["--config", str(config)], run=False, save_config_callback=None)
    assert cli.trainer.strategy.config.offload_optimizer is True
    assert cli.trainer.strategy.config.offload_params is True


def test_host_gradient_buffer_follows_every_write_of_the_device_shard():
    # one process (collectives copy): bf16 gradients, two accumulated backwards, then another optimizer's zero_grad of
    # one parameter; after each, the host buffer (plain CPU memory here, no CUDA) equals the device shard in fp32
    layout = plan_layout([10, 7, 5], [0, 0, 0], 1, 8)
    reducer = GradientReducer(layout, 0, torch.bfloat16, torch.device("cpu"), 2, overlap=False)
    host = HostGrads(layout.shard_size, torch.float32, torch.device("cpu"))
    host.follow(reducer)
    for scale in (1.0, 0.5):  # a second backward accumulates into the shard
        for j, n in enumerate(layout.numels):
            reducer.add_grad(j, torch.arange(n, dtype=torch.bfloat16) * scale + j)
        reducer.flush()
        reducer.wait()
        assert torch.equal(host.ready(), reducer.grad_shard.float())
    reducer.clear_params([1])
    buffer = host.ready()
    assert torch.equal(buffer, reducer.grad_shard.float()) and buffer.abs().sum() > 0
    assert buffer.device.type == "cpu" and not buffer.is_pinned() and buffer.dtype == torch.float32
    assert buffer.untyped_storage().data_ptr() != reducer.grad_shard.untyped_storage().data_ptr()
    assert host.ready() is buffer  # one buffer, kept
    assert not allocate_master(10, torch.float32, torch.device("cpu"), offload=True).is_pinned()


class _CudaOnlySGD(torch.optim.SGD):
    """Stands for an optimizer with GPU kernels only (apex's FusedAdam, 8-bit optimizers ...)."""

    def step(self, closure=None):
        if any(p.device.type != "cuda" for g in self.param_groups for p in g["params"]):
            raise RuntimeError("expected CUDA tensors")
        return super().step(closure)


class _CudaOnlyModel(TinyLM):
    def configure_optimizers(self):
        return _CudaOnlySGD(self.parameters(), lr=0.1)


def test_an_optimizer_that_cannot_step_on_cpu_is_refused_at_setup():
    with pytest.raises(TypeError, match=r"offload_optimizer=True.*\._CudaOnlySGD failed to step on one .*CUDA"):
        check_steps_on_host(_CudaOnlySGD([torch.zeros(2, requires_grad=True)], lr=0.1))
    module = _CudaOnlyModel()
    before = {n: p.detach().clone() for n, p in module.named_parameters()}
    trainer = L.Trainer(strategy=ZeroStrategy(stage=2, offload_optimizer=True), accelerator="cpu", devices=1,
                        max_steps=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    with pytest.raises(TypeError, match="failed to step on one"):
        trainer.fit(module)
    assert all(torch.equal(before[n], p) for n, p in module.named_parameters())
    fused = torch.optim.AdamW([torch.zeros(2, requires_grad=True)], fused=True)
    check_steps_on_host(fused)  # CPU kernels exist
    assert fused_hint(fused) is None and fused_hint(torch.optim.SGD([torch.zeros(2)], lr=0.1)) is None


def test_estimate_shows_device_and_host_bytes(capsys):
    from lightning_zero.cli import main as cli

    assert cli(["estimate", "--params", "1B", "-n", "4", "--memory", "16GiB"]) == 0
    out = capsys.readouterr().out
    # bf16-mixed, N = 4: zero3+offload keeps 2Ψ/N + 2Ψ/N = 1 GB on the device and 16Ψ/N = 4 GB on the host
    # and with offload_params 2Ψ/N = 0.5 GB on the device, 18Ψ/N = 4.5 GB on the host
    assert ("| bf16-mixed | 3.7 GiB + 3.7 GiB host | 2.3 GiB + 3.7 GiB host | 953.7 MiB + 3.7 GiB host | 476.8 MiB + "
            "4.2 GiB host |\n") in out
    # the device holds 4 of zero3's 16 bytes per parameter: 4x the model on the same device memory (8x with params)
    assert "| bf16-mixed | 1.07B | 2.45B | 3.12B | 4.29B | 4.29B | 6.87B | 17.18B | 34.36B |\n" in out


@pytest.mark.parametrize(("options", "device", "host", "share"), [
    ({"offload_optimizer": True}, 8, 16, "50%"),
    ({"offload_params": True}, 16, 4, "100%"),  # fp32: the device keeps the master for its own step
    ({"offload_optimizer": True, "offload_params": True}, 4, 16, "25%"),  # the host shard is the host master
])
def test_fit_summary_shows_device_and_host_bytes(caplog, options, device, host, share):
    import logging

    warns = pytest.warns(UserWarning, match=r"torch.optim.AdamW\(\.\.\., fused=True\)")
    with caplog.at_level(logging.INFO), (warns if options.get("offload_optimizer") else nullcontext()):
        L.Trainer(strategy=ZeroStrategy(stage=3, **options), accelerator="cpu", devices=1, max_steps=1,
                  logger=False, enable_checkpointing=False, enable_progress_bar=False,
                  enable_model_summary=False).fit(TinyLM(scheduler=False))
    psi = sum(p.numel() for p in TinyLM().parameters())
    lines = [r.getMessage() for r in caplog.records if "ZeRO stage" in r.getMessage()]
    assert lines == [f"ZeRO stage 3 on 1 rank, precision 32-true: {psi:,} trainable parameters; model states "
                     f"{psi * device / 1024:.1f} KiB on the device + {psi * host / 1024:.1f} KiB in host memory "
                     f"({', '.join(options)}) per rank (DDP: {psi * 16 / 1024:.1f} KiB, {share} of it)"]


def test_offload_benchmark_measures_every_cpu_step_against_the_bound():
    from benchmarks.offload import _table_cpu, cpu_step

    rows = cpu_step(300_000, repeats=1)  # tiny: this checks the script runs, not the machine
    names = [r["name"] for r in rows]
    assert names[:4] == ["memory bound (triad bandwidth)", "AdamW (torch default on CPU)", "AdamW foreach=True",
                         "AdamW fused=True"]
    assert all(r["seconds"] > 0 and r["bandwidth"] > 0 for r in rows) and rows[0]["efficiency"] == 1.0
    assert "| AdamW fused=True |" in _table_cpu(rows, 300_000, 1)
