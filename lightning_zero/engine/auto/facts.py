"""What ``zero_auto`` learns of the model at setup, before any configuration is made: its sizes, stage 3's units and
one micro-batch's activations (see [Note: the predicted peak] in ``choice.py``)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Optional

import torch
from torch import nn

from lightning_zero.config import ZeroConfig
from lightning_zero.engine.amp import PrecisionMode
from lightning_zero.engine.auto.choice import ModelFacts
from lightning_zero.engine.auto.probe import probe_activations
from lightning_zero.engine.policies import unit_policy
from lightning_zero.stage3.construction import Recording
from lightning_zero.stage3.materialize import materialize
from lightning_zero.stage3.plan import ROOT


def model_facts(
    module: nn.Module,
    batch: Any,
    precision: PrecisionMode,
    config: ZeroConfig,
    device: torch.device,
    accumulates: bool = False,
) -> ModelFacts:
    """Sizes of ``module`` (real or on the meta device) and the activation probe's peak on ``batch`` (0 for
    ``None``: no batch to probe)."""
    if batch is None:
        return replace(model_sizes(module, config), accumulates=accumulates)
    mixed_or_half = precision.precision != "32-true"
    activations = probe_activations(
        module,
        batch,
        precision.working_dtype if mixed_or_half else None,
        lambda: precision.forward_context(device.type),
        device,
    )
    return replace(model_sizes(module, config), activation_bytes=activations, accumulates=accumulates)


def model_sizes(module: nn.Module, config: ZeroConfig) -> ModelFacts:
    """Sizes of ``module`` (real or on the meta device) and of stage 3's units, without activations."""
    params = [p for p in module.parameters() if p.requires_grad]
    plan = unit_policy(config).plan(module)
    per_unit = [0] * len(plan.names)
    for p in params:
        per_unit[plan.unit(p)] += p.numel()
    buffer_bytes = sum(b.numel() * b.element_size() for b in module.buffers())
    return ModelFacts(
        num_params=sum(p.numel() for p in params),
        buffer_bytes=buffer_bytes,
        root_elements=per_unit[ROOT],
        unit_elements=tuple(per_unit[1:]),
        activation_bytes=0,
    )


def held_bytes(module: nn.Module) -> int:
    """Bytes the module's own tensors (parameters and buffers not on the meta device) hold now."""
    seen: set[int] = set()
    total = 0
    for t in [*module.parameters(), *module.buffers()]:
        if t.is_meta or t.numel() == 0 or t.untyped_storage().data_ptr() in seen:
            continue
        seen.add(t.untyped_storage().data_ptr())
        total += t.untyped_storage().nbytes()
    return total


def build_whole(module: nn.Module, device: torch.device, recording: Optional[Recording]) -> None:
    """A model recorded on the meta device (``configure_model`` under ``zero_auto``, which records as zero3 does)
    built whole on ``device`` for a stage that keeps full parameters: the values eager construction gives."""
    if any(t.is_meta for t in [*module.parameters(), *module.buffers()]):
        if recording is not None:
            recording.keep(module)
        materialize(module, device, recording)
