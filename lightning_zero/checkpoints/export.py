"""A checkpoint of this package as a Hugging Face ``save_pretrained`` directory, written a shard at a time.

[Note: exporting a shard at a time]
``export_pretrained`` reads a sharded checkpoint directory (or one file in ``ddp``'s form, e.g. from
``consolidate``) and writes what ``PreTrainedModel.save_pretrained`` writes: ``config.json`` (and
``generation_config.json``), the weights as ``model.safetensors`` or as ``model-00001-of-0000N.safetensors`` shards
of at most ``max_shard_size`` bytes with ``model.safetensors.index.json``. The shards are planned from the
checkpoint's metadata alone (names, whole shapes, dtypes), by the rule of ``huggingface_hub``'s splitter: tensors in
checkpoint order fill a shard until the next would pass the limit, and a tensor larger than the limit is a shard of
its own. Then each shard's tensors, and only those, are read (a directory: ``torch.distributed.checkpoint`` straight
into whole tensors, tensor-parallel slices joined; a file: views of a memory-mapped load that admits data alone,
``trust.torch_load``), converted, written and dropped before the next shard is read: the process holds one shard, never
the whole model.

[Note: which names an export writes]
The keys are the ``state_dict`` keys under one attribute of the LightningModule (``lm.transformer.wte.weight`` is
written ``transformer.wte.weight`` for the attribute ``lm``); keys outside it are left out. A tied weight is written
once, under its first name in checkpoint order (the input embedding before the output head, the name
``save_pretrained`` keeps, and the name a sharded checkpoint stores it under): a directory records every name of a
tied tensor (``meta.pt``'s ``model`` map), a file keeps the aliasing (one storage, several names).

[Note: configs recorded at save time]
When the module being saved holds ``transformers.PreTrainedModel`` submodules, the sharded save records, under
``meta.pt``'s ``lightning_zero.pretrained``, for each outermost one by its attribute path (``""`` for the module
itself): the class name and ``config`` / ``generation_config`` as JSON strings (data, never pickled objects).
A file written with ``state_dict_type="full"``, and ``consolidate``'s, carry it under ``lightning_zero.pretrained``.
Nothing is recorded, and transformers is not imported, for a module without one.
"""

from __future__ import annotations

import json
import math
import os
import re
import sys
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Union

import torch
from torch import Tensor, nn

from lightning_zero.checkpoints import trust
from lightning_zero.checkpoints.errors import CheckpointError
from lightning_zero.checkpoints.recut import whole_shape
from lightning_zero.checkpoints.shards import Shard
from lightning_zero.checkpoints.storage import KEY, check_files, load_sharded, read_meta
from lightning_zero.tensor_parallel import join

_PATH = Union[str, "os.PathLike[str]"]
#: The entry of our metadata (``meta.pt``'s, or a consolidated file's ``lightning_zero``) that holds the configs.
PRETRAINED = "pretrained"
WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
#: What a refused file tells the user: export has no switch to run a file's code.
EXPORT_HINT = (
    "Export the sharded checkpoint directory instead, or, if you trust whoever wrote the file, re-save it "
    "with tensors and plain values (`torch.save(torch.load(f, weights_only=False), f)`)."
)
_SHARD_NAME = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")
_SIZE_UNITS = {
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "b": 1,
}


# ---------------------------------------------------------------------- save side: what the checkpoint records
def pretrained_configs(module: nn.Module) -> dict[str, dict[str, Optional[str]]]:
    """The record of [Note: configs recorded at save time] for ``module`` (empty when it holds no
    ``transformers.PreTrainedModel``; transformers is never imported here: a module holding one has imported it)."""
    transformers = sys.modules.get("transformers")
    if transformers is None:
        return {}
    found: dict[str, dict[str, Optional[str]]] = {}
    for name, sub in module.named_modules():
        if not isinstance(sub, transformers.PreTrainedModel):
            continue
        if any(name == outer or name.startswith(outer + ".") or outer == "" for outer in found):
            continue  # inside one already recorded (GPT2LMHeadModel's GPT2Model)
        config = json.loads(sub.config.to_json_string())
        config["architectures"] = [type(sub).__name__]
        generation = sub.generation_config if sub.can_generate() else None
        found[name] = {
            "class": type(sub).__name__,
            "config": json.dumps(config),
            "generation_config": generation.to_json_string() if generation is not None else None,
        }
    return found


# ---------------------------------------------------------------------- sources
@dataclass
class _Source:
    """A checkpoint's tensors as the export sees them: one name per stored tensor (the first, see [Note: which names
    an export writes]) with its whole shape and dtype, every name of each, and a reader of a few of them."""

    shapes: dict[str, tuple[int, ...]]
    dtypes: dict[str, torch.dtype]
    aliases: dict[str, list[str]]
    pretrained: dict[str, dict[str, Optional[str]]]
    read: Callable[[list[str]], dict[str, Tensor]]
    skipped: list[str] = field(default_factory=list)


def _directory_source(path: Path) -> _Source:
    meta = read_meta(path)
    check_files(path, meta)
    info = meta[KEY]
    shapes: dict[str, tuple[int, ...]] = {}
    dtypes: dict[str, torch.dtype] = {}
    aliases: dict[str, list[str]] = {}
    first_of: dict[str, str] = {}  # stored key to its first name
    stored_of: dict[str, str] = {}  # first name to its stored key
    skipped = []
    for name, stored in info["model"].items():
        if info["tensors"].get(stored) is None:  # a pickled value in the state dict: not a tensor
            skipped.append(name)
        elif stored in first_of:
            aliases[first_of[stored]].append(name)
        else:
            first_of[stored], stored_of[name] = name, stored
            aliases[name] = [name]
            shapes[name] = tuple(whole_shape(info, stored))
            dtypes[name] = getattr(torch, info["tensors"][stored][1])

    def read(names: list[str]) -> dict[str, Tensor]:
        stacked = {n: torch.empty(info["tensors"][stored_of[n]][0], dtype=dtypes[n]) for n in names}
        load_sharded(
            path, {stored_of[n]: Shard.whole(t) for n, t in stacked.items() if t.numel()}, None, collective=False
        )
        joins = info.get("tensor_parallel", {})
        return {n: join(tuple(t), *joins[stored_of[n]]) if joins.get(stored_of[n]) else t for n, t in stacked.items()}

    return _Source(shapes, dtypes, aliases, dict(info.get(PRETRAINED, {})), read, skipped)


def _file_source(path: Path) -> _Source:
    try:
        checkpoint = trust.torch_load(path, path, mmap=True, hint=EXPORT_HINT)
    except trust.UntrustedCheckpointError:
        raise
    except Exception as error:
        raise CheckpointError(
            f"{path} cannot be read as a checkpoint of data alone ({error}). Export the sharded "
            "checkpoint directory instead, or re-save the file with tensors and plain values."
        ) from error
    state = checkpoint.get("state_dict", checkpoint) if isinstance(checkpoint, dict) else None
    if not isinstance(state, dict):
        raise CheckpointError(f"{path} is not a checkpoint: it holds no state dict of tensors.")
    tensors = {n: t for n, t in state.items() if isinstance(t, Tensor)}
    aliases: dict[str, list[str]] = {}
    first: dict[tuple[Any, ...], str] = {}
    for name, t in tensors.items():
        where = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)
        if t.numel() and where in first:
            aliases[first[where]].append(name)
        else:
            first[where] = name
            aliases[name] = [name]
    ours = checkpoint.get(KEY) if isinstance(checkpoint.get(KEY), dict) else {}
    return _Source(
        {n: tuple(tensors[n].shape) for n in aliases},
        {n: tensors[n].dtype for n in aliases},
        aliases,
        dict(ours.get(PRETRAINED, {})),
        lambda names: {n: tensors[n] for n in names},
        [n for n in state if n not in tensors],
    )


# ---------------------------------------------------------------------- planning
def parse_shard_size(size: Union[int, str]) -> int:
    """Hugging Face's size syntax: an int (bytes) or ``"5GB"`` (``5 * 10**9``), ``"5GiB"`` (``5 * 2**30``),
    ``"200MB"``, ``"64KiB"``."""
    if isinstance(size, int) and size > 0:
        return size
    text = str(size).strip().lower()
    unit = next((u for u in sorted(_SIZE_UNITS, key=len, reverse=True) if text.endswith(u)), None)
    try:
        number = float(text[: -len(unit)] if unit else text)
    except ValueError:
        number = math.nan
    if unit is None or not number > 0 or math.isinf(number):
        raise ValueError(
            f"max_shard_size {size!r} is not a size: write e.g. 5GB (5 * 10^9 bytes), 5GiB (5 * 2^30), "
            "500MB, or a number of bytes."
        )
    return int(number * _SIZE_UNITS[unit])


def plan_shards(sizes: dict[str, int], max_bytes: int) -> list[list[str]]:
    """Names in order, cut into shards of at most ``max_bytes`` as ``huggingface_hub`` cuts them: a tensor larger
    than the limit is a shard of its own, listed before the shard being filled when it came."""
    shards: list[list[str]] = []
    current: list[str] = []
    used = 0
    for name, size in sizes.items():
        if size > max_bytes:
            shards.append([name])
            continue
        if current and used + size > max_bytes:
            shards.append(current)
            current, used = [], 0
        current.append(name)
        used += size
    if current:
        shards.append(current)
    return shards


def shard_file_names(count: int) -> list[str]:
    """The file names transformers gives ``count`` shards."""
    return [WEIGHTS_NAME] if count == 1 else [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]


def _choose(source: _Source, submodule: Optional[str], config_given: bool) -> tuple[str, Optional[dict[str, Any]]]:
    """(the attribute whose keys are exported, ``""`` for every key; its recorded configs or ``None``)."""
    recorded = source.pretrained
    if submodule is None and len(recorded) > 1:
        raise CheckpointError(
            f"The checkpoint holds {len(recorded)} pretrained models ({', '.join(map(repr, recorded))}"
            "): pick one with `submodule=` (`--submodule NAME`)."
        )
    if submodule is None:
        submodule = next(iter(recorded), "")
    if submodule not in recorded and recorded and not config_given:
        raise CheckpointError(
            f"The checkpoint records no config for {submodule!r}, only for "
            f"{', '.join(map(repr, recorded))}: pick one of those with `--submodule`, or pass the "
            "model's config with `--config DIR_OR_NAME`."
        )
    prefix = submodule + "." if submodule else ""
    if not any(n.startswith(prefix) for group in source.aliases.values() for n in group):
        tops = sorted({n.split(".")[0] for group in source.aliases.values() for n in group})
        raise CheckpointError(
            f"The checkpoint has no weights under {submodule!r}; its top-level attributes are "
            f"{', '.join(map(repr, tops))}: pass one of them as `--submodule`."
        )
    return submodule, recorded.get(submodule)


def _configs(
    recorded: Optional[dict[str, Any]], config: Optional[_PATH]
) -> tuple[Optional[dict[str, Any]], Optional[str]]:
    """(config.json as a dict, generation_config.json's text) from ``config`` (a directory or a Hub name, read by
    transformers) or else the checkpoint's record; ``(None, None)`` when neither has one."""
    if config is not None:
        from transformers import AutoConfig, GenerationConfig

        loaded = AutoConfig.from_pretrained(config)
        try:
            generation: Optional[str] = GenerationConfig.from_pretrained(config).to_json_string()
        except OSError:  # the directory or model has none
            generation = None
        return json.loads(loaded.to_json_string()), generation
    if recorded is None:
        return None, None
    return json.loads(recorded["config"]), recorded.get("generation_config")


# ---------------------------------------------------------------------- export
@dataclass(frozen=True)
class ExportResult:
    """What ``export_pretrained`` wrote."""

    directory: Path
    files: list[str]
    """The weight files, in order."""
    total_size: int
    """Bytes of tensor data in the weight files."""
    num_tensors: int
    config_written: bool
    submodule: str
    """The attribute exported (``""``: every key, as saved)."""


def export_pretrained(
    checkpoint: _PATH,
    output_dir: _PATH,
    submodule: Optional[str] = None,
    max_shard_size: Union[int, str] = "5GB",
    dtype: Optional[torch.dtype] = None,
    config: Optional[_PATH] = None,
    require_config: bool = False,
) -> ExportResult:
    """Write ``checkpoint`` (a sharded checkpoint directory, or a file in ``ddp``'s form such as ``consolidate``
    writes) as a Hugging Face ``save_pretrained`` directory ``output_dir``, one shard in memory at a time (see
    [Note: exporting a shard at a time]).

    Args:
        submodule: the LightningModule's attribute to export (see [Note: which names an export writes]); by default
            the one pretrained model the checkpoint records, or every key as saved when it records none.
        max_shard_size: the most bytes per weight file, in Hugging Face's syntax (``"5GB"``, ``"500MiB"``, bytes).
        dtype: convert the floating-point weights (default: as saved; fp32 masters under mixed precision).
        config: a directory or Hub name whose config to write, for a checkpoint that records none (or to replace it).
        require_config: refuse, before writing anything, when no config is recorded or given (the command line's
            behaviour); without it, a model that is not from transformers gets its weights alone.
    """
    path, out = Path(checkpoint), Path(output_dir)
    max_bytes = parse_shard_size(max_shard_size)
    if not path.exists():
        raise FileNotFoundError(f"No checkpoint at {path}.")
    source = _directory_source(path) if path.is_dir() else _file_source(path)
    chosen, recorded = _choose(source, submodule, config is not None)
    config_json, generation = _configs(recorded, config)
    if config_json is None and require_config:
        raise CheckpointError(
            f"The checkpoint {path} records no transformers config (it is recorded when the saved "
            "module holds a transformers PreTrainedModel): pass the model's config with `--config "
            "DIR_OR_NAME` (a save_pretrained directory or a Hub name)."
        )
    prefix = chosen + "." if chosen else ""
    names = {
        inside[0][len(prefix) :]: first
        for first, group in source.aliases.items()
        for inside in [[n for n in group if n.startswith(prefix)]]
        if inside
    }
    out_dtypes = {
        k: dtype if dtype is not None and source.dtypes[n].is_floating_point else source.dtypes[n]
        for k, n in names.items()
    }
    sizes = {k: math.prod(source.shapes[n]) * out_dtypes[k].itemsize for k, n in names.items()}
    shards = plan_shards(sizes, max_bytes)
    files = shard_file_names(len(shards))
    out.mkdir(parents=True, exist_ok=True)
    _remove_stale(out, files)
    for file, keys in zip(files, shards):
        read = source.read([names[k] for k in keys])
        _write_shard(out / file, {k: read[names[k]] for k in keys}, out_dtypes)
        del read
    weight_map = {k: file for file, keys in zip(files, shards) for k in keys}
    if len(files) > 1:
        index = {
            "metadata": {
                "total_parameters": sum(math.prod(source.shapes[n]) for n in names.values()),
                "total_size": sum(sizes.values()),
            },
            "weight_map": weight_map,
        }
        _write_text(out / INDEX_NAME, json.dumps(index, indent=2, sort_keys=True) + "\n")
    if config_json is not None:
        floating = [d for d in out_dtypes.values() if d.is_floating_point]
        if floating:
            config_json["dtype"] = str(floating[0]).removeprefix("torch.")
        _write_text(out / "config.json", json.dumps(config_json, indent=2, sort_keys=True) + "\n")
        if generation is not None:
            _write_text(out / "generation_config.json", generation)
    if source.skipped:
        warnings.warn(
            f"Left out {len(source.skipped)} state dict entries that are not tensors: {', '.join(source.skipped[:5])}.",
            stacklevel=2,
        )
    return ExportResult(out, files, sum(sizes.values()), len(names), config_json is not None, chosen)


def _write_shard(file: Path, tensors: dict[str, Tensor], dtypes: dict[str, torch.dtype]) -> None:
    """One weight file, through a temporary name (a reader never sees half a file)."""
    from safetensors.torch import save_file

    converted = {k: t.to(dtypes[k]).contiguous() for k, t in tensors.items()}
    staging = file.with_name(f".{file.name}.tmp")
    save_file(converted, str(staging), metadata={"format": "pt"})
    os.chmod(staging, new_file_mode())  # safetensors creates its files 0600: give them the mode every other file has
    os.replace(staging, file)


def new_file_mode() -> int:
    """The permissions a file this process creates gets (``0o666`` less the umask), without changing the umask where
    Linux reports it (``/proc/self/status``, since 4.7); elsewhere read by setting it and back."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return 0o666 & ~int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return 0o666 & ~mask


def _write_text(file: Path, text: str) -> None:
    staging = file.with_name(f".{file.name}.tmp")
    staging.write_text(text, encoding="utf-8")
    os.replace(staging, file)


def _remove_stale(out: Path, files: list[str]) -> None:
    """Weight files of an earlier export into the same directory that this one does not overwrite (as
    ``save_pretrained`` does): a reader would otherwise find two sets of weights."""
    for old in out.iterdir():
        stale = old.name == INDEX_NAME or old.name == WEIGHTS_NAME or _SHARD_NAME.fullmatch(old.name) is not None
        if stale and old.name not in files and old.is_file():
            old.unlink()
