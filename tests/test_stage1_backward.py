"""Stage 1 reduces its gradients during the backward the step follows, and holds them in ``.grad`` inside
``no_backward_sync`` (see [Note: stage 1 reduces in the backward the step follows] in ``shards/store.py``). One
process: the reduce-scatters the reducer issues are counted where it calls them; the values against DDP over
several ranks are checked by ``test_parity.py`` and the Fabric parity test (accumulation included)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_zero import ZeroEngine
from lightning_zero.comm import collectives

_REDUCED = [0]


@pytest.fixture(autouse=True)
def _count_reduce_scatters(monkeypatch):
    original = collectives.reduce_scatter
    _REDUCED[0] = 0

    def counting(output, input, group=None, async_op=False):
        _REDUCED[0] += input.numel()
        return original(output, input, group=group, async_op=async_op)

    monkeypatch.setattr(collectives, "reduce_scatter", counting)


def _setup() -> tuple[nn.Module, ZeroEngine]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.Linear(128, 64))
    return model, ZeroEngine(model, [torch.optim.SGD(model.parameters(), lr=0.1)], stage=1,
                             reduce_bucket_size=4096)


def _reduced(engine: ZeroEngine) -> int:
    """Elements the reducer reduce-scattered since the test began."""
    return _REDUCED[0]


def _loss(model: nn.Module, seed: int) -> torch.Tensor:
    return model(torch.randn(4, 64, generator=torch.Generator().manual_seed(seed))).square().mean()


def test_stage1_reduce_scatters_during_backward_when_the_step_follows():
    model, engine = _setup()
    psi = sum(p.numel() for p in model.parameters())
    seen_during_backward = []  # elements reduced when each gradient had been bucketed (our hooks run after its)
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(lambda _: seen_during_backward.append(_reduced(engine)))
    engine.backward(_loss(model, 1))
    assert any(0 < seen < psi for seen in seen_during_backward), seen_during_backward  # launched as backward went
    assert _reduced(engine) >= psi
    assert all(p.grad is None for p in model.parameters())  # each gradient freed once in its bucket
    before = _reduced(engine)
    engine.step()
    assert _reduced(engine) == before  # the step reduces nothing again
    engine.teardown()


def test_stage1_holds_gradients_in_no_backward_sync_and_reduces_them_once():
    model, engine = _setup()
    reference = nn.Sequential(nn.Linear(64, 128), nn.Linear(128, 64))
    reference.load_state_dict(model.state_dict())
    engine.backward(_loss(model, 0))  # makes the kept gradient shard
    engine.step()
    engine.zero_grad()
    with torch.no_grad():
        reference.load_state_dict(model.state_dict())
    before = _reduced(engine)
    with engine.no_backward_sync():
        engine.backward(_loss(model, 1))
        assert all(p.grad is not None for p in model.parameters())  # held, as DDP's no_sync holds them
        assert _reduced(engine) == before
        assert all(s.reducer.grad_shard is None for s in engine.store.storages)  # never with full gradients
    engine.backward(_loss(model, 2))
    assert _reduced(engine) - before < 2 * sum(p.numel() for p in model.parameters())  # one reduction per step
    engine.step()
    (_loss(reference, 1) + _loss(reference, 2)).backward()
    torch.optim.SGD(reference.parameters(), lr=0.1).step()
    for ours, theirs in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(ours, theirs)
    engine.teardown()
