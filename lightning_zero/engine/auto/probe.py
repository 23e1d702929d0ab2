"""The activation probe of ``zero_auto``: one training step's forward and backward on one micro-batch of the real data,
run on fake tensors, with the peak of the bytes it made alive counted.

[Note: the activation probe]
What decides whether a run fits, next to the model states, is the peak of the tensors one micro-batch makes alive:
the activations autograd saves in forward, the gradients of the activations in backward and the temporaries of the
largest op (a GPT's logits and their gradient). The probe runs the module's own ``training_step`` on the first
micro-batch of its training data, as a user would probe by hand, but under torch's ``FakeTensorMode``: parameters,
buffers and the batch are fake tensors of the real shapes, dtypes and device (so autocast casts as it would), and
no memory is taken whatever the model's size. A dispatch mode above it counts every storage an op makes until the
storage dies: its high-water mark is the step's own peak. Each parameter's gradient is dropped as soon as it is
accumulated: the model states (gradients included) are counted by the formula, once per stage; a gradient alive
for the length of one op is part of the peak, as it is in a real backward.

``.item()`` and ``float(loss)`` of a fake tensor have no value: the probe answers 0 (a loss logged or appended to a
list is a number nobody reads); ``self.log`` and ``self.log_dict`` do nothing during the probe. A ``training_step``
that steps its optimizers itself (manual optimization) is run with their ``step`` and ``zero_grad`` skipped.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from typing import Any, Callable, Optional, cast

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.nn.utils.stateless import _reparametrize_module
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

_SCALAR = torch.ops.aten._local_scalar_dense.default


class LiveBytes(TorchDispatchMode):
    """Counts the bytes of the storages that ops make, from their creation until they die, and their peak."""

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self._alive: dict[int, int] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        if func is _SCALAR:  # a fake tensor has no value: see [Note: the activation probe]
            return False if args[0].dtype == torch.bool else 0
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage()._cdata for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
        for tensor in tree_flatten(out)[0]:
            # a view or an in-place result shares an input's storage: nothing new (a parameter's ``W.t()``)
            if isinstance(tensor, torch.Tensor) and tensor.untyped_storage()._cdata not in inputs:
                self._count(tensor)
        return out

    def _count(self, tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        key = storage._cdata
        if key in self._alive:
            return
        nbytes = storage.nbytes()
        self._alive[key] = nbytes
        self.live += nbytes
        self.peak = max(self.peak, self.live)
        weakref.finalize(storage, self._free, key)

    def _free(self, key: int) -> None:
        self.live -= self._alive.pop(key, 0)


def probe_activations(
    module: nn.Module,
    batch: Any,
    param_dtype: Optional[torch.dtype],
    forward_context: Callable[[], contextlib.AbstractContextManager],
    device: torch.device,
) -> int:
    """Peak bytes one micro-batch's ``training_step`` and backward make alive on ``device``, model states left out
    (see [Note: the activation probe]). ``param_dtype``: the dtype the parameters compute in (``None``: theirs)."""
    with FakeTensorMode(allow_non_fake_inputs=True) as fake:
        leaves = {
            name: _fake_like(t, param_dtype if t.is_floating_point() else None, device)
            for name, t in [*module.named_parameters(), *module.named_buffers()]
        }
        handles = [t.register_post_accumulate_grad_hook(_drop_grad) for t in leaves.values() if t.requires_grad]
        fake_batch = tree_map(lambda x: fake.from_tensor(x.to(device)) if isinstance(x, torch.Tensor) else x, batch)
        counter = LiveBytes()
        try:
            with _reparametrize_module(module, leaves, tie_weights=True), _quiet(module), counter:
                with forward_context():
                    # a LightningModule's (the engine does not import Lightning)
                    loss = cast(Callable[..., Any], module.training_step)(fake_batch, 0)
                loss = loss.get("loss") if isinstance(loss, dict) else loss
                if isinstance(loss, torch.Tensor) and loss.requires_grad:
                    loss.backward()
        finally:
            for handle in handles:
                handle.remove()
    return counter.peak


def _fake_like(tensor: torch.Tensor, dtype: Optional[torch.dtype], device: torch.device) -> torch.Tensor:
    """A fresh fake leaf of ``tensor``'s shape (made inside ``FakeTensorMode``), with its ``requires_grad``."""
    leaf = torch.empty(tensor.shape, dtype=dtype or tensor.dtype, device=device)
    return leaf.requires_grad_(tensor.requires_grad)


def _drop_grad(param: torch.Tensor) -> None:
    param.grad = None


@contextlib.contextmanager
def _quiet(module: nn.Module) -> Iterator[None]:
    """``self.log`` / ``self.log_dict`` do nothing, and the module's optimizers do not step, during the probe."""
    saved = {name: module.__dict__.get(name) for name in ("log", "log_dict", "optimizers")}
    module.__dict__["log"] = lambda *args, **kwargs: None  # instance attributes shadow the methods
    module.__dict__["log_dict"] = lambda *args, **kwargs: None
    module.__dict__["optimizers"] = lambda *args, **kwargs: _Idle()
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                module.__dict__.pop(name, None)
            else:
                module.__dict__[name] = value


class _Idle:
    """What ``self.optimizers()`` returns during the probe: any call does nothing, unpacking gives more of it."""

    def __getattr__(self, name: str) -> Callable[..., None]:
        return lambda *args, **kwargs: None

    def __iter__(self) -> Iterator["_Idle"]:
        return iter([_Idle() for _ in range(8)])
