"""The heap pin (see [Note: the heap pin] in ``lightning_zero/memory/heap_pin.py``): every stage keeps the memory of
a step's activations mapped from one step to the next, so a forward does not fault them in again."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn

from lightning_zero import ZeroEngine
from lightning_zero.memory.heap_pin import HeapPin

# One fresh process per run: glibc's heap and thresholds depend on everything a process allocated before.
_RUN = textwrap.dedent("""
    import json, resource, sys
    import torch
    from lightning_zero.memory.heap_pin import HeapPin

    pin = HeapPin() if sys.argv[1] == "1" else None
    # glibc raises its mmap threshold to the size of a mapped block once it is freed (up to 32 MiB; a training
    # process has freed many): the 2 MiB "activations" below then come from the heap, as a forward's do
    torch.empty(16 << 20, dtype=torch.uint8).fill_(1)
    faults = []
    for _ in range(4):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        activations = [torch.ones(1 << 19) for _ in range(48)]  # a forward: 96 MiB at the heap's top
        above = None
        if pin is not None:
            pin.take()  # the first gradient of backward
            above = pin.block is not None and pin.block.data_ptr() > max(a.data_ptr() for a in activations)
        del activations  # backward frees them; without the pin glibc trims the free top (above 2 x 16 MiB)
        faults.append((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before, above))
    print(json.dumps(faults))
""")

_ACTIVATION_PAGES = 96 * (1 << 20) // 4096


def _faults_per_step(pinned: bool) -> list[tuple[int, bool]]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}  # glibc's own dynamic thresholds
    done = subprocess.run([sys.executable, "-c", _RUN, "1" if pinned else "0"], capture_output=True, text=True,
                          timeout=120, env=env, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the pin answers glibc's heap trimming")
@pytest.mark.timeout(300)
def test_the_pin_lies_above_the_activations_and_keeps_them_mapped_for_the_next_forward():
    pinned = _faults_per_step(True)
    # the pin is above every activation of every step (what keeps glibc from trimming them: below the top of the
    # heap, freed memory is kept for the next allocation) ...
    assert all(above for _, above in pinned), pinned
    # ... so only the first forward faults its activations in. Without the pin glibc trims them whenever nothing
    # else happens to lie above them (in two of four runs here every step faulted ~24,500 pages in; not asserted:
    # which small allocation of torch's lands above them depends on the process)
    assert max(faults for faults, _ in pinned[1:]) < _ACTIVATION_PAGES // 4, (pinned, _faults_per_step(False))


def test_the_highest_pin_is_kept():
    pin = HeapPin(1 << 16)
    pin.take()
    highest = pin.block
    for _ in range(8):
        pin.take()
        assert pin.block is not None and pin.block.data_ptr() >= highest.data_ptr()
        highest = pin.block


def test_the_pin_is_taken_in_backward_kept_by_every_stage_and_released_at_teardown():
    torch.empty(16 << 20, dtype=torch.uint8).fill_(1)  # freed: glibc's mmap threshold rises above the pin's size
    for stage in (1, 2, 3):
        model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64))
        engine = ZeroEngine(model, [torch.optim.SGD(model.parameters(), lr=0.1)], stage=stage)
        reducers = [storage.reducer for storage in engine.store.storages]
        model(torch.ones(4, 64)).sum().backward()
        engine.finish_backward()
        engine.step()
        assert all(r.heap_pin is not None and r.heap_pin.block is not None for r in reducers), stage
        engine.teardown()
        assert all(r.heap_pin is None or r.heap_pin.block is None for r in reducers)
