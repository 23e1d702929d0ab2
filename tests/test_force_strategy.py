"""The plugin that forces Lightning's Fabric tests to a stage replaces exactly the DDP family and the default."""

from __future__ import annotations

import pytest
from lightning.fabric.strategies import DDPStrategy

from tests.lightning_suite.force_strategy import forced_name


@pytest.mark.parametrize(("requested", "expected"), [
    ("auto", "zero3"), ("ddp", "zero3"), ("ddp_spawn", "zero3_spawn"), ("ddp_fork", "zero3_fork"),
    ("fsdp", "fsdp"), ("deepspeed", "deepspeed"), ("dp", "dp"), ("ddp_find_unused_parameters_true", None),
])
def test_only_the_ddp_family_and_the_default_are_forced(requested: str, expected: str | None) -> None:
    assert forced_name(requested, "zero3") == (requested if expected is None else expected)


def test_a_strategy_object_is_left_alone() -> None:
    strategy = DDPStrategy()
    assert forced_name(strategy, "zero2") is strategy
