"""What the multi-rank tests compare: relative differences of tensors, and collective payload per optimizer step."""

from __future__ import annotations

from typing import Any

import torch


def relative(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """``|actual - expected| / |expected|`` in float64 (norms over all elements)."""
    expected = torch.as_tensor(expected, dtype=torch.float64)
    return float((torch.as_tensor(actual, dtype=torch.float64) - expected).norm() / expected.norm().clamp_min(1e-12))


def traffic_per_step(batches: list[dict[str, Any]], micro: int) -> list[dict[str, dict[str, int]]]:
    """``TRAFFIC.snapshot()`` of every training batch summed over the ``micro`` batches of each optimizer step:
    elements per scope and collective kind."""
    steps = []
    for start in range(0, len(batches) - micro + 1, micro):
        scopes: dict[str, dict[str, int]] = {}
        for batch in batches[start : start + micro]:
            for scope, kinds in batch["scopes"].items():
                for kind, n in kinds.items():
                    scopes.setdefault(scope, {}).setdefault(kind, 0)
                    scopes[scope][kind] += n
        steps.append(scopes)
    return steps
