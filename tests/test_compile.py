"""torch.compile under each stage: a TinyGPT whose blocks the user compiles in ``configure_model``
(``self.blocks[i] = torch.compile(block)``) trains under zero1, zero2 and zero3 with ddp's losses (same compile), and
dynamo compiles a bounded number of graphs (no recompilation per step).

One launch of 2 ranks runs every case (tests/workers/compile.py). The backend is ``aot_eager``: it traces forward and
backward through dynamo and AOTAutograd as inductor does (same guards, same graph breaks, same compiled backward run
by the autograd engine), without inductor's C++ code generation, which takes minutes on 2 busy cores. Inductor's step
times are in benchmarks/RESULTS.md (``python -m benchmarks.torch_compile``).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_zero.activations.blocks import find_blocks
from lightning_zero.stage3.plan import plan_units, units_under_compile
from lightning_zero.testing.launch import launch
from tests.models import Block

RTOL = 1e-5
STEPS = 4  # enough to see a recompilation per step (the sanity check's graph comes first)
REFERENCE = "ddp:block"
CASES = {
    "zero1:block": "per-block compile, stage 1",
    "zero2:block": "per-block compile, stage 2",
    "zero3:block": "per-block compile, stage 3: the unit is the compiled wrapper",
    "zero3:block:ac": "stage 3 with activation_checkpointing=True around compiled blocks",
    "zero3:whole": "a compiled forward around stage 3 units (warned: split at every unit)",
}
ERROR_CASE = "zero3:block:ca"  # last: it fails in the first backward


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("compile")
    cases = ",".join([REFERENCE, *CASES, ERROR_CASE])
    return launch("compile.py", 2, out, (cases, "aot_eager", str(STEPS)), timeout=300)


@pytest.mark.timeout(320)
@pytest.mark.parametrize("case", list(CASES))
def test_compiled_losses_match_ddp_and_compile_once(results, case):
    for rank_result in results:
        ddp, zero = rank_result[REFERENCE], rank_result[case]
        assert "error" not in ddp and "error" not in zero, (ddp.get("error"), zero.get("error"))
        assert len(zero["losses"]) == len(ddp["losses"]) == STEPS
        for step, (a, e) in enumerate(zip(zero["losses"], ddp["losses"])):
            assert abs(a - e) <= RTOL * abs(e), f"{case} step {step}: loss {a} vs ddp {e}"
        counts = zero["counts"]
        # the training graph and the sanity check's no-grad graph, compiled once for all steps (3 blocks share them);
        # stage 3 inside a compiled forward adds the pieces between units, still compiled once
        limit = 6 if case.endswith("whole") else ddp["counts"]["graphs"]
        assert 0 < counts["graphs"] <= limit and counts["recompiles"] == 0, counts
        if not case.endswith("whole"):
            assert counts["graph_breaks"] == 0, zero["break_reasons"]


@pytest.mark.timeout(320)
def test_compiled_forward_around_units_is_warned(results):
    assert any("run inside a region compiled by torch.compile" in w for w in results[0]["zero3:whole"]["warnings"])
    assert not results[0]["zero3:block"]["warnings"]


@pytest.mark.timeout(320)
def test_compiled_autograd_is_refused_with_a_clear_error(results):
    for rank_result in results:
        error = rank_result[ERROR_CASE].get("error", "")
        assert "compiled autograd" in error and "not supported" in error, error


def test_compiled_block_is_found_as_its_wrapper():
    model = nn.Sequential(nn.Linear(8, 8), Block(8), Block(8))
    model[1] = torch.compile(model[1], backend="aot_eager")  # nothing compiles until it is called
    assert [name for name, _ in find_blocks(model)] == ["0", "1", "2"]
    assert [m for _, m in find_blocks(model, [Block])] == [model[1], model[2]]  # the wrapper, not its _orig_mod
    assert units_under_compile(model, plan_units(model, [Block])) == []


def test_units_inside_a_compiled_region_are_named():
    model = nn.Sequential(nn.Linear(8, 8), Block(8), Block(8))
    model[2].compile(backend="aot_eager")  # hooks of the module itself inside its compiled call
    assert units_under_compile(model, plan_units(model, [Block])) == ["2"]
    model.forward = torch.compile(model.forward, backend="aot_eager")
    assert units_under_compile(model, plan_units(model, [Block])) == ["0", "1", "2"]  # the Linear is a unit too
    holder = nn.Module()  # torch.compile(self.model) in a LightningModule
    holder.model = torch.compile(nn.Sequential(Block(8), Block(8)), backend="aot_eager")
    assert units_under_compile(holder, plan_units(holder)) == ["model._orig_mod.0", "model._orig_mod.1"]
