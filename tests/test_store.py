"""Unit tests of the engine's parameter store (``shards/store.py``) and of stage 3's units (``stage3/units.py``), in
one process.

A world of one rank: the all-gathers are copies, so what is tested is the bookkeeping. The store: evaluation under
stage 3 keeps the weights in the store alone (no optimizer object of any kind exists), and optimizers set up later
(Fabric's ``setup_module`` then ``setup_optimizers``) take them over and step exactly as a plain optimizer does. The
units: ``unshard``, ``wait_for_unshard`` and ``reshard`` move a ``UnitGroup`` through its states and do nothing where
there is nothing to do, waiting for an unshard never started raises, and the runtime's phase follows the pass.
"""

from __future__ import annotations

import gc
import pytest
import torch
from torch import nn

from lightning_zero import ZeroEngine
from lightning_zero.shards.optimizer import StepPhase
from lightning_zero.stage3.unit import IllegalUnitTransition, TrainingPhase, UnitGroup, UnitState
from tests.fake_work import LoggedWork


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(3)], nn.Linear(8, 2))


def _optimizers_alive() -> set[int]:
    gc.collect()
    return {id(o) for o in gc.get_objects() if isinstance(o, torch.optim.Optimizer)}


def test_evaluation_under_stage_3_holds_no_optimizer():
    before = _optimizers_alive()  # what earlier tests in this process may still hold
    model, reference = _model(), _model()
    engine = ZeroEngine(model, [], stage=3, persistence_threshold=0, unit_classes=[nn.Sequential],
                        reduce_bucket_size=40)
    assert engine.optimizers == [] and not _optimizers_alive() - before
    assert len(engine.store.storages) == 1 and engine.store.storages[0].master_storage is not None
    assert engine.runtime is not None and len(engine.runtime.units) > 2  # the weights are sharded by units
    x = torch.randn(5, 8)
    with torch.no_grad():
        out = model(x)
    engine.end_step()
    torch.testing.assert_close(out, reference(x), rtol=0, atol=0)
    assert all(u.state is UnitState.SHARDED for u in engine.runtime.units)
    engine.teardown()
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=0)


def test_optimizers_set_up_after_evaluation_take_the_weights_and_step_as_plain_ones():
    model, reference = _model(), _model()
    engine = ZeroEngine(model, [], stage=3, persistence_threshold=0, unit_classes=[nn.Sequential],
                        reduce_bucket_size=40)
    source = engine.store.storages[0]
    weights = [p for n, p in model.named_parameters() if n.endswith("weight")]
    biases = [p for n, p in model.named_parameters() if n.endswith("bias")]
    optimizer = torch.optim.SGD([{"params": weights}, {"params": biases, "lr": 0.05}], lr=0.1, momentum=0.9)
    engine.add_optimizers([optimizer])
    assert source not in engine.store.storages and len(engine.store.storages) == 1
    sharded = engine.optimizers[0]
    assert sharded.storage is engine.store.storages[0] and sharded.phase is StepPhase.ACCUMULATING
    ref_weights = [p for n, p in reference.named_parameters() if n.endswith("weight")]
    ref_biases = [p for n, p in reference.named_parameters() if n.endswith("bias")]
    ref_optimizer = torch.optim.SGD([{"params": ref_weights}, {"params": ref_biases, "lr": 0.05}], lr=0.1,
                                    momentum=0.9)
    for step in range(3):
        x = torch.randn(6, 8, generator=torch.Generator().manual_seed(step))
        engine.backward(model(x).square().mean())
        engine.reduce(optimizer)
        assert sharded.phase is StepPhase.REDUCED
        engine.step(optimizer)
        assert sharded.phase is StepPhase.ACCUMULATING
        reference(x).square().mean().backward()
        ref_optimizer.step()
        ref_optimizer.zero_grad()
    engine.teardown()
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p, q)


def test_a_zero_grad_of_the_store_makes_a_reduced_optimizer_reduce_again():
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    engine = ZeroEngine(model, [optimizer], stage=2)
    sharded = engine.optimizers[0]
    engine.backward(model(torch.randn(4, 8)).sum())
    engine.reduce()
    first = [g.clone() for g in sharded.grads()]
    sharded.storage.clear_grads(None)  # what a borrowing optimizer's zero_grad does to its owner's storage
    assert sharded.grads() == []
    engine.backward(model(torch.randn(4, 8)).sum())
    engine.reduce()
    assert sharded.grads() and not all(torch.equal(a, b) for a, b in zip(first, sharded.grads()))
    engine.teardown()


class _Storage:
    """What a ``UnitGroup`` uses of a storage: it unshards (one work handle), reshards, and asks for its buffer."""

    def __init__(self) -> None:
        self.log: list[str] = []

    def unshard_unit(self, unit: int) -> list[LoggedWork]:
        self.log.append(f"unshard {unit}")
        return [LoggedWork(self.log)]

    def reshard_unit(self, unit: int) -> None:
        self.log.append(f"reshard {unit}")

    def unit_buffer(self, unit: int) -> None:
        return None  # no buffer of its own: the log stands for the gathers and frees


def test_a_unit_moves_sharded_gathering_gathered_and_back():
    storage = _Storage()
    unit = UnitGroup(1, "blocks.0", [storage])
    assert unit.state is UnitState.SHARDED and not unit.gathered
    assert unit.unshard()
    assert unit.state is UnitState.GATHERING and unit.gathered and len(unit.pending) == 1
    unit.wait_for_unshard()
    assert unit.state is UnitState.GATHERED and unit.pending == []
    unit.reshard()
    assert unit.state is UnitState.SHARDED
    assert unit.unshard()
    unit.reshard()  # a gather in flight is waited for before its buffers go
    assert unit.state is UnitState.SHARDED
    assert storage.log == ["unshard 1", "wait", "reshard 1", "unshard 1", "wait", "reshard 1"]


@pytest.mark.parametrize("state, move", [
    (UnitState.SHARDED, "reshard"), (UnitState.GATHERING, "unshard"),
    (UnitState.GATHERED, "unshard"), (UnitState.GATHERED, "wait_for_unshard"),
])
def test_a_verb_with_nothing_to_do_does_nothing(state, move):
    storage = _Storage()
    unit = UnitGroup(2, "blocks.1", [storage])
    if state is not UnitState.SHARDED:
        unit.unshard()
    if state is UnitState.GATHERED:
        unit.wait_for_unshard()
    log = list(storage.log)
    getattr(unit, move)()
    assert unit.state is state and storage.log == log


def test_waiting_for_an_unshard_never_started_raises_and_changes_nothing():
    storage = _Storage()
    unit = UnitGroup(2, "blocks.1", [storage])
    with pytest.raises(IllegalUnitTransition, match="'blocks.1'.*while sharded"):
        unit.wait_for_unshard()
    assert unit.state is UnitState.SHARDED and storage.log == []


def test_the_runtime_phase_follows_forward_backward_and_summoned():
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    engine = ZeroEngine(model, [optimizer], stage=3, persistence_threshold=0, unit_classes=[nn.Sequential])
    runtime = engine.runtime
    assert runtime is not None and runtime.phase is TrainingPhase.IDLE
    seen: list[TrainingPhase] = []
    handle = model[-1].register_forward_hook(lambda *_: seen.append(runtime.phase))
    loss = model(torch.randn(3, 8)).sum()
    assert seen == [TrainingPhase.FORWARD] and not runtime.order_final
    loss.register_hook(lambda g: seen.append(runtime.phase))
    engine.backward(loss)
    assert runtime.phase is TrainingPhase.IDLE and runtime.order_final
    with engine.gathered_parameters():
        assert runtime.phase is TrainingPhase.SUMMONED
        with torch.no_grad():
            model(torch.randn(3, 8))
        assert all(u.state is UnitState.GATHERED for u in runtime.units)  # a forward inside frees nothing
    assert runtime.phase is TrainingPhase.IDLE
    assert all(u.state is UnitState.SHARDED for u in runtime.units[1:])
    handle.remove()
    engine.step()
    engine.teardown()


@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed"])
def test_optimizers_set_up_after_evaluation_get_the_full_precision_masters(precision):
    """The move from the evaluation storage carries the fp32 masters, not the 16-bit working copy (see [Note: the
    move carries the master values] in ``partitioned.py``): the masters equal those of optimizers given at setup."""
    def masters(late: bool) -> list[torch.Tensor]:
        model = _model()
        model.unused = nn.Parameter(torch.randn(3))  # trainable, in no optimizer: kept whole, in its own dtype
        kwargs = dict(stage=3, precision=precision, persistence_threshold=0, unit_classes=[nn.Sequential])
        params = [p for name, p in model.named_parameters() if name != "unused"]
        optimizer = torch.optim.SGD(params, lr=0.1)
        engine = ZeroEngine(model, [] if late else [optimizer], **kwargs)
        if late:
            engine.add_optimizers([optimizer])
        out = [engine.optimizers[0].storage.master_storage.clone(), model.unused.detach().clone()]
        engine.teardown()
        return out + [p.detach().clone() for p in model.parameters()]

    at_setup, later = masters(late=False), masters(late=True)
    assert later[0].dtype == torch.float32 and later[1].dtype == torch.float32
    for a, b in zip(at_setup, later):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
