"""Stage 3 keeps the last unit of a training forward gathered for the backward that follows, in one process.

See [Note: the last unit stays gathered into backward] in ``lightning_zero/stage3/units.py``: what is checked here is
what happens around it when no backward follows (a forward for a metric, an evaluation under ``no_grad``), and that
the steps still equal plain PyTorch's.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from lightning_zero import ZeroEngine


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(3))
        self.head = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


@pytest.fixture(params=[5_000_000, 0], ids=["prefetch", "no-prefetch"])
def pair(request: pytest.FixtureRequest) -> tuple[nn.Module, torch.optim.Optimizer, nn.Module, ZeroEngine]:
    torch.manual_seed(0)
    ref = Net()
    model = copy.deepcopy(ref)
    engine = ZeroEngine(model, [torch.optim.AdamW(model.parameters(), lr=0.1)], stage=3, unit_classes=[Block],
                        persistence_threshold=0, prefetch_size=request.param)
    return ref, torch.optim.AdamW(ref.parameters(), lr=0.1), model, engine


def _gathered(engine: ZeroEngine) -> list[int]:
    runtime = engine.runtime
    assert runtime is not None
    return [u for u in range(len(runtime.units)) if u != 0 and runtime.units[u].gathered]  # 0: the root


def _train_step(pair: tuple, x: torch.Tensor, y: torch.Tensor) -> None:
    ref, ref_opt, model, engine = pair
    with engine.forward_context():
        loss = ((model(x) - y) ** 2).mean()
    engine.backward(loss)
    engine.step()
    ((ref(x) - y) ** 2).mean().backward()
    ref_opt.step()
    ref_opt.zero_grad()


def _max_difference(ref: nn.Module, model: nn.Module) -> float:
    state = model.state_dict()
    return max((state[name] - p.detach()).abs().max().item() for name, p in ref.named_parameters())


def test_a_forward_without_backward_keeps_the_last_unit_only_until_the_next_forward(pair) -> None:
    ref, _, model, engine = pair
    for step in range(4):
        x, y = torch.randn(4, 8), torch.randn(4, 1)
        _train_step(pair, x, y)
        assert _gathered(engine) == [], f"step {step}: a unit outlived its step"
        with engine.forward_context():
            model(x)  # grad enabled, no backward: a metric computed in the training loop
        last = engine.runtime.forward_order[-1]
        assert _gathered(engine) == [last], "the order is known after the first backward: its last unit is kept"
        assert _max_difference(ref, model) == 0.0  # state_dict() with the unit kept reads the same values


def test_an_evaluation_forward_keeps_nothing_and_frees_a_kept_unit(pair) -> None:
    ref, _, model, engine = pair
    prefetching = engine.config.prefetch_size > 0  # a prefetch may gather the kept unit again, as it would any unit
    x, y = torch.randn(4, 8), torch.randn(4, 1)
    for _ in range(2):
        _train_step(pair, x, y)
    with engine.forward_context():
        model(x)
    kept = engine.runtime.forward_order[-1]
    assert _gathered(engine) == [kept]
    seen: list[list[int]] = []
    hook = model.blocks[1].register_forward_pre_hook(lambda module, args: seen.append(_gathered(engine)))
    with torch.no_grad():
        model(x)  # another forward runs the first unit first: the kept one is freed there, not at its own turn
    hook.remove()
    assert seen and (prefetching or kept not in seen[0]), f"unit {kept} still gathered in the next forward: {seen}"
    assert _gathered(engine) == []
    _train_step(pair, x, y)
    assert _gathered(engine) == [] and _max_difference(ref, model) == 0.0


@pytest.mark.parametrize("threshold", [0, 10**6], ids=["units", "one-root-unit"])
def test_backward_gathers_again_whatever_was_freed_after_the_forward(threshold) -> None:
    # another model's backward ends every model's backward under Fabric (see [Note: backward finds every unit
    # gathered, the root too] in stage3/units.py): here the engine's own end of step frees the root and every unit
    # between the forward and its backward, which must read the same weights as plain PyTorch
    torch.manual_seed(0)
    ref = Net()
    model = copy.deepcopy(ref)
    engine = ZeroEngine(model, [torch.optim.SGD(model.parameters(), lr=0.1)], stage=3, unit_classes=[Block],
                        persistence_threshold=threshold)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for _ in range(2):
        x = torch.randn(4, 8)
        loss = model(x).square().mean()
        engine.end_step()  # the root (and the last unit, kept for backward) freed while the graph holds views of them
        engine.backward(loss)
        engine.step()
        ref(x).square().mean().backward()
        ref_opt.step()
        ref_opt.zero_grad()
    assert _max_difference(ref, model) < 1e-6
