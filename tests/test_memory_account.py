"""The account of a rank's resident memory (see [Note: the account of a rank's memory] in
``lightning_zero/memory/account.py``): the parts read from the process's counters, and the readings kept."""

from __future__ import annotations

import platform

import pytest
import torch
from torch import nn

from lightning_zero import ZeroEngine, measure_model_states
from lightning_zero.memory import account
from lightning_zero.memory.account import EngineMemory, MemoryLedger, ProcessMemory

glibc = pytest.mark.skipif(
    platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="the heap's counters are glibc's"
)


def _model() -> nn.Module:
    return nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 256))


@glibc
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_the_engine_reads_its_parts_at_its_highest_point_and_they_add_up_to_the_resident_memory(stage):
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters())
    engine = ZeroEngine(model, [optimizer], stage=stage)
    for _ in range(2):
        model(torch.ones(64, 256)).sum().backward()
        engine.finish_backward()
        engine.step()
    reading = engine.memory.account()
    assert reading is not None
    assert reading.at in {"the end of setup", "the first gradient of a backward", "the end of a backward",
                          "the end of an optimizer step"}
    assert sum(reading.parts().values()) == reading.resident
    # the model states are the live tensors' (after the step: the same as measured now)
    now = engine.memory_parts()
    measured = measure_model_states(model, [optimizer])
    assert now.model_states == measured.model_states > 0
    adam = 2 * 4 * sum(p.numel() for p in model.parameters())  # two fp32 states of every element (one world)
    assert adam <= now.optimizer_states < adam + 4096  # and the step counters
    engine.teardown()


@glibc
def test_the_ledger_keeps_the_highest_reading_with_the_parts_of_that_moment():
    calls = []

    def parts() -> EngineMemory:
        calls.append(1)
        return EngineMemory(params=len(calls))

    ledger = MemoryLedger(parts)
    ledger.note("before")
    block = torch.ones(48 << 18)  # 48 MiB, written: resident
    ledger.note("with the block")
    del block
    ledger.note("after")
    reading = ledger.account()
    assert reading is not None and reading.at == "with the block"
    assert reading.engine.params == len(calls) == 2  # asked at a new highest reading only
    # the block is live heap (glibc's mmap or its heap) that is none of the engine's parts
    assert reading.other_live >= 47 << 20


def test_a_disabled_ledger_reads_nothing():
    ledger = MemoryLedger(lambda: EngineMemory(), enabled=False)
    ledger.note("anywhere")
    assert ledger.account() is None


def test_the_parts_are_the_counters_differences():
    reference = ProcessMemory(resident=100, peak=100, heap_live=40, anonymous=70, files=30)
    now = ProcessMemory(resident=400, peak=450, heap_live=290, anonymous=350, files=50)
    engine = EngineMemory(params=100, grads=20, master=0, optimizer_states=40, pool=30, buckets=10, pin=8)
    reading = account.MemoryAccount("here", now, engine, reference)
    # live above the reference 250, of which 8 never written (the pin): 242 resident; the engine holds 200 of it
    assert reading.other_live == 42
    assert reading.slack == 280 - 242  # anonymous above the reference that no live allocation holds
    assert reading.files == 20
    assert sum(reading.parts().values()) == reading.resident == 300
    assert reading.peak == 350
