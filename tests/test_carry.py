"""What users carry over from Lightning's ``fsdp`` and ``deepspeed`` strategies.

``empty_init``: under zero3, ``init_module(empty_init=True)`` builds the model sharded *and initialized* (a
LitGPT's own model, or its shape in tests/litgpt_shaped.py where LitGPT is not installed (tests/litgpt_model.py): in process, the recorded values against eager construction bit for bit;
on 2 ranks, tests/workers/empty_init.py, a Fabric loop and a Trainer fit against ``ddp`` building eagerly).
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

import lightning as L
import pytest
import torch
from torch import nn

from lightning_zero.engine.construction import InitModuleRecording
from lightning_zero.testing.launch import launch
from tests.litgpt_model import GPT, Config

RTOL = 1e-5


# ---------------------------------------------------------------------- empty_init under zero3
def recorded_values(build, empty_init: bool = True) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """What setup would give the module ``build()`` makes under zero3's ``init_module(empty_init=...)``, and the CPU
    generator's state right after the context."""
    init = InitModuleRecording()
    with init.context(torch.device("cpu"), nullcontext(), empty_init):
        module = build()
    after = torch.get_rng_state()
    recording = init.take(module)
    assert recording is not None
    recording.keep(module)
    named = [*module.named_parameters(), *((f"buffer:{n}", b) for n, b in module.named_buffers())]
    values = recording.values_of([t for _, t in named])
    return {n: v for (n, _), v in zip(named, values)}, after


@pytest.mark.parametrize("config", [Config(), Config(n_layer=3, n_query_groups=4, rotary_percentage=0.5, bias=True)])
def test_litgpt_shaped_empty_init_equals_eager_bit_for_bit(config):
    torch.manual_seed(0)
    before = torch.get_rng_state()
    values, after = recorded_values(lambda: GPT(config))
    assert torch.equal(after, before)  # as ddp's skipped initializers: no draw left a trace on the generator
    torch.manual_seed(0)
    eager = GPT(config)
    expected = dict(eager.named_parameters()) | {f"buffer:{n}": b for n, b in eager.named_buffers()}
    assert values.keys() == expected.keys()
    for name, value in expected.items():
        assert torch.equal(values[name], value), name
        assert values[name].isfinite().all(), name


class _Uninitialized(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.scale = nn.Parameter(torch.empty(4))  # nothing ever writes it
        self.register_buffer("cache", torch.empty(4), persistent=False)  # a buffer forward fills: allowed


def test_a_parameter_construction_never_writes_is_refused_by_name():
    with pytest.raises(RuntimeError, match=r"never initializes 'scale' \(made with `torch.empty`"):
        recorded_values(_Uninitialized)
    recorded_values(_Uninitialized, empty_init=False)  # without empty_init: eager's values, garbage or not, as ddp


@pytest.fixture(scope="module")
def empty_init_ranks(tmp_path_factory) -> list[dict]:
    return launch("empty_init.py", 2, tmp_path_factory.mktemp("empty_init"), timeout=300)


@pytest.mark.timeout(360)
def test_fabric_loop_under_zero3_with_empty_init_matches_ddp(empty_init_ranks):
    for rank in empty_init_ranks:
        ddp, zero = rank["fabric_ddp"], rank["fabric_zero3"]
        assert zero["start"].keys() == ddp["start"].keys()
        for name, value in ddp["start"].items():
            assert torch.equal(zero["start"][name], value), name
        assert zero["norms"] and all(torch.isfinite(torch.as_tensor(n)) for n in zero["norms"])
        assert zero["losses"] and zero["losses"] == pytest.approx(ddp["losses"], rel=RTOL)
        assert ddp["end"] and zero["end"].keys() == ddp["end"].keys()
        assert [float(n) for n in zero["norms"]] == pytest.approx([float(n) for n in ddp["norms"]], rel=RTOL)
        for name, value in ddp["end"].items():
            torch.testing.assert_close(zero["end"][name], value, rtol=RTOL, atol=1e-6)


@pytest.mark.timeout(360)
def test_trainer_init_module_under_zero3_with_empty_init_matches_ddp(empty_init_ranks):
    for rank in empty_init_ranks:
        ddp, zero = rank["trainer_ddp"], rank["trainer_zero3"]
        assert len(zero["losses"]) == 2 and zero["losses"] == pytest.approx(ddp["losses"], rel=RTOL)
        assert ddp["end"] and zero["end"].keys() == ddp["end"].keys()
        for name, value in ddp["end"].items():
            torch.testing.assert_close(zero["end"][name], value, rtol=RTOL, atol=1e-6)


# ---------------------------------------------------------------------- several models on one Fabric
GAN = ["zero1", "zero2", "zero3"]


@pytest.fixture(scope="module")
def gan_ranks(tmp_path_factory) -> list[dict]:
    return launch("gan.py", 2, tmp_path_factory.mktemp("gan"), timeout=300)


@pytest.mark.timeout(360)
@pytest.mark.parametrize("strategy", GAN)
def test_two_models_on_one_fabric_match_ddp_step_for_step(gan_ranks, strategy):
    for rank in gan_ranks:
        ddp, zero = rank["ddp"], rank[strategy]
        assert len(zero["losses"]) == 8 and zero["losses"] == pytest.approx(ddp["losses"], rel=RTOL)
        assert [shape for _, shape in zero["norms"]] == [shape for _, shape in ddp["norms"]] == [()] * 4
        assert [n for n, _ in zero["norms"]] == pytest.approx([n for n, _ in ddp["norms"]], rel=RTOL)
        assert ddp["end"] and zero["end"].keys() == ddp["end"].keys()
        for name, value in ddp["end"].items():
            torch.testing.assert_close(zero["end"][name], value, rtol=RTOL, atol=1e-6)


@pytest.mark.timeout(360)
@pytest.mark.parametrize("strategy", GAN)
def test_two_models_resume_exactly_from_one_checkpoint(gan_ranks, strategy):
    for rank in gan_ranks:
        run = rank[strategy]
        resumed = run["resumed"]
        assert resumed["step"] == 2
        assert len(resumed["losses"]) == 4 and resumed["losses"] == run["losses"][4:]  # bit for bit: interrupted
        assert run["end"] and resumed["end"].keys() == run["end"].keys()
        for name, value in run["end"].items():
            assert torch.equal(resumed["end"][name], value), name


@pytest.mark.timeout(360)
@pytest.mark.parametrize("strategy", GAN)
@pytest.mark.parametrize("when", ["rolled_back", "after_eval"])
def test_two_models_that_trained_load_the_checkpoint_and_train_on_as_the_uninterrupted_run(gan_ranks, strategy, when):
    """The models and optimizers of the run load its checkpoint of step 2 (right after their last step, and after an
    evaluation forward): the steps after it are the run's own, bit for bit, as for fresh models; under zero3 every
    unit holds the loaded weights, the one gathered ahead of the next step included."""
    for rank in gan_ranks:
        run = rank[strategy]
        again = run[when]
        assert again["step"] == 2
        assert len(again["losses"]) == 4 and again["losses"] == run["losses"][4:]
        assert run["end"] and again["end"].keys() == run["end"].keys()
        for name, value in run["end"].items():
            assert torch.equal(again["end"][name], value), name


@pytest.mark.timeout(360)
@pytest.mark.parametrize("strategy", GAN)
def test_the_checkpoint_of_two_models_inspects_and_consolidates(gan_ranks, strategy, tmp_path):
    import lightning_zero
    from lightning_zero.cli import main

    run = gan_ranks[0][strategy]
    summary = lightning_zero.inspect_checkpoint(run["ckpt"])
    assert summary["optimizers"] == ["Adam", "SGD"] and summary["num_parameters"] == sum(v.numel() for v in run["saved"].values())
    assert main(["inspect", run["ckpt"]]) == 0
    out = tmp_path / "gan.ckpt"
    assert main(["consolidate", run["ckpt"], str(out)]) == 0
    full = torch.load(out, map_location="cpu", weights_only=True)
    expected = {("g." if name.startswith("0.") else "d.") + name[2:]: v for name, v in run["saved"].items()}
    assert full["state_dict"].keys() == expected.keys() and full["step"] == 2
    for name, value in expected.items():
        assert torch.equal(full["state_dict"][name], value), name
    assert len(full["optimizer_states"]) == 2


@pytest.fixture(scope="module")
def detached_gan_ranks(tmp_path_factory) -> list[dict]:
    return launch("gan_detached.py", 2, tmp_path_factory.mktemp("gan_detached"), timeout=300)


@pytest.mark.timeout(360)
@pytest.mark.parametrize("strategy", ["zero1", "zero2", "zero3", "zero3-units"])
def test_the_generator_backward_after_the_discriminator_step_on_its_detached_output_matches_ddp(
    detached_gan_ranks, strategy
):
    """Fabric's DCGAN order: the discriminator's backward (on ``fake.detach()``) ends before the generator's, whose
    graph still holds views of the generator's gathered parameters."""
    for rank in detached_gan_ranks:
        ddp, zero = rank["ddp"], rank[strategy]
        assert len(zero["losses"]) == 6 and zero["losses"] == pytest.approx(ddp["losses"], rel=1e-6)
        assert len(zero["weights"]) == len(ddp["weights"]) == 3
        for step, (actual, expected) in enumerate(zip(zero["weights"], ddp["weights"])):  # after every step
            assert actual.keys() == expected.keys()
            for name, value in expected.items():
                torch.testing.assert_close(actual[name], value, rtol=1e-6, atol=1e-7, msg=f"step {step}: {name}")


# ---------------------------------------------------------------------- a model set up again
def _model_and_data() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    return model, torch.randn(8, 4), torch.randn(8, 2)


def _train(model: nn.Module, optimizer: Any, x: torch.Tensor, y: torch.Tensor, steps: int, backward: Any) -> None:
    for _ in range(steps):
        backward(nn.functional.mse_loss(model(x), y))
        optimizer.step()
        optimizer.zero_grad()


def _plain_adam(steps: int) -> tuple[nn.Module, torch.optim.Adam]:
    """Plain torch (``ddp`` at world size 1), the oracle."""
    model, x, y = _model_and_data()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.05)
    _train(model, optimizer, x, y, steps, lambda loss: loss.backward())
    return model, optimizer


def _fabric(stage: int) -> L.Fabric:
    fabric = L.Fabric(strategy=f"zero{stage}", accelerator="cpu", devices=1)
    fabric.launch()
    return fabric


def test_inspect_shows_the_progress_a_fabric_checkpoint_saved(tmp_path, capsys):
    from lightning_zero.cli import main

    fabric = _fabric(2)
    model, x, y = _model_and_data()
    model, optimizer = fabric.setup(model, torch.optim.Adam(model.parameters(), lr=0.05))
    fabric.save(tmp_path / "run.ckpt", {"model": model, "optimizer": optimizer, "step": 7, "epoch_of_data": 2})
    assert main(["inspect", str(tmp_path / "run.ckpt")]) == 0
    out = capsys.readouterr().out
    assert "progress     step 7, epoch_of_data 2 (saved beside the models" in out and "None" not in out, out


@pytest.mark.parametrize("stage", [2, 3])
def test_a_model_set_up_again_trains_as_one_setup(stage):
    fabric = _fabric(stage)
    model, x, y = _model_and_data()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.05)
    fabric.setup(model)  # then with a fresh optimizer, as a re-run notebook cell does
    wrapped, wrapped_opt = fabric.setup(model, optimizer)
    _train(wrapped, wrapped_opt, x, y, 2, fabric.backward)
    wrapped, wrapped_opt = fabric.setup(model, optimizer)  # again, after steps: the Adam state carries over
    assert len(fabric.strategy.engines) == 1
    _train(wrapped, wrapped_opt, x, y, 2, fabric.backward)
    expected, _ = _plain_adam(4)
    with fabric.strategy.gathered_parameters():
        for actual, value in zip(model.parameters(), expected.parameters()):
            torch.testing.assert_close(actual, value, rtol=RTOL, atol=1e-6)


@pytest.mark.parametrize("stage", [2, 3])
def test_a_model_set_up_again_gives_its_optimizer_back_whole(stage):
    fabric = _fabric(stage)
    model, x, y = _model_and_data()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.05)
    wrapped, wrapped_opt = fabric.setup(model, optimizer)
    _train(wrapped, wrapped_opt, x, y, 2, fabric.backward)
    fabric.setup_module(model)  # the model alone: its old engine lets the optimizer go
    expected_model, expected_opt = _plain_adam(2)
    assert type(optimizer) is torch.optim.Adam
    assert optimizer.param_groups[0]["params"] == list(model.parameters())
    with fabric.strategy.gathered_parameters():  # zero3: the model is sharded again by its new engine
        for param, value in zip(model.parameters(), expected_model.parameters()):
            torch.testing.assert_close(param.detach(), value.detach(), rtol=RTOL, atol=1e-6)
    state = [optimizer.state[p] for p in model.parameters()]
    for actual, value in zip(state, (expected_opt.state[p] for p in expected_model.parameters())):
        assert actual.keys() == value.keys()
        for key in value:
            torch.testing.assert_close(actual[key], value[key], rtol=RTOL, atol=1e-7)
