"""The ``README.txt`` inside every sharded checkpoint directory: what the directory is and how to read it.

[Note: a checkpoint that explains itself]
``ModelCheckpoint`` names a sharded checkpoint ``last.ckpt`` like a file, and ``torch.load(dir)`` (or Lightning's
``MyModule.load_from_checkpoint(dir)`` in a process that did not import ``lightning_zero``, see [Note: Lightning's
own loaders read a sharded directory] in ``lightning/trainer/lightning_loads.py``) fails on it with a bare
``IsADirectoryError``. So the directory says what it is: rank 0 writes this text into the staging
directory before the rename, so a complete checkpoint always has it. It is not one of the checksummed files in
``meta.pt`` (a user may read or delete it without damaging the checkpoint).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

README_FILE = "README.txt"

_TEXT = """\
This directory is ONE checkpoint: a sharded lightning-zero checkpoint ({format}), written by zero{stage} on
{world_size} process{es} at epoch {epoch}, global step {step}. Each process wrote its own piece, so it is a
directory, not a file: `torch.load(path)` cannot read it (IsADirectoryError), and Lightning's
`MyModule.load_from_checkpoint(path)` only after `import lightning_zero`. Use it with:

  resume or evaluate under zero1/zero2/zero3, any number of processes:
      Trainer(strategy="zero2", ...).fit(model, ckpt_path="{name}")      (also .validate/.test/.predict)
  resume under ddp or on one device (after `import lightning_zero`):
      Trainer(strategy="ddp").fit(model, ckpt_path="{name}")
  inference in a plain Python process:
      model = lightning_zero.load_from_checkpoint(MyModule, "{name}", map_location="cpu")
  one standard Lightning file (then MyModule.load_from_checkpoint("model.ckpt") works):
      lightning-zero consolidate {name} model.ckpt --weights-only
  what is in it, and a check of every file:
      lightning-zero inspect {name} --verify

Files: __<rank>_0.distcp (each process's pieces), .metadata (their index), meta.pt (Lightning's state and the
sizes and checksums of the other files; written last), meta.crc32 (the size and checksum of meta.pt). Move or copy the
directory as a whole; do not edit it.
"""


def write_readme(directory: Path, name: str, meta: dict[str, Any], info: dict[str, Any]) -> None:
    """Write ``README.txt`` into ``directory``, the checkpoint that will be called ``name``; ``meta`` is what goes
    into its ``meta.pt`` (Lightning's checkpoint dict), ``info`` lightning-zero's metadata in it."""
    world_size = info.get("world_size", "?")
    text = _TEXT.format(
        format=info.get("format", "?"),
        stage=info.get("stage", "?"),
        world_size=world_size,
        es="" if world_size == 1 else "es",
        epoch=meta.get("epoch", "?"),
        step=meta.get("global_step", "?"),
        name=name,
    )
    (Path(directory) / README_FILE).write_text(text, encoding="utf-8")
