"""Typed, validated options of the engine, defined once: :class:`ZeroConfig`. ``ZeroStrategy``,
``ZeroFabricStrategy`` and ``ZeroEngine`` take them as keyword arguments and hand them here.

Every option is checked when the strategy is constructed, so a bad value fails before any process is launched.
"""

from __future__ import annotations

import math
import os
import warnings
from dataclasses import dataclass, field, fields
from difflib import get_close_matches
from typing import Any, Callable, Literal, Optional, Union, overload

from lightning_zero.process.caller import caller_stacklevel, launch_rank
from lightning_zero.shards.policy import (  # noqa: F401 - the default bucket size, also public here
    AUTO_BUCKET_FRACTION,
    MAX_AUTO_BUCKET_ELEMENTS,
    MIN_AUTO_BUCKET_ELEMENTS,
    auto_bucket_elements,
)
from lightning_zero.stages import STAGES, all_policies

#: Stages this version implements.
SUPPORTED_STAGES = STAGES

#: Options that only stage 3 reads, with their defaults (``unit_classes`` also picks the blocks of
#: ``activation_checkpointing=True`` at every stage).
STAGE3_DEFAULTS: dict[str, Any] = {"unit_classes": (), "persistence_threshold": None, "prefetch_size": 5_000_000}


#: A number of elements: an int, or a float with a whole value as YAML gives ``1e6`` (taken as the int 1000000).
Elements = Union[int, float]
#: The options that are numbers of elements (see :data:`Elements`).
ELEMENT_OPTIONS = ("reduce_bucket_size", "persistence_threshold", "prefetch_size", "host_mmap_threshold")


@dataclass(frozen=True)
class ZeroConfig:
    """Options of the ZeRO engine, one line each."""

    stage: int = 2
    """Which model states are partitioned: 1 optimizer states, 2 also gradients, 3 also parameters."""
    reduce_bucket_size: Optional[Elements] = None
    """Elements per bucket: each full gradient bucket is reduce-scattered, and the updated shards are all-gathered
    bucket by bucket after the step. ``None``: chosen from the model, 1M to 4M elements (see [Note: the default bucket
    size] in ``shards/policy.py``)."""
    overlap_comm: bool = True
    """Stage 2: launch each bucket's reduce-scatter asynchronously while backward goes on (under hybrid sharding, each
    reduced chunk's all-reduce across the replicas too: see [Note: the replica all-reduce overlaps] in
    ``buckets.py``)."""
    lockstep_check: Union[bool, Literal["strict"]] = True
    """Stage 3: before each unit's forward and backward, every rank says which unit it is about to run (one small
    CPU message per unit and pass, waited for at the next unit), so ranks whose control flow differs fail together
    within one unit, naming it, instead of at the process group's timeout (see [Note: the lockstep check] in
    ``stage3/lockstep.py``). ``"strict"``: each unit waits for every rank before it runs, also catching a divergence
    before a collective of the model's own inside the unit (about 5% slower on two CPU ranks). ``False`` saves the
    messages once the model's control flow is known to be the same on every rank."""
    bucket_buffers: int = 2
    """How many bucket-sized buffers may be in flight at once (constant memory: this times the bucket size)."""
    partition_whole_params: Optional[bool] = None
    """Give each rank whole tensors instead of flat slices. ``None``: only for optimizers not known to be
    elementwise (Adafactor, LAMB, anything unknown)."""
    elementwise_optimizers: tuple[str, ...] = field(default_factory=tuple)
    """Extra optimizer class names (``"mypkg.MyAdam"`` or ``"MyAdam"``) whose update is elementwise, so that they may
    be stepped on flat slices."""
    unit_classes: tuple[Union[type, str], ...] = STAGE3_DEFAULTS["unit_classes"]
    """Stage 3: module classes (or class names) gathered as one unit; default: the children of ``nn.ModuleList`` and
    ``nn.Sequential`` and every other module with parameters."""
    persistence_threshold: Optional[Elements] = STAGE3_DEFAULTS["persistence_threshold"]
    """Stage 3: units with at most this many elements join the root unit, gathered once per step. ``None``: 100,000
    for every model (see [Note: one algorithm at every size] in ``stage3/plan.py``)."""
    prefetch_size: Elements = STAGE3_DEFAULTS["prefetch_size"]
    """Stage 3: elements of the next units that may be all-gathered ahead of their use (0 turns prefetch off)."""
    host_mmap_threshold: Optional[Elements] = None
    """CPU runs on glibc, an escape hatch: fix the allocator's mmap threshold at this many bytes for the whole
    process, so that freed tensors above it leave the process (lower peaks, more page faults and slower steps).
    ``None`` or 0 (the default): glibc is left alone, as DDP has it (see [Note: no allocator setting decides speed
    or memory] in ``memory/host_memory.py``)."""
    state_dict_type: Literal["sharded", "full"] = "sharded"
    """Checkpoints: ``"sharded"`` writes a directory, each rank its own pieces; ``"full"`` gathers one file on rank 0
    in the form ``ddp`` writes."""
    activation_checkpointing: Union[bool, tuple[Union[type, str], ...]] = False
    """Recompute blocks in backward: ``True`` for the repeated blocks (``unit_classes`` if set), or block classes."""
    activation_offload: bool = False
    """Pa+cpu: keep the checkpointed block inputs in (pinned) host memory until their recomputation."""
    activation_partition_group: Optional[Union[tuple[int, ...], tuple[tuple[int, ...], ...], Callable[[], Any]]] = None
    """Pa: global ranks (or lists of them, or a callable returning a process group) holding identical activations."""
    contiguous_checkpoints: bool = False
    """MD: copy the checkpointed block inputs into one preallocated buffer, sized after the first step."""
    offload_optimizer: Union[bool, Literal["disk"]] = False
    """ZeRO-Offload: the master shard, the optimizer states and the optimizer step live in (pinned) host memory; the
    device keeps the working parameters and gradients (see [Note: what lives where ...] in ``offload.py``).
    ``"disk"`` (ZeRO-Infinity): the master shard and the optimizer states live in files under ``offload_path`` and the
    step runs one bucket-sized window at a time (see [Note: what lives on disk] in ``disk.py``)."""
    offload_params: Union[bool, Literal["disk"]] = False
    """Stage 3 only: each rank's working parameter shard lives in (pinned) host memory and units are uploaded as they
    are gathered (see [Note: offloaded parameter shards] in ``params.py``); ``"disk"``: in a file under
    ``offload_path``, read unit by unit as the units are gathered."""
    offload_path: Optional[str] = None
    """With ``offload_optimizer="disk"`` or ``offload_params="disk"``: a local directory for this rank's files (made
    if missing; the files have no name, so nothing is left there on any exit: see [Note: the files have no name] in
    ``disk.py``). ``None``: the system's temporary directory."""
    shard_group_size: Optional[Union[int, Literal["node"]]] = None
    """Hybrid sharding: shard model states over groups of this many ranks (``"node"``: the devices of one node) and
    replicate them across the groups (see [Note: hybrid sharding and its traffic] in ``groups.py``). ``None``: all
    ranks, the paper's N, on any number of nodes (with ``tensor_parallel_size``: the whole data dimension, which it
    must divide). Must divide the world size."""
    tensor_parallel_size: int = 1
    """ZeRO with tensor parallelism: the ranks form a (data x tensor) mesh with this many ranks per tensor group;
    ``configure_model`` gets it as ``self.device_mesh`` to parallelize its layers over ``"tensor_parallel"``, and ZeRO
    shards over ``"data_parallel"`` (see [Note: ZeRO over the data dimension] in ``groups.py``). Must divide the
    world size."""
    secondary_shard_group_size: Optional[int] = None
    """Stage 3, hpZ (ZeRO++): after a unit's forward all-gather, each rank keeps a secondary copy of the unit sharded
    over groups of this many consecutive ranks (a node's devices), so backward's re-gather stays inside that group;
    the model states stay sharded over all ranks (unlike ``shard_group_size``). Costs Ψ/s working-dtype elements
    per rank during backward (see [Note: hpZ, the secondary partition] in ``stage3/secondary.py``). ``None``: off
    (one node, as on a single machine, gains nothing from it). Must divide the world size."""
    quantized_weights: bool = False
    """Stage 3, qwZ (ZeRO++): the all-gathers of units for forward and backward send blockwise int8 codes and one fp32
    scale per ``quantization_block_size`` elements, dequantized on arrival; masters, step and checkpoints stay exact
    (see [Note: qwZ, the quantized all-gather of weights] in ``comm/quantize.py``)."""
    quantized_gradients: bool = False
    """Stages 2 and 3, qgZ (ZeRO++): each gradient bucket is reduced by an all-to-all of blockwise int8 codes and
    scales, dequantized and summed in fp32 on the rank that owns the chunk, instead of a reduce-scatter (see
    [Note: qgZ, the quantized reduce-scatter of gradients] in ``comm/quantize.py``)."""
    quantization_block_size: int = 256
    """qwZ and qgZ: elements per quantization block (one fp32 scale each)."""
    shutdown_timeout: Optional[float] = 120.0
    """The Trainer: seconds a rank may take to act on a SIGTERM it received before it ends itself with a message
    naming where it is stuck (see [Note: a SIGTERM is acted on within a bound] in ``shutdown.py``); ``None``: no
    bound. Set it above your longest step and checkpoint write."""
    nonfinite: Optional[Literal["raise", "skip"]] = None
    """What an optimizer step does when the global norm of its gradients is inf or NaN: ``"raise"`` stops every rank
    with the step and rank, ``"skip"`` skips the update on every rank (counted in ``ZeroEngine.skipped_steps``);
    ``None``: steps anyway, as DDP does. Under ``16-mixed`` the loss scaler already skips such steps (see [Note: the
    non-finite guard] in ``engine/engine.py``)."""

    def __post_init__(self) -> None:
        _check_stage(self.stage)
        for name in ELEMENT_OPTIONS:
            object.__setattr__(self, name, _whole_number(name, getattr(self, name)))
        if self.reduce_bucket_size is not None:
            _check_positive_int("reduce_bucket_size", self.reduce_bucket_size, "elements")
        _check_positive_int("bucket_buffers", self.bucket_buffers, "buffers")
        if self.shard_group_size is not None and self.shard_group_size != "node":
            if isinstance(self.shard_group_size, str):
                raise TypeError(
                    f"`shard_group_size` must be a number of ranks or 'node' (a node's devices), got "
                    f"{self.shard_group_size!r}."
                )
            _check_positive_int("shard_group_size", self.shard_group_size, "ranks")
        _check_positive_int("tensor_parallel_size", self.tensor_parallel_size, "ranks")
        if self.tensor_parallel_size > 1 and self.state_dict_type == "full":
            raise ValueError(
                "`state_dict_type='full'` writes one file of full tensors on rank 0, which holds only its "
                "own tensor-parallel slices. With `tensor_parallel_size > 1` save sharded checkpoints "
                "(the default) and make one full file afterwards with `lightning-zero consolidate`, which "
                "joins the slices."
            )
        if not isinstance(self.overlap_comm, bool):
            raise TypeError(f"`overlap_comm` must be a bool, got {self.overlap_comm!r}.")
        if not isinstance(self.lockstep_check, bool) and self.lockstep_check != "strict":
            raise TypeError(f"`lockstep_check` must be True, False or 'strict', got {self.lockstep_check!r}.")
        self._check_offload()
        if self.partition_whole_params not in (None, True, False):
            raise TypeError(
                f"`partition_whole_params` must be None, True or False, got {self.partition_whole_params!r}."
            )
        names = self.elementwise_optimizers
        if isinstance(names, str) or not all(isinstance(n, str) for n in names):
            raise TypeError(f"`elementwise_optimizers` must be a list of class names, got {names!r}.")
        object.__setattr__(self, "elementwise_optimizers", tuple(names))
        classes = self.unit_classes
        if isinstance(classes, (str, type)) or not all(isinstance(c, (str, type)) for c in classes):
            raise TypeError(f"`unit_classes` must be a list of module classes or class names, got {classes!r}.")
        object.__setattr__(self, "unit_classes", tuple(classes))
        for name in ("persistence_threshold", "prefetch_size", "host_mmap_threshold"):
            value = getattr(self, name)
            if name in ("persistence_threshold", "host_mmap_threshold") and value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"`{name}` must be a number of elements >= 0, got {value!r}.")
        if self.state_dict_type not in ("sharded", "full"):
            raise ValueError(f"`state_dict_type` must be 'sharded' or 'full', got {self.state_dict_type!r}.")
        self._check_activations()
        if self.nonfinite not in (None, "raise", "skip"):
            raise ValueError(f"`nonfinite` must be 'raise', 'skip' or None (step anyway), got {self.nonfinite!r}.")
        timeout = self.shutdown_timeout
        if timeout is not None and (
            isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout < math.inf
        ):
            raise ValueError(
                f"`shutdown_timeout` must be a positive number of seconds or None (no bound), got {timeout!r}."
            )
        if self.offload_params and self.stage != 3:
            # not a warning like the other stage 3 options: ignoring it would silently keep every parameter on the
            # device, which is what the user set it to avoid
            raise ValueError(
                f"`offload_params={self.offload_params!r}` offloads stage 3's parameter shards, but stage {self.stage} "
                "keeps full parameters on every rank. Use `stage=3` (`strategy='zero3'`) with it, or "
                "`offload_optimizer=True` alone to offload the optimizer at this stage."
            )
        self._check_secondary()
        self._check_quantized()
        self._warn_ignored()

    @property
    def on_disk(self) -> bool:
        """Whether a tier lives on disk (``offload_optimizer`` or ``offload_params`` is ``"disk"``)."""
        return "disk" in (self.offload_optimizer, self.offload_params)

    def _check_offload(self) -> None:
        """Check ``offload_optimizer``, ``offload_params`` and ``offload_path`` (a path that cannot hold files fails
        here, in the launching process, where that can be told without writing)."""
        for name in ("offload_optimizer", "offload_params"):
            value = getattr(self, name)
            if not isinstance(value, bool) and value != "disk":
                raise TypeError(
                    f"`{name}` must be a bool (True: host memory) or 'disk' (files under `offload_path`), "
                    f"got {value!r}."
                )
        path = self.offload_path
        if path is None:
            return
        if not isinstance(path, (str, os.PathLike)):
            raise TypeError(f"`offload_path` must be a directory path, got {path!r}.")
        object.__setattr__(self, "offload_path", os.fspath(path))
        if "disk" not in (self.offload_optimizer, self.offload_params):
            raise ValueError(
                f"`offload_path={path!r}` is where `offload_optimizer='disk'` or `offload_params='disk'` "
                "put their files, and neither is set. Set one of them to 'disk', or leave `offload_path` "
                "out."
            )
        existing = os.path.abspath(os.path.expanduser(os.fspath(path)))
        while not os.path.exists(existing):
            existing = os.path.dirname(existing)
        if not os.path.isdir(existing) or not os.access(existing, os.W_OK | os.X_OK):
            what = "is not a directory" if not os.path.isdir(existing) else "is not writable"
            raise ValueError(
                f"`offload_path={path!r}` cannot hold the offloaded files: {existing!r} {what}. Choose a "
                "writable local directory (one per rank, or shared: the file names do not collide)."
            )

    def _check_secondary(self) -> None:
        """hpZ needs stage 3 and plain sharding over the world (see [Note: hpZ, the secondary partition])."""
        size = self.secondary_shard_group_size
        if size is None:
            return
        _check_positive_int("secondary_shard_group_size", size, "ranks")
        if self.stage != 3:
            raise ValueError(
                f"`secondary_shard_group_size` (hpZ) keeps a secondary copy of stage 3's gathered "
                f"parameters, but stage {self.stage} keeps full parameters on every rank and gathers "
                "nothing in backward. Use `stage=3` (`strategy='zero3'`) with it, or leave it out."
            )
        if self.shard_group_size is not None:
            raise ValueError(
                "`secondary_shard_group_size` (hpZ) and `shard_group_size` (hybrid sharding) cannot be "
                "combined: hybrid sharding already keeps every stage 3 all-gather inside the shard group, "
                "so hpZ would only add a copy. Use one of them."
            )
        if self.tensor_parallel_size > 1:
            raise ValueError(
                "`secondary_shard_group_size` (hpZ) is not supported with `tensor_parallel_size > 1`: "
                "ZeRO shards over the data dimension, whose ranks are `tensor_parallel_size` apart (not "
                "inside one node), so an in-node secondary group does not exist there. Leave it out."
            )
        if self.offload_params:
            raise ValueError(
                "`secondary_shard_group_size` (hpZ) keeps 1/s of every gathered unit on the device "
                "until backward, which `offload_params=True` is set to avoid. Use one of them."
            )

    def _check_quantized(self) -> None:
        """qwZ needs stage 3, qgZ stage 2 or 3; neither runs with hybrid sharding or tensor parallelism yet."""
        for name in ("quantized_weights", "quantized_gradients"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"`{name}` must be a bool, got {getattr(self, name)!r}.")
        _check_positive_int("quantization_block_size", self.quantization_block_size, "elements")
        if self.quantized_weights and self.stage != 3:
            raise ValueError(
                f"`quantized_weights=True` (qwZ) quantizes stage 3's all-gathers of weights, but stage "
                f"{self.stage} gathers none for compute (every rank holds full weights). Use `stage=3` "
                "(`strategy='zero3'`) with it, or leave it out."
            )
        if self.quantized_gradients and self.stage == 1:
            raise ValueError(
                "`quantized_gradients=True` (qgZ) quantizes the gradient reduction of stages 2 and 3; "
                "stage 1 reduces once per step into full gradients. Use `stage=2` or `stage=3` with it."
            )
        used = [n for n in ("quantized_weights", "quantized_gradients") if getattr(self, n)]
        if used and self.shard_group_size is not None:
            raise ValueError(
                f"`{used[0]}` is not supported with hybrid sharding (`shard_group_size`) yet: its "
                "replica all-reduce of each reduced chunk is not quantized and the pairing is not "
                "tested. Leave one of them out."
            )
        if used and self.tensor_parallel_size > 1:
            raise ValueError(
                f"`{used[0]}` is not supported with `tensor_parallel_size > 1` yet: the module's own "
                "tensor-parallel collectives are not quantized and the pairing is not tested. Leave one "
                "of them out."
            )

    def bucket_elements(self, numel: int) -> int:
        """Elements per bucket for an optimizer of ``numel`` parameters (``reduce_bucket_size`` or the default)."""
        size = elements(self.reduce_bucket_size)
        return size if size is not None else auto_bucket_elements(numel)

    def _check_activations(self) -> None:
        blocks = self.activation_checkpointing
        if not isinstance(blocks, bool):
            if isinstance(blocks, (str, type)) or not all(isinstance(c, (str, type)) for c in blocks):
                raise TypeError(
                    "`activation_checkpointing` must be True/False or a list of block classes or class "
                    f"names, got {blocks!r}."
                )
            object.__setattr__(self, "activation_checkpointing", tuple(blocks))
        for name in ("activation_offload", "contiguous_checkpoints"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"`{name}` must be a bool, got {getattr(self, name)!r}.")
        object.__setattr__(self, "activation_partition_group", _check_group(self.activation_partition_group))
        needs = [
            n
            for n in ("activation_offload", "activation_partition_group", "contiguous_checkpoints")
            if getattr(self, n) not in (None, False)
        ]
        if needs and not self.activation_checkpointing:
            raise ValueError(
                f"`{needs[0]}` acts on checkpointed activations: also set `activation_checkpointing=True` "
                "(or a list of block classes)."
            )

    def _warn_ignored(self) -> None:
        """Warn about stage 3 options set at stage 1 or 2, where nothing reads them."""
        if self.stage == 3:
            return
        ignored = [
            name
            for name, default in STAGE3_DEFAULTS.items()
            if getattr(self, name) != default and not (name == "unit_classes" and self.activation_checkpointing is True)
        ]
        if ignored and launch_rank() == 0:  # every rank builds the strategy: one warning, not one per rank
            warnings.warn(
                f"{', '.join(f'`{n}`' for n in ignored)} only act{'s' if len(ignored) == 1 else ''} at "
                f"stage 3 and {'is' if len(ignored) == 1 else 'are'} ignored at stage {self.stage}. Use "
                "`stage=3` (`strategy='zero3'`) for them, or leave them out.",
                UserWarning,
                stacklevel=caller_stacklevel(),
            )


def check_option_names(options: dict[str, Any]) -> None:
    """Refuse options :class:`ZeroConfig` does not have, naming the ones it has (before the dataclass's bare error)."""
    known = [f.name for f in fields(ZeroConfig)]
    unknown = sorted(set(options) - set(known))
    if unknown:
        close = {name: get_close_matches(name, known, n=1) for name in unknown}
        hints = "; ".join(f"`{name}`: did you mean `{match[0]}`?" for name, match in close.items() if match)
        raise TypeError(
            f"Unknown ZeRO option{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))}"
            f"{' (' + hints + ')' if hints else ''}. The options are: {', '.join(known)} (see "
            "lightning_zero.ZeroConfig)."
        )


def _check_stage(stage: object) -> None:
    if isinstance(stage, bool) or not isinstance(stage, int):
        raise TypeError(f"`stage` must be an int (1, 2 or 3), got {stage!r}.")
    if stage not in SUPPORTED_STAGES:
        raise ValueError(
            f"ZeRO has no stage {stage}. Pick one of {list(SUPPORTED_STAGES)} ("
            + ", ".join(f"{p.stage}: {p.partitions}" for p in all_policies())
            + "), e.g. `ZeroStrategy(stage=2)` or `strategy='zero2'`."
        )


@overload
def elements(value: Elements) -> int: ...
@overload
def elements(value: Optional[Elements]) -> Optional[int]: ...
def elements(value: Optional[Elements]) -> Optional[int]:
    """An option of :data:`ELEMENT_OPTIONS` read from a :class:`ZeroConfig`, typed as the int ``__post_init__`` made
    it (``1e6`` from YAML is ``1000000``; see :func:`_whole_number`)."""
    return None if value is None else int(value)


def _whole_number(name: str, value: Any) -> Any:
    """A float with a whole value (``1e6`` from YAML) as an int; anything else as it is, for the checks after."""
    if isinstance(value, float) and not isinstance(value, bool):
        if not value.is_integer():
            raise ValueError(f"`{name}` must be a whole number of elements, got {value!r}.")
        return int(value)
    return value


def _check_positive_int(name: str, value: object, unit: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"`{name}` must be a positive int (a number of {unit}), got {value!r}.")
    if value <= 0:
        raise ValueError(f"`{name}` must be a positive number of {unit}, got {value}.")


def _check_group(spec: object) -> Any:
    """``None``, a callable, a list of distinct global ranks, or a list of disjoint such lists (as tuples)."""
    if spec is None or callable(spec):
        return spec
    error = TypeError(
        "`activation_partition_group` must be a list of global ranks (e.g. [0, 1]), a list of such "
        f"lists (e.g. [[0, 1], [2, 3]]) or a callable returning a process group, got {spec!r}."
    )
    if isinstance(spec, (str, bytes)) or not hasattr(spec, "__iter__"):
        raise error
    items = list(spec)
    flat = all(isinstance(r, int) and not isinstance(r, bool) for r in items)
    lists = [items] if flat else [list(r) if hasattr(r, "__iter__") and not isinstance(r, str) else [] for r in items]
    if not lists or any(
        not r or not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in r) for r in lists
    ):
        raise error
    ranks = [x for r in lists for x in r]
    if len(ranks) != len(set(ranks)):
        raise ValueError(
            f"`activation_partition_group`: a rank appears twice in {spec!r}; the groups must be disjoint."
        )
    return tuple(lists[0]) if flat else tuple(tuple(r) for r in lists)
