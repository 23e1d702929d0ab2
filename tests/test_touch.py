"""Client code that touches the model around the step (issue: stage 3 that is safe to touch), against ddp.

One 2-rank launch per strategy runs tests/workers/touch.py: LitGPT's ``pretrain.py`` sequence (``init_module`` ->
``initialize_weights`` -> ``setup``), its ``load_checkpoint`` sequence (``setup`` -> ``load_state_dict``), a weight
read between steps and ``grad_norms()``. In-process: ``unit_classes`` typos and containers, the released
parameter's error.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from lightning_zero.stage3 import guard
from lightning_zero.activations.blocks import find_blocks
from lightning_zero.testing.launch import launch

STRATEGIES = ["zero1", "zero2", "zero3"]


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> Any:
    out = tmp_path_factory.mktemp("touch")
    done: dict[str, list[dict]] = {}

    def get(strategy: str) -> list[dict]:
        if strategy not in done:
            (out / strategy).mkdir()
            done[strategy] = launch("touch.py", 2, out / strategy, (strategy,), timeout=300)
        return done[strategy]

    return get


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_init_after_init_module_then_train_equals_ddp(results, strategy):
    for ddp, zero in zip(results("ddp"), results(strategy)):
        assert sorted(zero["pretrain"]["start"]) == sorted(ddp["pretrain"]["start"])
        for key, value in ddp["pretrain"]["start"].items():  # the user's init after init_module, bit for bit
            assert torch.equal(zero["pretrain"]["start"][key], value), key
        assert zero["pretrain"]["losses"] == pytest.approx(ddp["pretrain"]["losses"], rel=1e-6)
        for key, value in ddp["pretrain"]["end"].items():
            torch.testing.assert_close(zero["pretrain"]["end"][key], value, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_load_state_dict_after_setup_equals_ddp(results, strategy):
    for ddp, zero in zip(results("ddp"), results(strategy)):
        assert zero["load"]["result"] == ddp["load"]["result"] == ([], [])
        for key, value in ddp["load"]["loaded"].items():
            assert torch.equal(zero["load"]["loaded"][key], value), key
        assert zero["load"]["losses"] == pytest.approx(ddp["load"]["losses"], rel=1e-6)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_reading_weights_between_steps_and_grad_norms(results, strategy):
    for ddp, zero in zip(results("ddp"), results(strategy)):
        if strategy == "zero3":  # a clear error, never a crash
            assert zero["read"]["outside"].startswith("error: `head.weight` (shape (32, 16)) is a zero3 parameter")
            assert "gathered_parameters()" in zero["read"]["outside"]
        else:
            assert zero["read"]["outside"] == ddp["read"]["outside"]
        assert zero["read"]["inside"] == ddp["read"]["inside"]
        assert zero["read"]["norms"].keys() == ddp["read"]["norms"].keys()
        for key, value in ddp["read"]["norms"].items():
            assert zero["read"]["norms"][key] == pytest.approx(value, rel=1e-6), key


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(2, 2)


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([_Block(), _Block()])


def test_unit_classes_typo_gets_did_you_mean():
    with pytest.raises(ValueError, match=r"`unit_classes` names '_Blok'.*Did you mean '_Block'"):
        find_blocks(_Net(), ["_Blok"])
    with pytest.raises(ValueError, match="no submodule of _Net is of that class"):
        find_blocks(_Net(), ["GPT2Blocks"])
    assert [name for name, _ in find_blocks(_Net(), ["_Block"])] == ["blocks.0", "blocks.1"]


def test_a_container_unit_is_refused_with_what_to_name():
    with pytest.raises(ValueError, match=r"container's forward is never called.*unit_classes=\['_Block'\]"):
        find_blocks(_Net(), [nn.ModuleList])


def test_a_released_parameter_raises_and_keeps_its_metadata():
    param = nn.Parameter(torch.ones(3, 2))
    param.__dict__["_lightning_zero_guard"] = ("fc.weight", "blocks.0")
    guard.release([param])
    assert guard.is_released(param) and isinstance(param, nn.Parameter)
    assert param.shape == (3, 2) and param.dtype == torch.float32 and param.requires_grad and param.grad is None
    assert "unit 'blocks.0' not gathered" in repr(param)
    for read in (lambda: param.sum(), lambda: param * 2, lambda: param.clone(), lambda: param.tolist()):
        with pytest.raises(guard.ParameterNotGatheredError, match=r"`fc.weight` \(shape \(3, 2\)\).*gathered_param"):
            read()
    placeholder = param.detach()  # what torch's state_dict() walk makes: still refuses reads
    assert guard.is_released(placeholder) and not isinstance(placeholder, nn.Parameter)
    with pytest.raises(guard.ParameterNotGatheredError, match="`fc.weight`"):
        placeholder.sum()
    guard.restore([param])
    assert type(param) is nn.Parameter and param.sum().item() == 6.0
