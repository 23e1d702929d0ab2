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
from lightning_zero.shards.accounting import expected_offload_bytes
from lightning_zero.shards.buckets import GradientReducer
from lightning_zero.shards.layout import plan_layout
from lightning_zero.estimate import human_bytes
from lightning_zero.shards.offload import HostGrads, allocate_master, check_steps_on_host, fused_hint
from tests.compare import (BF16_DISPLACEMENT_RTOL, assert_displacements_close, assert_losses_close, assert_model_close,
                           assert_params_close, mixed_precision_rtol)
from lightning_zero.testing.launch import launch
from tests.models import TinyLM

STAGES = ["zero1+offload", "zero2+offload", "zero3+offload"]
PARAMS = ["zero3+params", "zero3+offload+params"]  # offload_params without and with offload_optimizer
#: The same on disk ("+disk": offload_optimizer="disk", "+pdisk": offload_params="disk"; see shards/disk.py).
DISK = ["zero1+disk", "zero2+disk", "zero3+disk", "zero3+pdisk", "zero3+disk+pdisk"]
RTOL = 1e-5  # fp32: only the reduction order differs from DDP (see test_parity.py)


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list[dict]:
    return launch("offload.py", 2, tmp_path_factory.mktemp("offload"), timeout=300)


@pytest.mark.parametrize(("scenario", "stage"), [(scenario, stage) for scenario in ("adamw", "gan_manual")
                                                  for stage in STAGES]
                         + [("shared_adafactor", stage) for stage in STAGES[1:]]
                         + [(scenario, p) for scenario in ("adamw", "gan_manual") for p in PARAMS]
                         + [("shared_adafactor", PARAMS[1])]
                         + [(scenario, d) for scenario in ("adamw", "gan_manual") for d in DISK]
                         + [("shared_adafactor", d) for d in ("zero2+disk", "zero3+disk+pdisk")])
def test_fp32_offloaded_matches_ddp_step_for_step(results, scenario, stage):
    # adamw: two param groups, a frozen norm, an LR schedule, accumulation over 2 micro-batches, norm clipping;
    # gan_manual: manual optimization with two optimizers (Adam, SGD) and `clip_gradients`; shared_adafactor: three
    # optimizers sharing parameters (SGD with a closure, Adam after clipping, Adafactor stepping on whole tensors)
    for rank in results:
        assert_losses_close(rank[scenario][stage]["losses"], rank[scenario]["ddp"]["losses"], RTOL)
        assert_params_close(rank[scenario][stage]["params"], rank[scenario]["ddp"]["params"], RTOL)
    for name, value in results[1][scenario][stage]["params"].items():
        assert torch.equal(value, results[0][scenario][stage]["params"][name]), f"{name} differs between ranks"


@pytest.mark.parametrize("stage", STAGES + PARAMS + DISK)
def test_validation_during_and_after_fit_matches_ddp(results, stage):
    # adamw validates every 4 batches during fit, then `trainer.validate` sets the (sharded) model up again
    for rank in results:
        assert rank["adamw"][stage]["val_loss"] == pytest.approx(rank["adamw"]["ddp"]["val_loss"], rel=RTOL)


@pytest.mark.parametrize("stage", STAGES + PARAMS[1:] + [d for d in DISK if "+disk" in d])
@pytest.mark.parametrize("scenario", ["adamw", "bf16_mixed"])
def test_host_buffers_are_separate_and_carry_the_gradients(results, scenario, stage):
    # Checked before each optimizer step on every rank: the master shard and the optimizer states are CPU tensors
    # that share no storage with the working parameters, the flat buffer or the device gradient shard; the
    # masters' gradients are views of the host gradient buffer, which holds the device shard's values; with
    # offload_optimizer="disk" the master and the states are file mappings (and only then).
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
    # gathers uploaded at least this rank's whole shard from the host; with the optimizer offloaded too, the device
    # holds no gradient shard.
    for rank in results:
        seen = rank[scenario][stage]["param_probe"]
        assert len(seen) == (12 if scenario == "adamw" else 4)
        failed = [(step, check) for step, checks in enumerate(seen) for check, ok in checks.items() if not ok]
        assert not failed, failed


@pytest.mark.parametrize("stage", STAGES + PARAMS)
@pytest.mark.parametrize(("scenario", "precision"), [("adamw", "32-true"), ("bf16_mixed", "bf16-mixed")])
def test_device_and_host_bytes_match_the_formula(results, scenario, precision, stage):
    # measured after the second backward (optimizer states exist); padding stays within 5%. The parameters in no
    # optimizer (a frozen norm, an unused scale: kept whole on the device) come on top: with both offloads they are
    # all the device holds
    for rank in results:
        states = rank[scenario][stage]["states"]
        number = int(stage[4])
        # stage 1's figure counts the full gradients it holds inside no_backward_sync (the scenarios accumulate);
        # after the backward a step follows they are reduced already, as stage 2's are: either, by the backward measured
        figures = [expected_offload_bytes(states["numel"], 2, s, precision, "+offload" in stage, "+params" in stage)
                   for s in ([1, 2] if number == 1 else [number])]
        close = [(d + states["unmanaged"], h) for d, h in figures
                 if abs(states["device_model_states"] - d - states["unmanaged"]) <= 0.05 * (d + states["unmanaged"])]
        assert close, (states, figures)
        device, host = close[0]
        assert abs(states["host"] - host) <= 0.05 * host, (states, host)


def test_bf16_mixed_offloaded_close_to_ddp_amp(results):
    # the bound of test_parity.py's bf16 test: bf16 working weights against DDP's fp32 weights under autocast
    L.seed_everything(0, verbose=False)  # the worker's weights before each run (tests/workers/offload.py)
    initial = {n: p.detach().clone() for n, p in TinyLM(scheduler=False, lr=1e-2).named_parameters()}
    for rank in results:
        runs = rank["bf16_mixed"]
        for stage in STAGES + PARAMS:
            assert_losses_close(runs[stage]["losses"], runs["ddp"]["losses"], 1e-2)
            assert all(v.dtype == torch.float32 for v in runs[stage]["params"].values())
            # 4 steps, all weights together: see [Note: the mixed-precision bound on parameters] in compare.py
            assert_model_close(runs[stage]["params"], runs["ddp"]["params"], mixed_precision_rtol(4))
            # per tensor, against how far it moved: see [Note: the bf16 bound on displacements] in compare.py
            assert_displacements_close(runs[stage]["params"], runs["ddp"]["params"], initial, BF16_DISPLACEMENT_RTOL)
        # stages 1 and 2 do the same arithmetic in the same order, offloaded or not
        assert_losses_close(runs["zero2+offload"]["losses"], runs["zero1+offload"]["losses"], 1e-6)
        assert_params_close(runs["zero2+offload"]["params"], runs["zero1+offload"]["params"], 1e-6)
        # where the parameter shard lives changes no arithmetic: with the optimizer offloaded in both, bit for bit
        assert runs["zero3+offload+params"]["losses"] == runs["zero3+offload"]["losses"]
        assert_params_close(runs["zero3+offload+params"]["params"], runs["zero3+offload"]["params"], 0.0)


#: Each disk run and the host-memory run with the same placement otherwise.
DISK_TWINS = {"zero1+disk": "zero1+offload", "zero2+disk": "zero2+offload", "zero3+disk": "zero3+offload",
              "zero3+pdisk": "zero3+params", "zero3+disk+pdisk": "zero3+offload+params"}


@pytest.mark.parametrize("scenario", ["adamw", "gan_manual", "bf16_mixed"])
@pytest.mark.parametrize("stage", DISK)
def test_disk_runs_are_bitwise_the_host_offloaded_runs(results, scenario, stage):
    # where the states live changes no arithmetic: the windows step the same tensors in the same pieces
    for rank in results:
        runs = rank[scenario]
        assert runs[stage]["losses"] == runs[DISK_TWINS[stage]]["losses"]
        assert_params_close(runs[stage]["params"], runs[DISK_TWINS[stage]]["params"], 0.0)


def test_fp16_loss_scaling_skips_the_overflowed_step_on_every_rank(results):
    scalers = [rank["fp16_overflow"]["zero2+offload"]["scaler"] for rank in results]
    assert all(s["skipped_steps"] == 1 and s["scale"] == 1024.0 and s["good_steps"] == 3 for s in scalers), scalers
    assert all(torch.isfinite(torch.tensor(results[0]["fp16_overflow"]["zero2+offload"]["losses"])))


def test_checkpoint_round_trip_offloaded_plain_offloaded(results):
    # zero2+offload saves one full file, zero3 without offload resumes from it and saves a sharded directory,
    # zero1+offload resumes from that: the same losses as three epochs in one run without offload
    for rank in results:
        run = rank["round_trip"]["zero"]
        assert_losses_close(run["resumed"], run["straight"], RTOL)


def test_checkpoint_round_trip_offloaded_params_plain_offloaded_params(results):
    # zero3 + offload_params saves a sharded directory, zero2 resumes from it and saves one full file, zero3 with
    # offload_params and offload_optimizer resumes from that: the same losses as three epochs in one run
    for rank in results:
        run = rank["round_trip"]["zero"]
        assert_losses_close(run["resumed_params"], run["straight"], RTOL)


@pytest.mark.parametrize("legs", ["resumed_disk", "resumed_plain_disk"])
def test_checkpoint_round_trip_between_disk_host_and_plain(results, legs):
    # resumed_disk: zero3 with both on disk saves a sharded directory, zero2 offloaded to the host resumes and saves
    # one full file, zero1 on disk resumes from that; resumed_plain_disk: zero3 in memory saves a full file, zero2 on
    # disk resumes and saves a sharded directory, zero3 with both offloaded to the host resumes: the same losses as
    # three epochs in one run
    for rank in results:
        run = rank["round_trip"]["zero"]
        assert_losses_close(run[legs], run["straight"], RTOL)


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


def test_the_gradient_shard_lives_only_on_the_host():
    # one process (collectives copy): bf16 gradients, two accumulated backwards, then another optimizer's zero_grad of
    # one parameter, then zero_grad and a round where one parameter gets no gradient. The offloaded reducer keeps no
    # device shard; its host shard (plain CPU memory here, no CUDA) equals a non-offloaded reducer's shard in fp32
    # (the values are exact in bf16, so accumulating in fp32 on the host or in bf16 on the device agree).
    layout = plan_layout([10, 7, 5], [0, 0, 0], 1, 8)
    host = HostGrads(layout.shard_size, torch.float32, torch.device("cpu"), max(b.chunk_size for b in layout.buckets))
    offloaded = GradientReducer(layout, 0, torch.bfloat16, torch.device("cpu"), 2, overlap=False, sink=host)
    plain = GradientReducer(layout, 0, torch.bfloat16, torch.device("cpu"), 2, overlap=False)

    def backward(scale: float, skip: int = -1) -> None:
        for reducer in (offloaded, plain):
            for j, n in enumerate(layout.numels):
                if j != skip:
                    reducer.add_grad(j, torch.arange(n, dtype=torch.bfloat16) * scale + j)
            reducer.flush()
            reducer.wait()

    for scale in (1.0, 0.5):  # a second backward accumulates into the shard
        backward(scale)
        assert offloaded.grad_shard is None and torch.equal(host.shard(), plain.grad_shard.float())
    for reducer in (offloaded, plain):
        reducer.clear_params([1])
    buffer = host.shard()
    assert torch.equal(buffer, plain.grad_shard.float()) and buffer.abs().sum() > 0
    assert buffer.device.type == "cpu" and not buffer.is_pinned() and buffer.dtype == torch.float32
    for reducer in (offloaded, plain):  # zero_grad, then parameter 2 gets no gradient: its slices read as zero
        reducer.clear()
    backward(2.0, skip=2)
    shards = [reducer.finalize(force=False) for reducer in (offloaded, plain)]
    assert shards[0] is buffer and torch.equal(shards[0], shards[1].float())  # one host shard, kept
    assert offloaded.grad_shard is None and host.staging == []  # on CPU nothing is staged
    assert offloaded.peak_buffer_bytes <= plain.peak_buffer_bytes + 2 * layout.max_bucket_elements * 2  # + scratch
    assert not allocate_master(10, torch.float32, torch.device("cpu"), offload=True).is_pinned()


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_device_model_states_do_not_grow_with_the_model_when_both_are_offloaded(precision):
    # stage 3 with offload_params and offload_optimizer, one process: after two accumulated backwards no gradient
    # shard exists on the device, no model state is left there, and the bucket buffers are the same for 4x the model
    from torch import nn

    from lightning_zero import ZeroEngine
    from lightning_zero.shards.accounting import measure_model_states

    seen = []
    for depth in (2, 8):
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Sequential(nn.Linear(32, 32), nn.GELU()) for _ in range(depth)], nn.Linear(32, 1))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
        engine = ZeroEngine(model, [optimizer], stage=3, precision=precision, offload_optimizer=True,
                            offload_params=True, persistence_threshold=0, reduce_bucket_size=500)
        for _ in range(2):
            with engine.forward_context():
                loss = model(torch.randn(4, 32)).float().pow(2).mean()
            engine.backward(loss)
        states = measure_model_states(model, [optimizer])
        assert engine.optimizers[0].storage.reducer.grad_shard is None
        seen.append((states.device_model_states, states.comm_buffers, states.host))
        engine.step()
        engine.teardown()
    (device_small, comm_small, host_small), (device_large, comm_large, host_large) = seen
    assert device_small == device_large == 0 and comm_small == comm_large > 0, seen
    assert host_large > 3 * host_small  # what grows is on the host


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
    # bf16-mixed, N = 4: the gradient shard is on the host only; zero3+offload keeps its 2Ψ/N = 0.5 GB of
    # parameters on the device and 16Ψ/N = 4 GB on the host, with offload_params no model state on the device and
    # 18Ψ/N = 4.5 GB on the host; zero1 keeps the full 2Ψ .grad until the step
    assert ("| bf16-mixed | 3.7 GiB (4.0 GB) + 3.7 GiB (4.0 GB) host | 1.9 GiB (2.0 GB) + 3.7 GiB (4.0 GB) host | "
            "476.8 MiB (500.0 MB) + 3.7 GiB (4.0 GB) host | 0 B + 4.2 GiB (4.5 GB) host |\n") in out
    # the device holds 2 of zero3's 16 bytes per parameter: 8x the model on the same device memory (no bound with
    # params: only the units in flight and the bucket buffers stay)
    assert "| bf16-mixed | 1.07B | 2.45B | 3.12B | 4.29B | 4.29B | 8.59B | 34.36B | no bound |\n" in out


@pytest.mark.parametrize(("options", "device", "host", "share"), [
    ({"offload_optimizer": True}, 4, 16, "25%"),  # the gradient shard is on the host only
    ({"offload_params": True}, 16, 4, "100%"),  # fp32: the device keeps the master for its own step
    ({"offload_optimizer": True, "offload_params": True}, 0, 16, "0%"),  # the host shard is the host master
    # on disk: the gradient shard on the host, the master (= the parameter shard) and Adam's states in files
    ({"offload_optimizer": "disk", "offload_params": "disk"}, 0, 4, "0%"),
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
    files = f"+ {human_bytes(psi * 12)} in files under the temporary directory " if "disk" in options.values() else ""
    assert lines == [f"ZeRO stage 3 on 1 rank, precision 32-true: {psi:,} trainable parameters; model states "
                     f"{human_bytes(psi * device)} on the device + {human_bytes(psi * host)} in host memory {files}"
                     f"({', '.join(options)}) per rank (DDP: {psi * 16 / 1024:.1f} KiB, {share} of it); parameters "
                     "gathered as one unit, once per step (see `persistence_threshold`)"]  # TinyLM's units are tiny


def test_offload_benchmark_measures_every_cpu_step_against_the_bound():
    from benchmarks.offload import _table_cpu, cpu_step

    rows = cpu_step(300_000, repeats=1)  # tiny: this checks the script runs, not the machine
    names = [r["name"] for r in rows]
    assert names[:4] == ["memory bound (triad bandwidth)", "AdamW (torch default on CPU)", "AdamW foreach=True",
                         "AdamW fused=True"]
    assert all(r["seconds"] > 0 and r["bandwidth"] > 0 for r in rows) and rows[0]["efficiency"] == 1.0
    assert "| AdamW fused=True |" in _table_cpu(rows, 300_000, 1)


@pytest.mark.parametrize("offload_optimizer", [True, False])
def test_the_refresh_follows_the_step_piece_by_piece(monkeypatch, offload_optimizer):
    """With the step in pieces (see [Note: the refresh follows the step piece by piece] in ``flat.py``), each piece's
    buckets are all-gathered before the next piece steps, every bucket exactly once, and the weights are those of
    one step."""
    from torch import nn

    from lightning_zero import ZeroEngine
    from lightning_zero.comm import collectives

    def build():
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Linear(16, 16) for _ in range(4)])
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)

    model, optimizer = build()
    engine = ZeroEngine(model, [optimizer], stage=2, offload_optimizer=offload_optimizer, reduce_bucket_size=300)
    events = []
    gather = collectives.all_gather
    monkeypatch.setattr(collectives, "all_gather", lambda *a, **k: events.append("gather") or gather(*a, **k))
    step = type(optimizer).step
    monkeypatch.setattr(type(optimizer), "step", lambda self, *a, **k: events.append("step") or step(self, *a, **k))
    reference, ref_optimizer = build()
    x = torch.randn(8, 16)
    model(x).square().mean().backward()
    engine.finish_backward()
    engine.step()
    reference(x).square().mean().backward()
    ref_optimizer.step()
    buckets = len(engine.optimizers[0].layout.buckets)
    assert events.count("step") > 1 and events.count("gather") == buckets  # in pieces; each bucket once
    assert events.index("gather") < len(events) - 1 - events[::-1].index("step")  # a gather before the last piece
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p, q)
