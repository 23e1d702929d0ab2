"""How much of a model a checkpoint's keys cover, and the key prefix that would make them match.

[Note: a non-strict load says what it skipped]
``strict=False`` loads the keys the checkpoint and the model share and skips the rest without a word, as
``nn.Module.load_state_dict`` does. When the keys differ only by a prefix (a checkpoint of ``model.lm.*`` loaded into
``lm.*``) that is every key, and training would start from random weights. So a load that matches none of the
model's keys is refused even under ``strict=False``, one that matches fewer than half of them warns, and both name
the prefix that would match when there is one.
"""

from __future__ import annotations

import warnings
from collections import Counter
from collections.abc import Collection
from typing import Optional

from lightning_zero.checkpoints.storage import CheckpointError
from lightning_zero.comm import collectives

#: A load under ``strict=False`` that fills fewer than this share of the model's keys warns.
LOW_COVERAGE = 0.5


#: How a user renames a checkpoint's keys, after a ``prefix_hint``.
RENAME = (
    ": `lightning_zero.load_full_checkpoint(path)` gives the checkpoint as a dict whose `state_dict` keys can be "
    "renamed before `model.load_state_dict(...)`"
)


class PartialLoadWarning(UserWarning):
    """A ``strict=False`` load filled fewer than half of the model's keys from the checkpoint."""


def prefix_hint(saved: Collection[str], model: Collection[str]) -> Optional[str]:
    """What to do so that ``saved`` keys match ``model`` keys, when a prefix explains the mismatch: strip one from
    the checkpoint's keys (``model.lm.w`` into ``lm.w``) or add one (``lm.w`` into ``model.lm.w``); else ``None``.

    [Note: a prefix is advised only where it explains the mismatch]
    Two different models share a few names (``lm_head.weight`` in a GPT's checkpoint is ``lm.lm_head.weight`` of a
    LightningModule holding a Llama as ``lm``), and a prefix that matches those few would fix nothing. So a prefix is
    advised only when it matches more keys than match now and at least half of the keys that do not match now on the
    side that has fewer of them (a checkpoint of a part of the model is explained by its prefix too)."""
    present = set(saved) & set(model)
    needed = LOW_COVERAGE * min(len(set(saved) - present), len(set(model) - present))
    best = _best_prefix(saved, model)  # checkpoint key = prefix + model key
    if best is not None and best[1] > len(present) and best[1] >= needed:
        return f"strip {best[0]!r} from the checkpoint's keys (it saved {best[0]}<name> where this model has <name>)"
    best = _best_prefix(model, saved)  # model key = prefix + checkpoint key
    if best is not None and best[1] > len(present) and best[1] >= needed:
        return f"add {best[0]!r} to the checkpoint's keys (it saved <name> where this model has {best[0]}<name>)"
    return None


def _best_prefix(longer: Collection[str], shorter: Collection[str]) -> Optional[tuple[str, int]]:
    """The dotted prefix ``p`` for which the most ``longer`` keys are ``p + k`` with ``k`` in ``shorter``."""
    targets = set(shorter)
    counts: Counter[str] = Counter()
    for key in longer:
        parts = key.split(".")
        for cut in range(1, len(parts)):
            if ".".join(parts[cut:]) in targets:
                counts[".".join(parts[:cut]) + "."] += 1
    return counts.most_common(1)[0] if counts else None


def coverage_message(saved: Collection[str], model: Collection[str], source: str) -> Optional[str]:
    """The one-line problem of a load whose keys match too little of the model, with what to do; ``None`` when at
    least half of the model's keys are in the checkpoint."""
    if not model:
        return None
    matched = len(set(saved) & set(model))
    if matched >= LOW_COVERAGE * len(model):
        return None
    hint = prefix_hint(saved, model)
    todo = (
        f"{hint}{RENAME}"
        if hint is not None
        else "check that it is a checkpoint of this model (checkpoint keys e.g. "
        f"{_first(saved)}, model keys e.g. {_first(model)})"
    )
    return (
        f"The checkpoint {source} fills {matched} of this model's {len(model)} keys under `strict=False`; "
        f"the rest keep their initial values. To load it, {todo}."
    )


def check_coverage(saved: Collection[str], model: Collection[str], source: str, warn: bool = True) -> None:
    """Refuse a load that matches none of the model's keys; warn (on rank 0, when ``warn``) about one that matches
    fewer than half of them (see [Note: a non-strict load says what it skipped])."""
    message = coverage_message(saved, model, source)
    if message is None:
        return
    if not set(saved) & set(model):
        raise CheckpointError(message.replace("the rest keep their initial values", "nothing was loaded"))
    if warn and collectives.rank() == 0:
        warnings.warn(message, PartialLoadWarning, stacklevel=3)


def _first(keys: Collection[str]) -> str:
    return repr(sorted(keys)[0]) if keys else "none"
