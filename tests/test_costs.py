"""What a step costs, counted without a clock (see [Note: what a step costs] in ``lightning_zero/memory/costs.py``): after
warm-up a step allocates nothing large of the engine's own and copies the gradients once. One process, no collective
partner: the engine's buffers, pool and counters are the same at any world size."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_zero import ZeroEngine
from lightning_zero.engine import engine as engine_module
from lightning_zero.memory import host_memory


def _model() -> nn.Module:
    torch.manual_seed(0)  # three units of 1M elements (4 MiB each in fp32), a root of biases
    return nn.Sequential(*(nn.Sequential(nn.Linear(512, 1024), nn.Linear(1024, 512)) for _ in range(3)))


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_a_step_allocates_nothing_large_after_warm_up_and_copies_the_gradients_once(stage):
    model = _model()
    engine = ZeroEngine(model, [torch.optim.AdamW(model.parameters(), lr=1e-3)], stage=stage)
    psi = sum(p.numel() for p in model.parameters())
    spent = []
    for _ in range(3):
        engine.step_costs()
        model(torch.ones(8, 512)).square().mean().backward()
        engine.finish_backward()
        engine.step()
        spent.append(engine.step_costs())
    engine.teardown()
    assert spent[0]["large_allocations"] > 0  # the first step makes the buckets, the shard, the pool's blocks
    for step in spent[1:]:
        assert step["large_allocations"] == 0, (stage, spent)
        assert step["copied_bytes"] == 4 * psi, (stage, step)  # each gradient into its bucket, once


def test_a_unit_gathered_again_reuses_the_pool_and_a_saved_view_reads_its_new_block():
    # two units of one size: the second unit's forward takes the block the first gave back, and backward gathers
    # the first again into whichever block is idle; ``F.linear`` saved ``W.t()`` in forward and must read it there
    model = nn.Sequential(nn.Linear(512, 512), nn.Linear(512, 512))
    reference = nn.Sequential(nn.Linear(512, 512), nn.Linear(512, 512))
    reference.load_state_dict(model.state_dict())
    engine = ZeroEngine(model, [torch.optim.SGD(model.parameters(), lr=0.1)], stage=3, prefetch_size=0)
    x = torch.randn(4, 512)
    for _ in range(2):
        model(x).square().sum().backward()
        engine.finish_backward()
        engine.step()
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    for _ in range(2):
        reference(x).square().sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    pools = [storage.sharded.pool for storage in engine.store.storages]
    assert sum(pool.blocks for pool in pools) <= 2  # one unit at a time, plus the root
    with engine.gathered_parameters():
        for ours, theirs in zip(model.parameters(), reference.parameters()):
            torch.testing.assert_close(ours, theirs)
    engine.teardown()


def test_the_host_heap_is_given_back_after_setup_and_the_first_step_only(monkeypatch):
    # one trim after setup and one after the first optimizer step; a trim per step would fault every step's
    # activations back in (see [Note: the engine gives back what its setup left behind] in memory/host_memory.py)
    trims = []
    monkeypatch.setattr(engine_module, "give_back_free_heap", lambda: trims.append(len(spent)) or True)
    spent: list[dict] = []
    model = _model()
    engine = ZeroEngine(model, [torch.optim.AdamW(model.parameters(), lr=1e-3)], stage=3)
    for _ in range(4):
        model(torch.ones(8, 512)).square().mean().backward()
        engine.finish_backward()
        engine.step()
        spent.append(engine.step_costs())
    engine.teardown()
    assert trims == [0, 0], trims  # both before the first step's costs were read: at setup, inside the first step


def test_giving_the_heap_back_is_a_no_op_without_glibc(monkeypatch):
    monkeypatch.setattr(host_memory, "_libc", lambda: None)
    assert host_memory.give_back_free_heap() is False
    monkeypatch.undo()
    assert host_memory.give_back_free_heap() is (host_memory._libc() is not None)
