"""Building a model for stage 3 without holding it whole, as the adapters use it: the Trainer's
``configure_model`` (:func:`sharded_construction`) and Fabric's ``init_module`` -> changes -> ``setup``
(:class:`InitModuleRecording`); the recording and its replay are ``stage3/construction.py``'s."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager
from typing import Optional

import torch
from lightning.fabric.utilities.init import _EmptyInit
from torch import nn

from lightning_zero.checkpoints import pretrained
from lightning_zero.stage3.construction import PendingRecording, Recording, record_construction
from lightning_zero.stage3.materialize import drop_meta, move_materialized


@contextmanager
def sharded_construction(device: torch.device, recording: Optional[Recording] = None) -> Iterator[Recording]:
    """Build a model for stage 3 without holding it whole: inside, modules are made on the meta device and their
    construction recorded; pass the recording to :class:`ZeroEngine` (``recording=``), which replays it one unit at
    a time (see [Note: record and replay] in ``construction.py``). ``load_pretrained`` inside is done at setup.
    ``recording`` continues an earlier recording."""
    with record_construction(device, recording) as recording, pretrained.deferring():
        yield recording


class InitModuleRecording:
    """Fabric's ``init_module()``: the construction recorded inside, and what the user does to the model after it
    until ``setup`` (see [Note: what happens between init_module and setup] in ``stage3/construction.py``)."""

    def __init__(self) -> None:
        self._pending: Optional[PendingRecording] = None
        self.recording: Optional[Recording] = None
        """What setup replays (``None`` when nothing was built under ``init_module``)."""

    @contextmanager
    def context(self, device: torch.device, init_context: AbstractContextManager,
                empty_init: bool) -> Iterator[None]:
        """The ``init_module`` context; ``empty_init`` skips ``torch.nn.init`` as ``ddp``'s does."""
        earlier = self.stop()
        with ExitStack() as stack:
            stack.enter_context(init_context)
            recording = stack.enter_context(sharded_construction(device, earlier))
            stack.enter_context(_EmptyInit(enabled=empty_init))
            yield
        self._pending = PendingRecording(recording).start()

    def stop(self) -> Optional[Recording]:
        """Stop recording what is done to the model (setup replays it); returns the recording."""
        if self._pending is not None:
            self.recording = self._pending.stop()
            self._pending = None
        return self.recording

    def take(self) -> Optional[Recording]:
        """The recording, handed to the engine once (it is replayed once)."""
        recording, self.recording = self.stop(), None
        return recording


def place_module(module: nn.Module, device: torch.device, shards_params: bool) -> None:
    """Move ``module`` to ``device`` as setup expects it: whole for stages 1 and 2; under stage 3 only what was
    built eagerly (the rest is built unit by unit at setup)."""
    if shards_params:
        move_materialized(module, device)
    else:
        module.to(device)


def abandon_construction(module: nn.Module, device: torch.device) -> None:
    """Setup stopped inside stage 3's construction: leave no meta tensor in ``module`` (they become empty)."""
    drop_meta(module, device)
