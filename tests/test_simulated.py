"""Rank 0 of a 64-rank world, measured in this process on torch's fake process group (``estimate --measure``).

A GPT of a few million parameters under zero3 and bf16-mixed: its model states must be docs/stages.md's 16Ψ/N by kind,
its traffic 3Ψ (the first step gathers every unit twice), no check that compares values across ranks may run, and
nothing may be written or left behind (the process group is gone after).
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, TensorDataset

from examples.gpt import GPT
from lightning_zero.cli import main as cli
from lightning_zero.comm import collectives
from lightning_zero.estimate import expected_by_kind
from lightning_zero.lightning.simulated import measure_rank

N = 64


class SimGPT(GPT):
    """The project's GPT built in ``configure_model``, on a fixed random token stream of one sequence per rank."""

    def __init__(self, width: int = 256, depth: int = 4, vocab: int = 4096, seq: int = 32) -> None:
        super().__init__(n_layer=depth, n_head=4, n_embd=width, context=seq, dropout=0.0, vocab_size=vocab,
                         meta_init=True, gpt2_init=False)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        tokens = torch.randint(0, self.arch.vocab_size, (N, self.arch.context + 1), generator=g)
        return DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=1)


@pytest.fixture
def no_process_group():
    """A Trainer test before may leave its (real) process group to the end of the process; a simulated world
    needs a process without one."""
    collectives.release_process_groups()


def _refuse(what: str):
    def refuse(*args, **kwargs):
        raise AssertionError(f"{what} ran on a simulated rank")

    return refuse


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    cwd = tmp_path_factory.mktemp("simulated")
    collectives.release_process_groups()  # see `no_process_group`
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(cwd)
        # the checks across ranks must stand aside even when asked for
        mp.setattr("lightning_zero.stage3.lockstep.LockstepCheck.start", _refuse("the lockstep check"))
        mp.setattr("lightning_zero.engine.engine.global_grad_norm", _refuse("the non-finite guard"))
        result = measure_rank(SimGPT(), N, stage=3, precision="bf16-mixed", lockstep_check="strict",
                              nonfinite="raise")
    return result, cwd


def test_model_states_are_16_psi_over_n_by_kind(measured):
    result, _ = measured
    assert 3_000_000 < result.params < 6_000_000 and result.world_size == N
    expected = expected_by_kind(result.params, N, 3, "bf16-mixed")
    for kind, value in result.model_states.items():
        # each flat shard pads to a multiple of N elements: at most one element per rank and tensor group
        assert expected[kind] <= value <= expected[kind] * 1.01, (kind, value, expected[kind])
    assert result.expected_model_states_bytes == 16 * result.params / N
    assert result.model_states_bytes == pytest.approx(16 * result.params / N, rel=0.01)


def test_the_first_step_sends_3_psi(measured):
    result, _ = measured
    elements = result.traffic_elements
    assert set(elements) <= {"all_gather", "reduce_scatter", "control"}, elements
    assert result.params <= elements["reduce_scatter"] <= result.params * 1.01
    assert 2 * result.params <= elements["all_gather"] <= 2 * result.params * 1.01
    assert result.traffic_elements_per_step == pytest.approx(3 * result.params, rel=0.01)


def test_the_peak_is_bounded_and_accounted(measured):
    result, _ = measured
    parts = result.peak_parts
    # the highest reading is the engine's (which one depends on the heap: with one step, the first gradient of its
    # backward comes before any bucket buffer exists), and a gathered unit is alive at every one of them
    assert result.peak_at in {"the end of setup", "the first gradient of a backward", "the end of a backward",
                              "the end of an optimizer step"}, result.peak_at
    assert parts["gathered units (pool)"] > 0
    # no lower bound: in a process that has run other tests, glibc's free heap can hold this small rank whole
    assert result.peak_rss_bytes < 512 * 2**20


def test_nothing_is_written_and_no_process_group_is_left(measured):
    result, cwd = measured
    assert list(cwd.iterdir()) == []
    assert not dist.is_initialized()
    assert "stage 3's lockstep check" in result.standing_aside


def test_a_process_with_a_process_group_is_refused(no_process_group):
    collectives.register_simulated_backend()
    dist.init_process_group(collectives.SIMULATED_BACKEND, rank=0, world_size=2)
    try:
        with pytest.raises(RuntimeError, match="already has a process group"):
            measure_rank(SimGPT(), N)
    finally:
        collectives.release_process_groups()


def test_disk_offload_cannot_be_simulated(no_process_group):
    with pytest.raises(ValueError, match="cannot be simulated"):
        measure_rank(SimGPT(), N, offload_optimizer="disk")
    assert not dist.is_initialized()


def test_the_command_prints_one_json_object(capsys, tmp_path, monkeypatch, no_process_group):
    monkeypatch.chdir(tmp_path)
    code = cli(["estimate", "--measure", "--json", "--model", "tests.test_simulated.SimGPT", "--init-args",
                "{width: 64, depth: 1, vocab: 256}", "-n", "8"])
    assert code == 0
    out = capsys.readouterr().out
    data = json.loads(out[out.index("{"):])
    assert data["world_size"] == 8 and data["params"] > 0
    assert data["model_states_bytes"] == pytest.approx(16 * data["params"] / 8, rel=0.02)
    assert data["traffic_elements_per_step"] >= 2 * data["params"] and data["peak_rss_bytes"] > 0


def test_the_command_refuses_measure_without_a_model_or_a_lightning_module(capsys):
    assert cli(["estimate", "--measure", "--params", "1B", "-n", "64"]) == 2
    assert "--measure needs --model" in capsys.readouterr().err
    assert cli(["estimate", "--measure", "--model", "torch.nn.Linear", "-n", "64"]) == 2
    assert "not a LightningModule" in capsys.readouterr().err


@pytest.mark.parametrize(
    "options, shard_size",
    [({}, 1024), ({"shard_group_size": 8}, 8), ({"secondary_shard_group_size": 8}, 1024),
     ({"tensor_parallel_size": 4}, 256)],
    ids=["plain", "hybrid", "hpZ", "tensor-parallel"],
)
def test_1024_ranks_with_tensors_smaller_than_the_world(options, shard_size, no_process_group):
    """Norms of 256 elements over 1024 ranks (most ranks hold padding only), and every group layout's groups made
    at N = 1024: the states are still 16Ψ/k, the gradients reduce-scattered once."""
    result = measure_rank(SimGPT(), 1024, **options)
    assert result.shard_size == shard_size
    # under tensor parallelism Ψ of the formulas is this rank's slices (and the replicated norms and embeddings)
    assert (result.params < result.model_params) == ("tensor_parallel_size" in options)
    expected = 16 * result.params / shard_size
    assert expected <= result.model_states_bytes <= expected * 1.01
    assert result.params <= result.traffic_elements["reduce_scatter"] <= result.params * 1.01
