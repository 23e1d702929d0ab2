"""Stage 3 under ``torch.profiler``: a trace of a step names each unit and what was done to it (``unshard``,
``wait_for_unshard``, ``reshard``, the hooks and the reduce-scatter of its gradients: see [Note: one vocabulary for
stage 3] in ``stage3/unit.py``), in one process (a world of one rank: the all-gathers are copies)."""

from __future__ import annotations

import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile

from lightning_zero import ZeroEngine
from lightning_zero.stage3.unit import UnitState


def _engine() -> tuple[ZeroEngine, nn.Module, torch.optim.Optimizer]:
    """Stage 3 over four units (three blocks and the head), the root empty."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(3)], nn.Linear(8, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    engine = ZeroEngine(model, [optimizer], stage=3, persistence_threshold=0, unit_classes=[nn.Sequential])
    assert engine.runtime is not None
    return engine, model, optimizer


def test_a_traced_step_names_every_unit_and_phase():
    engine, model, optimizer = _engine()
    runtime = engine.runtime
    assert runtime is not None
    units = [u.name for u in runtime.units[1:]]
    assert units == ["0", "1", "2", "3"]
    with profile(activities=[ProfilerActivity.CPU]) as trace:
        engine.backward(model(torch.randn(4, 8)).sum())
        engine.reduce(optimizer)
        engine.step(optimizer)
    names = {event.name for event in trace.events()}
    for unit in units:  # each gathered around its forward and again for backward (the first step: no unit is kept)
        for what in ("pre_forward", "unshard", "wait_for_unshard", "post_forward", "reshard"):
            assert f"lightning_zero::{what} {unit}" in names, (what, unit, sorted(n for n in names if "zero" in n))
        assert f"lightning_zero::pre_backward {unit}" in names
        assert f"lightning_zero::post_backward {unit}" in names
    reductions = [n for n in names if n.startswith("lightning_zero::reduce_scatter bucket ")]
    assert reductions and all(" of stage 3 unit '" in n for n in reductions), sorted(names)  # the reducer's too
    assert any(n.startswith("lightning_zero::wait_for_reduce_scatter bucket ") for n in names)
    engine.teardown()


def test_groups_and_the_runtime_say_what_they_hold():
    engine, _, _ = _engine()
    runtime = engine.runtime
    assert runtime is not None
    group = runtime.units[1]
    assert repr(group) == f"UnitGroup('0', unit 1, sharded, {group.numel} elements, 0 bytes held, 1 storages)"
    with runtime.all_gathered():
        assert group.state is UnitState.GATHERED
        assert f"unit 1, gathered, {group.numel} elements, {group.gathered_bytes} bytes held" in repr(group)
        assert "summoned" in repr(runtime) and "'0 (gathered)'" in repr(runtime)
    assert repr(runtime).startswith("UnitRuntime(5 units, idle, order recording (0 so far)")
    engine.teardown()
