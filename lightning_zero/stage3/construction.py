"""Stage 3 sharded construction that equals eager construction: record ``configure_model`` on the meta device, then
replay it one unit at a time.

[Note: record and replay]
Under zero3, ``configure_model`` runs on the meta device (shapes only, no memory) inside a ``Recording``, a
``TorchDispatchMode`` that logs every aten operation touching a meta tensor: factories (``torch.ones``,
``torch.arange``), initializers (``normal_``, ``uniform_``, ``fill_``, ``copy_``), arithmetic (rotary ``inv_freq``),
whatever the module's ``__init__``, a parent's re-initialization or Hugging Face's ``post_init`` / ``_init_weights``
/ ``tie_weights`` do. Nothing is assumed about ``reset_parameters``.

Setup later asks for the values of one unit's tensors. Every tensor is a view of a storage; the log is walked
backwards from the unit's storages to the operations that wrote them, and those that wrote their inputs, and only
those run again, for real, on the device. The result is what eager construction computed for those tensors, bit for
bit, because the same kernels run on the same inputs in the same order.

[Note: random numbers]
Eager construction draws from the device's generator in program order; a value depends on the generator's state when
its operation ran. While recording, every seeded random operation (aten's ``nondeterministic_seeded`` tag) saves the
generator's state and then runs once for real, into a scratch tensor of the same size and on the real values of its
inputs (``bernoulli``'s probabilities), so the generator advances exactly as in eager construction (peak: the largest
single tensor, freed at once). A generator of the module's own (``torch.randn(..., generator=g)``) is saved and
advanced the same way; the meta kernel that gives the shape runs without it. Replay puts the saved state back before
each random operation it runs, then returns the generator to the state eager construction would have left, so the
training that follows (dropout) draws the same numbers as under ``ddp``.

[Note: values read while constructing]
Construction code may read a value: ``nn.init.trunc_normal_`` loops until no sample falls outside the bounds
(``mask.any()``), code may branch on ``tensor.item()``. A meta tensor has no value, so the recording computes it right
there: it replays what that tensor needs (as for a unit) and returns the real number, and the code goes on exactly as
it does eagerly. What construction reads must therefore be small; a tensor made from Python data (``torch.tensor``)
is made for real on the device (a small constant the log holds), never on the meta device.

[Note: what replay needs]
Replaying a unit computes that unit's storages and the storages its operations read (usually none: initializers read
only shapes). The host or device memory is one unit plus such inputs; the log itself holds meta tensors (no memory),
the generator states (5 KiB each on CPU) and any real tensors the construction read (constants).
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator, Optional

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

META = torch.device("meta")


@dataclass
class _Op:
    """One recorded aten operation."""

    func: Any
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    writes: set[int]
    """Keys of the storages it creates or mutates."""
    reads: set[int]
    """Keys of the meta storages among its inputs."""
    outputs: list[Optional[torch.Tensor]]
    """Its flattened outputs: the meta ones that own a new storage, ``None`` for the others."""
    rng_state: Optional[torch.Tensor] = None
    generator: Optional[torch.Generator] = None


_IS_META = torch._C.TensorBase.__dict__["is_meta"]
_DEVICE = torch._C.TensorBase.__dict__["device"]
_MOVES = {torch.Tensor.to, torch.Tensor.cuda, torch.Tensor.cpu, torch.Tensor.type}
#: Tensors made from Python data: kept real on the eager device (their values are not recorded on the meta device).
_FROM_DATA = {torch.tensor, torch.as_tensor, torch.asarray, torch.Tensor.new_tensor}


class LooksEager(TorchFunctionMode):
    """While recording, meta tensors look like tensors on ``device``: ``is_meta`` is ``False`` and ``.device`` is
    ``device``; tensors asked for on ``device`` are made on the meta device instead, and moving a meta tensor there
    keeps it there. Code that branches on these (``nn.init.trunc_normal_`` skips meta tensors in recent torch;
    Hugging Face's ``init_weights`` skips initialization under a meta device context) then runs as it does eagerly,
    and its random draws are recorded (see [Note: record and replay])."""

    def __init__(self, device: torch.device, redirect: bool = True) -> None:
        super().__init__()
        self.device = device
        self.redirect = redirect
        """Whether new tensors asked for on ``device`` are made on the meta device (inside the construction context
        only: after it, see ``PendingRecording``, the user's own new tensors are real)."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        owner = getattr(func, "__self__", None)
        if owner is _IS_META:
            return False
        if owner is _DEVICE:
            device = func(*args, **kwargs)
            return self.device if device.type == "meta" else device
        if func in _MOVES and args and _is_meta(args[0]):
            return args[0] if func is not torch.Tensor.to else _move_meta(args[0], *args[1:], **kwargs)
        if not self.redirect:
            return func(*args, **kwargs)
        if func in _FROM_DATA:
            return func(*args, **{**kwargs, "device": self.device})
        if isinstance(kwargs.get("device"), (torch.device, str, int)) and _same(kwargs["device"], self.device):
            kwargs = {**kwargs, "device": META}
        return func(*args, **kwargs)


def _same(device: Any, target: torch.device) -> bool:
    device = torch.device(device) if not isinstance(device, int) else torch.device(target.type, device)
    return device.type == target.type and (device.index is None or target.index is None or device.index == target.index)


def _move_meta(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    """``tensor.to(...)`` for a meta tensor: dtype changes apply, device changes do not."""
    dtype = kwargs.get("dtype") or next((a for a in args if isinstance(a, torch.dtype)), None)
    other = next((a for a in args if isinstance(a, torch.Tensor)), None)
    dtype = other.dtype if dtype is None and other is not None else dtype
    return tensor if dtype is None or dtype == tensor.dtype else tensor.to(dtype=dtype)


def storage_key(tensor: torch.Tensor) -> int:
    """Identity of the storage behind ``tensor`` (views share it)."""
    return tensor.untyped_storage()._cdata


def _is_meta(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and x.is_meta


@dataclass
class Recording(TorchDispatchMode):
    """Records construction on the meta device for ``values`` (see [Note: record and replay])."""

    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    ops: list[_Op] = field(default_factory=list)
    end_states: dict[int, tuple[torch.Generator, torch.Tensor]] = field(default_factory=dict)
    default_dtype: torch.dtype = torch.float32
    """The default dtype while recording: factories recorded without a dtype replay with it."""
    recorded: dict[int, torch.Tensor] = field(default_factory=dict)
    """``id`` of each parameter and buffer of the built module to a meta alias of what construction left in it."""

    def __post_init__(self) -> None:
        super().__init__()
        self.default_dtype = torch.get_default_dtype()

    def seal(self) -> None:
        """Hold aliases instead of the module's own tensor objects: swapping a parameter's contents at
        materialization needs nobody else to reference it."""

        def alias(x: Any) -> Any:
            return x.detach() if _is_meta(x) else x

        for op in self.ops:
            op.args, op.kwargs = tree_map(alias, (op.args, op.kwargs))
            op.outputs = [alias(t) if t is not None else None for t in op.outputs]

    def keep(self, module: torch.nn.Module) -> None:
        """Remember the recorded tensors of ``module``'s parameters and buffers, before anything (a precision
        plugin's ``module.to(dtype)``) gives them new storage."""
        named = [*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False)]
        for _, tensor in named:
            if tensor.is_meta and id(tensor) not in self.recorded:
                self.recorded[id(tensor)] = tensor.detach()

    def values_of(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """The values eager construction gave these parameters or buffers of the recorded module (a tensor that
        construction made for real, from Python data, is its own value)."""
        unknown = [t for t in tensors if t.is_meta and id(t) not in self.recorded]
        if unknown:
            raise RuntimeError(
                f"zero3 construction: a tensor of shape {tuple(unknown[0].shape)} on the meta device was not made "
                "while `configure_model` ran, so there is no recording to give it its values. Create every "
                "parameter and buffer inside `configure_model` (or in `__init__`, without the meta device)."
            )
        replayed = iter(self.values([self.recorded[id(t)] for t in tensors if t.is_meta]))
        return [next(replayed) if t.is_meta else t.detach() for t in tensors]

    # ------------------------------------------------------------------ recording
    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        flat_in, _ = tree_flatten((args, kwargs))
        if func is torch.ops.aten._local_scalar_dense.default and _is_meta(args[0]):
            return self.values([args[0]])[0].item()  # see [Note: values read while constructing]
        seeded = torch.Tag.nondeterministic_seeded in func.tags
        rng_state, generator = None, None
        if seeded and (any(_is_meta(x) for x in flat_in) or _names_meta(flat_in)):
            generator, rng_state = self._advance_generator(func, args, kwargs)
        # a generator of the user's (a CPU one) is the eager device's: the meta kernel, which draws nothing, refuses it
        drawn = rng_state is not None and kwargs.get("generator") is not None
        out = func(*args, **({**kwargs, "generator": None} if drawn else kwargs))
        flat_out, _ = tree_flatten(out)
        if any(_is_meta(x) for x in flat_in) or any(_is_meta(x) for x in flat_out):
            self.ops.append(self._op(func, args, kwargs, flat_in, flat_out, rng_state, generator))
        return out

    def _op(
        self,
        func: Any,
        args: tuple,
        kwargs: dict,
        flat_in: list,
        flat_out: list,
        rng_state: Optional[torch.Tensor],
        generator: Optional[torch.Generator],
    ) -> _Op:
        mutated = _mutated_inputs(func, args, kwargs)
        aliased = {storage_key(t) for t in flat_in if _is_meta(t)}
        fresh = [t if _is_meta(t) and storage_key(t) not in aliased else None for t in flat_out]
        writes = {storage_key(t) for t in mutated if _is_meta(t)} | {storage_key(t) for t in fresh if t is not None}
        reads = {storage_key(t) for t in flat_in if _is_meta(t)}
        return _Op(func, args, kwargs, writes, reads, fresh, rng_state, generator)

    def _advance_generator(self, func: Any, args: tuple, kwargs: dict) -> tuple[torch.Generator, torch.Tensor]:
        """Save the generator's state, then advance it as eager construction would (see [Note: random numbers])."""
        generator = kwargs.get("generator") or _default_generator(self.device)
        state = generator.get_state()
        drawn_into = {id(t) for t in _mutated_inputs(func, args, kwargs)}

        def scratch(x: Any) -> Any:
            if not _is_meta(x):
                return self.device if isinstance(x, torch.device) and x == META else x
            if id(x) in drawn_into:  # the tensor drawn into: no need to clear it
                return torch.empty_like(x, device=self.device)
            return self.values([x])[0]  # an input (``bernoulli``'s probabilities): its values may decide the draws

        real_args, real_kwargs = tree_map(scratch, (args, kwargs))
        func(*real_args, **real_kwargs)
        self.end_states[id(generator)] = (generator, generator.get_state())
        return generator, state

    # ------------------------------------------------------------------ replay
    def values(self, tensors: Iterable[torch.Tensor]) -> list[torch.Tensor]:
        """The values eager construction gave ``tensors`` (meta tensors recorded here), computed on the device."""
        tensors = list(tensors)
        needed = self._needed({storage_key(t) for t in tensors})
        storages: dict[int, torch.UntypedStorage] = {}
        saved = {id(g): (g, g.get_state()) for g, _ in self.end_states.values()}
        dtype = torch.get_default_dtype()
        torch.set_default_dtype(self.default_dtype)
        try:
            for op in needed:
                self._run(op, storages)
        finally:
            torch.set_default_dtype(dtype)
            for generator, state in saved.values():
                generator.set_state(state)
        missing = [t for t in tensors if storage_key(t) not in storages]
        if missing:
            raise RuntimeError(
                f"zero3 construction: {len(missing)} tensor(s) of shape {tuple(missing[0].shape)} "
                "were never written while `configure_model` ran; they have no value to replay."
            )
        return [_real(t, storages) for t in tensors]

    def _needed(self, targets: set[int]) -> list[_Op]:
        """The operations that wrote ``targets`` and, transitively, their inputs, in program order."""
        wanted, needed = set(targets), []
        for op in reversed(self.ops):
            if op.writes & wanted:
                needed.append(op)
                wanted |= op.reads
        return needed[::-1]

    def _run(self, op: _Op, storages: dict[int, torch.UntypedStorage]) -> None:
        def real(x: Any) -> Any:
            if _is_meta(x):
                return _real(x, storages)
            return self.device if isinstance(x, torch.device) and x == META else x

        args, kwargs = tree_map(real, (op.args, op.kwargs))
        if op.rng_state is not None and op.generator is not None:
            op.generator.set_state(op.rng_state)
        out = op.func(*args, **kwargs)
        for meta_out, real_out in zip(op.outputs, tree_flatten(out)[0]):
            if meta_out is not None:
                storages[storage_key(meta_out)] = real_out.untyped_storage()


def _real(meta: torch.Tensor, storages: dict[int, torch.UntypedStorage]) -> torch.Tensor:
    """The real tensor with ``meta``'s dtype and geometry over the replayed storage behind it."""
    storage = storages.get(storage_key(meta))
    if storage is None:
        raise KeyError("storage not replayed")
    out = torch.empty(0, dtype=meta.dtype, device=storage.device)
    out.set_(storage, meta.storage_offset(), meta.shape, meta.stride())
    return out


@contextmanager
def record_construction(device: torch.device, recording: Optional[Recording] = None) -> Iterator[Recording]:
    """Build modules on the meta device inside this context and record how (see [Note: record and replay]);
    ``recording`` continues an earlier one (a second ``init_module`` before setup)."""
    recording = recording if recording is not None else Recording(device=device)
    with torch.device(META), LooksEager(device), recording:
        yield recording
    recording.seal()


class PendingRecording:
    """Keeps recording what is done to a built model's meta tensors after its construction context closed, until
    setup replays it.

    [Note: what happens between init_module and setup]
    Fabric's ``init_module()`` returns a model on the meta device, and client code goes on with it before
    ``fabric.setup``: LitGPT's ``pretrain.py`` initializes the weights in place (``initialize_weights``) and rebuilds
    its RoPE cache as new buffers, ``load_checkpoint`` patterns call ``load_state_dict``. On meta tensors all of that
    would do nothing, so after the context closes the recording stays on (``start``) until setup
    (``stop``): in-place initializers, copies from real tensors and new meta buffers join the log, and setup
    replays them after construction, in program order, as an eager build would have run them (the values are
    ``ddp``'s bit for bit). Meta tensors still look like tensors of the device (``is_meta`` is ``False``, initializers
    do not skip them), but nothing else is redirected: a tensor the user makes in between is real, where asked.
    Between the two, every torch call pays the modes' Python dispatch (a few microseconds); setup, teardown and the
    next ``init_module`` end it.
    """

    def __init__(self, recording: Recording) -> None:
        self.recording = recording
        self._looks_eager = LooksEager(recording.device, redirect=False)
        self.active = False

    def start(self) -> "PendingRecording":
        """Push the modes (they stay on the thread's mode stacks until ``stop``)."""
        self._looks_eager.__enter__()
        self.recording.__enter__()
        self.active = True
        return self

    def stop(self) -> Recording:
        """Pop the modes; returns the recording, sealed. Refuses if other modes were entered above them and are
        still open (they would be popped in their place)."""
        if self.active:
            dispatch = torch.utils._python_dispatch._get_current_dispatch_mode_stack()
            function = torch.overrides._get_current_function_mode_stack()
            if (
                not dispatch
                or dispatch[-1] is not self.recording
                or not function
                or function[-1] is not self._looks_eager
            ):
                raise RuntimeError(
                    "zero3: the model built under `fabric.init_module()` is still being recorded, but another torch "
                    "mode was entered after it and is still open. Call `fabric.setup(...)` outside that mode's "
                    "`with` block."
                )
            self.recording.__exit__(None, None, None)
            self._looks_eager.__exit__(None, None, None)
            self.active = False
            self.recording.seal()
        return self.recording


def _default_generator(device: torch.device) -> torch.Generator:
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return torch.cuda.default_generators[index]
    return torch.default_generator


def _names_meta(flat: list) -> bool:
    return any(isinstance(x, torch.device) and x == META for x in flat)


def _mutated_inputs(func: Any, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The tensor arguments ``func``'s schema says it writes (``self`` of ``normal_``, ``out=``)."""
    mutated = []
    for i, arg in enumerate(func._schema.arguments):
        if arg.alias_info is None or not arg.alias_info.is_write:
            continue
        value = args[i] if i < len(args) and not arg.kwarg_only else kwargs.get(arg.name)
        flat, _ = tree_flatten(value)
        mutated += [t for t in flat if isinstance(t, torch.Tensor)]
    return mutated
