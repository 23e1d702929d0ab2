"""Typed, validated options of :class:`~lightning_zero.ZeroStrategy`.

Every option is checked when the strategy is constructed, so a bad value fails before any process is launched.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

#: Stages this version implements. Stage 3 lands in its own change.
SUPPORTED_STAGES = (1, 2)
#: Every stage the paper defines; used to tell "not yet" from "does not exist".
KNOWN_STAGES = (1, 2, 3)

DEFAULT_BUCKET_ELEMENTS = 25_000_000


@dataclass(frozen=True)
class ZeroConfig:
    """Options of the ZeRO engine, one line each."""

    stage: int = 2
    """Which model states are partitioned: 1 optimizer states, 2 also gradients, 3 also parameters."""
    reduce_bucket_size: int = DEFAULT_BUCKET_ELEMENTS
    """Elements per bucket: each full gradient bucket is reduce-scattered, and the updated shards are all-gathered
    bucket by bucket after the step."""
    overlap_comm: bool = True
    """Stage 2: launch each bucket's reduce-scatter asynchronously while backward goes on."""
    bucket_buffers: int = 2
    """How many bucket-sized buffers may be in flight at once (constant memory: this times the bucket size)."""
    partition_whole_params: Optional[bool] = None
    """Give each rank whole tensors instead of flat slices. ``None``: only for optimizers not known to be
    elementwise (Adafactor, LAMB, anything unknown)."""
    elementwise_optimizers: tuple[str, ...] = field(default_factory=tuple)
    """Extra optimizer class names (``"mypkg.MyAdam"`` or ``"MyAdam"``) whose update is elementwise, so that they may
    be stepped on flat slices."""

    def __post_init__(self) -> None:
        _check_stage(self.stage)
        _check_positive_int("reduce_bucket_size", self.reduce_bucket_size)
        _check_positive_int("bucket_buffers", self.bucket_buffers)
        if not isinstance(self.overlap_comm, bool):
            raise TypeError(f"`overlap_comm` must be a bool, got {self.overlap_comm!r}.")
        if self.partition_whole_params not in (None, True, False):
            raise TypeError(f"`partition_whole_params` must be None, True or False, got {self.partition_whole_params!r}.")
        names = self.elementwise_optimizers
        if isinstance(names, str) or not all(isinstance(n, str) for n in names):
            raise TypeError(f"`elementwise_optimizers` must be a list of class names, got {names!r}.")
        object.__setattr__(self, "elementwise_optimizers", tuple(names))


def _check_stage(stage: object) -> None:
    if isinstance(stage, bool) or not isinstance(stage, int):
        raise TypeError(f"`stage` must be an int (1 or 2), got {stage!r}.")
    if stage == 3 and 3 not in SUPPORTED_STAGES:
        raise ValueError("ZeRO stage 3 is not available in this version yet; use `stage=1` or `stage=2`.")
    if stage not in SUPPORTED_STAGES:
        raise ValueError(
            f"ZeRO has no stage {stage}. Pick one of {list(SUPPORTED_STAGES)} "
            "(1: optimizer states, 2: + gradients), e.g. `ZeroStrategy(stage=2)` or `strategy='zero2'`."
        )


def _check_positive_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"`{name}` must be a positive int (a number of elements), got {value!r}.")
    if value <= 0:
        raise ValueError(f"`{name}` must be a positive number of elements, got {value}.")
