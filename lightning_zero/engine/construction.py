"""Building a model for stage 3 without holding it whole, as the adapters use it: the Trainer's
``configure_model`` (``sharded_construction``) and Fabric's ``init_module`` -> changes -> ``setup``
(``InitModuleRecording``, also the Trainer's ``init_module(empty_init=True)``); the recording and its replay
are ``stage3/construction.py``'s."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager
from typing import Optional

import torch
from torch import nn

from lightning_zero.pretrained import loading as pretrained
from lightning_zero.stage3.construction import PendingRecording, Recording, record_construction, storage_key
from lightning_zero.stage3.materialize import drop_meta, move_materialized


@contextmanager
def sharded_construction(device: torch.device, recording: Optional[Recording] = None) -> Iterator[Recording]:
    """Build a model for stage 3 without holding it whole: inside, modules are made on the meta device and their
    construction recorded; pass the recording to ``ZeroEngine`` (``recording=``), which replays it one unit at
    a time (see [Note: record and replay] in ``construction.py``). ``load_pretrained`` inside is done at setup.
    ``recording`` continues an earlier recording."""
    with record_construction(device, recording) as recording, pretrained.deferring():
        yield recording


class InitModuleRecording:
    """``init_module()`` under zero3 (Fabric's, and the Trainer's with ``empty_init=True``): the construction
    recorded inside, and what the user does to the model after it until ``setup`` (see [Note: what happens between
    init_module and setup] in ``stage3/construction.py``).

    [Note: empty_init under zero3]
    Under a sharded strategy ``empty_init=True`` means "do not materialize the whole model", never "leave it
    uninitialized": FSDP re-initializes after sharding and DeepSpeed's ``zero.Init`` initializes while sharding, and
    client code (LitGPT) builds under ``init_module(empty_init=True)`` and never initializes again. Here the
    construction is recorded on the meta device whatever ``empty_init`` says, initializers included, so setup gives
    every unit the values of eager construction on the same seed, no rank holding the model whole. With
    ``empty_init=True`` the random generators are then put back to their state before the context, as skipped
    initializers leave them under ``ddp``: code that initializes again after the context (LitGPT's pretraining)
    draws exactly ``ddp``'s numbers, and so does the training after. A parameter that construction never writes
    (``torch.empty`` and nothing after) would come out of setup as uninitialized memory: ``check`` refuses it.
    Stages 1 and 2 build on the device and skip the initializers under ``empty_init=True``, as Lightning's
    ``deepspeed`` strategy does at those stages.
    """

    def __init__(self) -> None:
        self._pending: Optional[PendingRecording] = None
        self.recording: Optional[Recording] = None
        """What setup replays (``None`` when nothing was built under ``init_module``)."""
        self.empty_init = False
        """Whether a context of this recording was asked for ``empty_init=True`` (the model must come out
        initialized: see ``check``)."""

    @contextmanager
    def context(self, device: torch.device, init_context: AbstractContextManager, empty_init: bool) -> Iterator[None]:
        """The ``init_module`` context (see [Note: empty_init under zero3])."""
        earlier = self.stop()
        self.empty_init = self.empty_init or empty_init
        with ExitStack() as stack:
            stack.enter_context(init_context)
            if empty_init:
                devices = [device.index if device.index is not None else 0] if device.type == "cuda" else []
                stack.enter_context(torch.random.fork_rng(devices, device_type=device.type))
            recording = stack.enter_context(sharded_construction(device, earlier))
            yield
        self._pending = PendingRecording(recording).start()

    def stop(self) -> Optional[Recording]:
        """Stop recording what is done to the model (setup replays it); returns the recording."""
        if self._pending is not None:
            self.recording = self._pending.stop()
            self._pending = None
        return self.recording

    def take(self, module: nn.Module) -> Optional[Recording]:
        """The recording of ``module``, handed to the engine once (it is replayed once), after ``check``."""
        recording, self.recording = self.stop(), None
        if recording is not None:
            self.check(module, recording)
        self.empty_init = False
        return recording

    def check(self, module: nn.Module, recording: Recording) -> None:
        """Under ``empty_init=True``, refuse a parameter that construction never wrote (see [Note: empty_init under
        zero3]), naming it."""
        if not self.empty_init:
            return
        names = uninitialized_parameters(module, recording)
        if names:
            raise RuntimeError(
                f"zero3 builds the model of `init_module(empty_init=True)` sharded and initialized, but its "
                f"construction never initializes {', '.join(map(repr, names[:3]))}{' ...' if len(names) > 3 else ''} "
                "(made with `torch.empty` and never written), so setup would give it uninitialized memory. Initialize "
                "it where it is made (e.g. `nn.init.normal_` in `__init__` or `reset_parameters`), or build under "
                "`init_module(empty_init=False)` and load the weights after setup."
            )


#: Factories that allocate without writing a value.
_EMPTY = {
    torch.ops.aten.empty.memory_format,
    torch.ops.aten.empty_strided.default,
    torch.ops.aten.new_empty.default,
    torch.ops.aten.new_empty_strided.default,
    torch.ops.aten.empty_like.default,
}


def uninitialized_parameters(module: nn.Module, recording: Recording) -> list[str]:
    """The names of ``module``'s meta parameters whose storage only an ``empty`` factory of ``recording`` made: no
    recorded operation ever wrote a value there."""
    written: dict[int, bool] = {}
    for op in recording.ops:
        for key in op.writes:
            written[key] = written.get(key, False) or op.func not in _EMPTY
    names = []
    for name, param in module.named_parameters():
        if param.is_meta and param.numel():
            alias = recording.recorded.get(id(param), param)
            if not written.get(storage_key(alias), True):
                names.append(name)
    return names


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
