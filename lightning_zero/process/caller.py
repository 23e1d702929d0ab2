"""Who called: the user's line a warning about the options points at, and the launcher's rank of this process
before any process group exists (so that a warning every rank would give is given once)."""

from __future__ import annotations

import importlib.util
import os
import sys
from types import FrameType
from typing import Optional

#: Code whose frames a warning to the user skips: ours, the dataclass's generated ``__init__`` (``<string>``),
#: and the libraries that build the strategy from a YAML file or a name (jsonargparse, Lightning).
_NOT_THE_CALLER = (
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))),  # the package
    *(
        location
        for name in ("jsonargparse", "lightning")
        for location in getattr(importlib.util.find_spec(name), "submodule_search_locations", None) or ()
    ),
)


def caller_stacklevel() -> int:
    """The ``stacklevel`` of the first frame outside ``_NOT_THE_CALLER`` and Python's own (``<frozen runpy>``):
    the user's ``ZeroStrategy(...)`` or the script line that starts the CLI. Counted from the caller of this
    function's caller; when every frame is ours (``python -m lightning_zero fit``), the outermost of ours."""
    frame: Optional[FrameType] = sys._getframe(2)
    level = outermost = 2
    while frame is not None:
        name = frame.f_code.co_filename
        if not name.startswith("<frozen"):
            outermost = level
            if not name.startswith("<") and not os.path.abspath(name).startswith(_NOT_THE_CALLER):
                return level
            if name == "<string>" and frame.f_code.co_name != "__init__":
                return level  # code run by `python -c` or exec, not a dataclass's generated __init__
        frame, level = frame.f_back, level + 1
    return outermost


def launch_rank() -> int:
    """This process's rank as the launcher set it in the environment (as Lightning's ``rank_zero_only`` reads it):
    the strategy is built before any process group exists."""
    for key in ("RANK", "LOCAL_RANK", "SLURM_PROCID", "JSM_NAMESPACE_RANK"):
        if key in os.environ:
            return int(os.environ[key])
    return 0
