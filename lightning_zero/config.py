"""Typed, validated options of the engine, defined once: ``ZeroConfig``. ``ZeroStrategy``,
``ZeroFabricStrategy`` and ``ZeroEngine`` take them as keyword arguments and hand them here.

Every option is checked when the strategy is constructed, so a bad value fails before any process is launched.
"""

from __future__ import annotations

import math
import os
import warnings
from dataclasses import dataclass, fields
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

#: Options that only stage 3 reads (``unit_classes`` also picks the blocks of ``activation_checkpointing=True`` at
#: every stage): set to anything but their defaults below stage 3 they give a warning.
STAGE3_OPTIONS = ("unit_classes", "persistence_threshold", "prefetch_size")

#: A number of elements: an int, or a float with a whole value as YAML gives ``1e6`` (taken as the int 1000000).
Elements = Union[int, float]
#: The options that are numbers of elements (see ``Elements``).
ELEMENT_OPTIONS = ("reduce_bucket_size", "persistence_threshold", "prefetch_size", "host_mmap_threshold")


@dataclass(frozen=True)
class ZeroConfig:
    """The options of the ZeRO engine, each documented once, here.

    ``ZeroStrategy``, ``ZeroFabricStrategy`` and ``ZeroEngine`` take them as keyword arguments by the same names;
    LightningCLI reads their types from here, and docs/options.md and the README's table are generated from these
    field docs (``python docs/_generate_options.py``), grouped as ``OPTION_GROUPS`` says. The first paragraph of
    each field's doc is its line in the README's table.
    """

    stage: int = 2
    """Which model states are partitioned: 1 optimizer states (and fp32 master weights), 2 also gradients, 3 also
    parameters.

    A stage chosen at setup from a memory budget: ``ZeroAutoStrategy(memory_budget=...)``
    (``strategy="zero_auto"``, [zero_auto](zero_auto.md))."""
    reduce_bucket_size: Optional[Elements] = None
    """Elements per gradient bucket; ``None``: ``clamp(Ψ / 32, 1M, 4M)`` for an optimizer of Ψ parameters.

    Each full gradient bucket is reduce-scattered, and the updated shards are all-gathered bucket by bucket after
    the step. The default is 1M elements up to 32M parameters and 4M from 128M on (see [Note: the default bucket
    size] in ``shards/policy.py``)."""
    overlap_comm: bool = True
    """Stage 2: reduce each bucket asynchronously while backward continues.

    Each bucket's reduce-scatter is launched as soon as the bucket is full; under hybrid sharding
    (``shard_group_size``) each reduced chunk's all-reduce across the replicas is asynchronous too, waited for only
    when its buffer is needed again (see [Note: the replica all-reduce overlaps] in ``buckets.py``)."""
    lockstep_check: Union[bool, Literal["strict"]] = True
    """Stage 3: ranks whose control flow differs fail together within one unit, naming it.

    Before each unit's forward and backward, every rank says which unit it is about to run (one small CPU message
    per unit and pass, waited for at the next unit, while prefetches come only from units every rank has seen
    agree), so a divergence fails within one unit instead of at the process group's timeout (see [Note: the
    lockstep check] in ``stage3/lockstep.py``). ``"strict"``: each unit waits for every rank before it runs, also
    catching a divergence before a collective of the model's own inside the unit (e.g. ``SyncBatchNorm``), at some
    cost in speed. ``False``: no messages, once the control flow is known to agree across ranks."""
    bucket_buffers: int = 2
    """Bucket-sized buffers that may be in flight at once (memory: this times the bucket size)."""
    partition_whole_params: Optional[bool] = None
    """Give each rank whole tensors instead of flat slices; ``None``: only for optimizers not known to be
    elementwise (Adafactor, LAMB, anything unknown)."""
    elementwise_optimizers: tuple[str, ...] = ()
    """More optimizer class names (``"MyAdam"`` or ``"mypkg.MyAdam"``) whose update is elementwise, so that they may
    be stepped on flat slices."""
    unit_classes: tuple[Union[type, str], ...] = ()
    """Stage 3: module classes (or class names) gathered as one unit.

    ``()``: the children of ``nn.ModuleList`` and ``nn.Sequential`` (the repeated blocks) and every other module
    with parameters. A listed class is a unit whatever its size. At every stage, these are also the blocks
    ``activation_checkpointing=True`` recomputes."""
    persistence_threshold: Optional[Elements] = None
    """Stage 3: units with at most this many elements join the root unit, gathered once per step.

    ``None``: 100,000 elements for every model, except the blocks named in ``unit_classes``, which stay units (see
    [Stage 3](stages.md#stage-3) and [Note: one algorithm at every size] in ``stage3/plan.py``)."""
    prefetch_size: Elements = 5_000_000
    """Stage 3: elements of the next units that may be all-gathered ahead of their use (0 turns prefetch off)."""
    host_mmap_threshold: Optional[Elements] = None
    """CPU runs on glibc, an escape hatch: fix glibc's mmap threshold at this many bytes for the whole process.

    Freed tensors above it then leave the process, as ``MALLOC_MMAP_THRESHOLD_`` would make them (a threshold set
    in the environment wins): lower peaks, more page faults and slower steps. ``None`` or 0 (the default): glibc is
    left alone, as DDP has it (see [Note: no allocator setting decides speed or memory] in
    ``memory/host_memory.py``)."""
    state_dict_type: Literal["sharded", "full"] = "sharded"
    """Checkpoints: ``"sharded"``, a directory each rank writes its own pieces to; ``"full"``, one file written by
    rank 0 in the form ``ddp`` writes.

    ``"full"`` is refused with ``tensor_parallel_size > 1``: save sharded checkpoints and make one full file
    afterwards with ``lightning-zero consolidate``."""
    activation_checkpointing: Union[bool, tuple[Union[type, str], ...]] = False
    """Recompute blocks in backward: ``True`` for the repeated blocks (``unit_classes`` if set), or block classes
    (or class names).

    See [ZeRO-R](memory.md#zero-r-activations-and-buffers)."""
    activation_offload: bool = False
    """Pa+cpu: keep the checkpointed block inputs in (pinned) host memory until their recomputation."""
    activation_partition_group: Optional[Union[tuple[int, ...], tuple[tuple[int, ...], ...], Callable[[], Any]]] = None
    """Pa: global ranks holding identical activations, which they then share.

    A list of ranks, a list of disjoint such lists, or a callable returning a process group; ``None``: the tensor
    group under ``tensor_parallel_size``."""
    contiguous_checkpoints: bool = False
    """MD: copy the checkpointed block inputs into one buffer, preallocated after the first step."""
    offload_optimizer: Union[bool, Literal["disk"]] = False
    """ZeRO-Offload: master weights, optimizer states and the step in (pinned) host memory (``True``) or in files
    (``"disk"``).

    ``True``: the device keeps the working parameters and gradients (see [Offloading the
    optimizer](offload.md#offloading-the-optimizer-to-the-cpu-zero-offload) and [Note: what lives where ...] in
    ``offload.py``). ``"disk"`` (ZeRO-Infinity): the master weights and the optimizer states live in files under
    ``offload_path`` and the step runs one bucket-sized window at a time (see [disk
    offload](offload.md#past-host-memory-disk-offload-zero-infinity) and [Note: what lives on disk] in
    ``disk.py``)."""
    offload_params: Union[bool, Literal["disk"]] = False
    """Stage 3 only: the parameter shards in (pinned) host memory (``True``) or in a file (``"disk"``).

    ``True``: units are uploaded as they are gathered (see
    [``offload_params``](offload.md#stage-3-parameters-in-host-memory-offload_params) and [Note: offloaded
    parameter shards] in ``params.py``); ``"disk"``: a file under ``offload_path``, read unit by unit. Below stage 3
    an error, not a warning: ignoring it would keep every parameter on the device."""
    offload_path: Optional[str] = None
    """With a ``"disk"`` offload: the local directory of this rank's files; ``None``: the system's temporary
    directory.

    Made if missing; the files have no name, so nothing is left there on any exit (see [Note: the files have no
    name] in ``disk.py``). An unwritable path or one that is not a directory is refused when the strategy is built;
    a disk without room when the files are made (setup)."""
    shard_group_size: Optional[Union[int, Literal["node"]]] = None
    """Hybrid sharding: shard model states over groups of this many ranks (``"node"``: one node's devices) and
    replicate them across the groups; ``None``: all ranks.

    ``None`` is the paper's N, on any number of nodes (with ``tensor_parallel_size``: the whole data dimension,
    which a size must divide). Must divide the world size (see [Many
    nodes](parallelism.md#many-nodes-hybrid-sharding-shard_group_size) and [Note: hybrid sharding and its traffic]
    in ``groups.py``)."""
    tensor_parallel_size: int = 1
    """Ranks per tensor-parallel group of a (data x tensor) mesh; ZeRO shards over the data dimension.

    ``configure_model`` gets the mesh as ``self.device_mesh`` to parallelize its layers over
    ``"tensor_parallel"``, and ZeRO shards over ``"data_parallel"`` (``shard_group_size`` then splits that
    dimension). Must divide the world size (see [ZeRO with tensor
    parallelism](parallelism.md#zero-with-tensor-parallelism-tensor_parallel_size) and [Note: ZeRO over the data
    dimension] in ``groups.py``)."""
    secondary_shard_group_size: Optional[int] = None
    """Stage 3, ZeRO++'s hpZ: backward's all-gathers stay inside groups of this many consecutive ranks (a node);
    ``None``: off.

    After a unit's forward all-gather, each rank keeps a secondary copy of the unit sharded over its group; the
    model states stay sharded over all ranks (unlike ``shard_group_size``). Costs Ψ/s working-dtype elements per
    rank during backward (see [ZeRO++](parallelism.md#zero-hpz-qwz-qgz) and [Note: hpZ, the secondary partition]
    in ``stage3/secondary.py``); one node, as on a single machine, gains nothing from it. Must divide the world
    size; an error below stage 3 and with hybrid sharding, tensor parallelism or ``offload_params``."""
    quantized_weights: bool = False
    """Stage 3, ZeRO++'s qwZ: the all-gathers of units send int8 codes.

    The all-gathers for forward and backward send blockwise int8 codes and one fp32 scale per
    ``quantization_block_size`` elements, dequantized on arrival; masters, step and checkpoints stay exact (see
    [ZeRO++](parallelism.md#zero-hpz-qwz-qgz) and [Note: qwZ, the quantized all-gather of weights] in
    ``comm/quantize.py``). An error below stage 3, with hybrid sharding and with tensor parallelism."""
    quantized_gradients: bool = False
    """Stages 2 and 3, ZeRO++'s qgZ: the gradients are reduced by an all-to-all of int8 codes.

    Each gradient bucket is reduced by an all-to-all of blockwise int8 codes and scales, dequantized and summed in
    fp32 on the rank that owns the chunk, instead of a reduce-scatter (synchronous: no overlap with backward; see
    [ZeRO++](parallelism.md#zero-hpz-qwz-qgz) and [Note: qgZ, the quantized reduce-scatter of gradients] in
    ``comm/quantize.py``). An error at stage 1, with hybrid sharding and with tensor parallelism."""
    quantization_block_size: int = 256
    """qwZ and qgZ: elements per quantization block, one fp32 scale each (bytes per element: 1 + 4 / block)."""
    shutdown_timeout: Optional[float] = 120.0
    """The Trainer: seconds the ranks may take to act on a SIGTERM or SIGINT before each ends itself; ``None``: no
    bound.

    Each rank then ends (exit code 143 / 130) with a message naming the rank that did not arrive and where it is
    stuck, whatever it is blocked in (see [Stopping a run](stopping.md) and [Note: a SIGTERM is acted on within a
    bound] in ``shutdown.py``). Set it above your longest step and checkpoint write."""
    nonfinite: Optional[Literal["raise", "skip"]] = None
    """What an optimizer step does when the global norm of its gradients is inf or NaN; ``None``: steps anyway, as
    DDP does.

    ``"raise"`` stops every rank, naming the step and the rank; ``"skip"`` skips the update on every rank (counted
    in ``ZeroEngine.skipped_steps`` and the run summary). Reads the norm of ``gradient_clip_val`` when clipping by
    norm; otherwise adds one 4-byte all-reduce per step. Under ``16-mixed`` the loss scaler already skips such
    steps (see [Note: the non-finite guard] in ``engine/engine.py``)."""

    def __post_init__(self) -> None:
        _check_stage(self.stage)
        # [Note: the options are converted once]
        # The dataclass is frozen, and some values arrive in another form than the one the engine reads: ``1e6``
        # from YAML, lists for tuples, a ``PathLike``. ``_converted`` checks those and returns them converted; this
        # loop is the one write after construction. Every other check reads the converted values.
        for name, value in self._converted().items():
            object.__setattr__(self, name, value)
        self._check_sizes()
        self._check_flags()
        self._check_offload()
        self._check_activations()
        self._check_secondary()
        self._check_quantized()
        self._warn_ignored()

    def _converted(self) -> dict[str, Any]:
        """The options whose given form is not the one read (see [Note: the options are converted once])."""
        converted = {name: _whole_number(name, getattr(self, name)) for name in ELEMENT_OPTIONS}
        converted["elementwise_optimizers"] = _tuple_of(
            self.elementwise_optimizers,
            (str,),
            f"`elementwise_optimizers` must be a list of class names, got {self.elementwise_optimizers!r}.",
        )
        converted["unit_classes"] = _tuple_of(
            self.unit_classes,
            (str, type),
            f"`unit_classes` must be a list of module classes or class names, got {self.unit_classes!r}.",
        )
        if not isinstance(self.activation_checkpointing, bool):
            converted["activation_checkpointing"] = _tuple_of(
                self.activation_checkpointing,
                (str, type),
                "`activation_checkpointing` must be True/False or a list of block classes or class names, got "
                f"{self.activation_checkpointing!r}.",
            )
        converted["activation_partition_group"] = _check_group(self.activation_partition_group)
        path = self.offload_path
        if path is not None and not isinstance(path, (str, os.PathLike)):
            raise TypeError(f"`offload_path` must be a directory path, got {path!r}.")
        converted["offload_path"] = None if path is None else os.fspath(path)
        return converted

    def _check_sizes(self) -> None:
        """The options that are numbers: of elements, buffers, ranks and seconds."""
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
        for name in ("persistence_threshold", "prefetch_size", "host_mmap_threshold"):
            value = getattr(self, name)
            if name in ("persistence_threshold", "host_mmap_threshold") and value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"`{name}` must be a number of elements >= 0, got {value!r}.")
        timeout = self.shutdown_timeout
        if timeout is not None and (
            isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout < math.inf
        ):
            raise ValueError(
                f"`shutdown_timeout` must be a positive number of seconds or None (no bound), got {timeout!r}."
            )

    def _check_flags(self) -> None:
        """The options that are one of a few values (bools, names), and the one checkpoint format tensor
        parallelism cannot write."""
        if not isinstance(self.overlap_comm, bool):
            raise TypeError(f"`overlap_comm` must be a bool, got {self.overlap_comm!r}.")
        if not isinstance(self.lockstep_check, bool) and self.lockstep_check != "strict":
            raise TypeError(f"`lockstep_check` must be True, False or 'strict', got {self.lockstep_check!r}.")
        if self.partition_whole_params not in (None, True, False):
            raise TypeError(
                f"`partition_whole_params` must be None, True or False, got {self.partition_whole_params!r}."
            )
        if self.state_dict_type not in ("sharded", "full"):
            raise ValueError(f"`state_dict_type` must be 'sharded' or 'full', got {self.state_dict_type!r}.")
        if self.tensor_parallel_size > 1 and self.state_dict_type == "full":
            raise ValueError(
                "`state_dict_type='full'` writes one file of full tensors on rank 0, which holds only its "
                "own tensor-parallel slices. With `tensor_parallel_size > 1` save sharded checkpoints "
                "(the default) and make one full file afterwards with `lightning-zero consolidate`, which "
                "joins the slices."
            )
        if self.nonfinite not in (None, "raise", "skip"):
            raise ValueError(f"`nonfinite` must be 'raise', 'skip' or None (step anyway), got {self.nonfinite!r}.")

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
        if self.offload_params and self.stage != 3:
            # not a warning like the other stage 3 options: ignoring it would silently keep every parameter on the
            # device, which is what the user set it to avoid
            raise ValueError(
                f"`offload_params={self.offload_params!r}` offloads stage 3's parameter shards, but stage {self.stage} "
                "keeps full parameters on every rank. Use `stage=3` (`strategy='zero3'`) with it, or "
                "`offload_optimizer=True` alone to offload the optimizer at this stage."
            )
        path = self.offload_path
        if path is None:
            return
        if "disk" not in (self.offload_optimizer, self.offload_params):
            raise ValueError(
                f"`offload_path={path!r}` is where `offload_optimizer='disk'` or `offload_params='disk'` "
                "put their files, and neither is set. Set one of them to 'disk', or leave `offload_path` "
                "out."
            )
        existing = os.path.abspath(os.path.expanduser(path))
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
        """The ZeRO-R options: bools, and set only with ``activation_checkpointing``."""
        for name in ("activation_offload", "contiguous_checkpoints"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"`{name}` must be a bool, got {getattr(self, name)!r}.")
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
        defaults = {f.name: f.default for f in fields(self)}
        ignored = [
            name
            for name in STAGE3_OPTIONS
            if getattr(self, name) != defaults[name]
            and not (name == "unit_classes" and self.activation_checkpointing is True)
        ]
        if ignored and launch_rank() == 0:  # every rank builds the strategy: one warning, not one per rank
            warnings.warn(
                f"{', '.join(f'`{n}`' for n in ignored)} only act{'s' if len(ignored) == 1 else ''} at "
                f"stage 3 and {'is' if len(ignored) == 1 else 'are'} ignored at stage {self.stage}. Use "
                "`stage=3` (`strategy='zero3'`) for them, or leave them out.",
                UserWarning,
                stacklevel=caller_stacklevel(),
            )


#: Every option the strategies take, by concern, in the order the docs list them: ``ZeroConfig``'s fields and the
#: strategies' own (``memory_budget``, ``process_group_backend``, ``timeout``, ``start_method``, documented in their
#: signatures). docs/options.md and the README's table are generated in this order (``docs/_generate_options.py``).
OPTION_GROUPS: dict[str, tuple[str, ...]] = {
    "Stages": (
        "stage",
        "memory_budget",
        "reduce_bucket_size",
        "overlap_comm",
        "bucket_buffers",
        "partition_whole_params",
        "elementwise_optimizers",
        "state_dict_type",
        "nonfinite",
    ),
    "Stage 3": ("unit_classes", "persistence_threshold", "prefetch_size", "lockstep_check"),
    "Activations (ZeRO-R)": (
        "activation_checkpointing",
        "activation_offload",
        "activation_partition_group",
        "contiguous_checkpoints",
    ),
    "Offload": ("offload_optimizer", "offload_params", "offload_path"),
    "Parallelism": (
        "shard_group_size",
        "tensor_parallel_size",
        "secondary_shard_group_size",
        "quantized_weights",
        "quantized_gradients",
        "quantization_block_size",
    ),
    "Process": ("process_group_backend", "timeout", "start_method", "shutdown_timeout", "host_mmap_threshold"),
}


def check_option_names(options: dict[str, Any]) -> None:
    """Refuse options ``ZeroConfig`` does not have, naming the ones it has (before the dataclass's bare error)."""
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
    """An option of ``ELEMENT_OPTIONS`` read from a ``ZeroConfig``, typed as the int ``__post_init__`` made
    it (``1e6`` from YAML is ``1000000``; see ``_whole_number``)."""
    return None if value is None else int(value)


def _whole_number(name: str, value: Any) -> Any:
    """A float with a whole value (``1e6`` from YAML) as an int; anything else as it is, for the checks after."""
    if isinstance(value, float) and not isinstance(value, bool):
        if not value.is_integer():
            raise ValueError(f"`{name}` must be a whole number of elements, got {value!r}.")
        return int(value)
    return value


def _tuple_of(value: Any, kinds: tuple[type, ...], error: str) -> tuple[Any, ...]:
    """``value``, a list or tuple of ``kinds`` (not one bare name or class), as a tuple; ``TypeError(error)``
    otherwise."""
    if isinstance(value, (str, type)) or not hasattr(value, "__iter__"):
        raise TypeError(error)
    items = tuple(value)
    if not all(isinstance(item, kinds) for item in items):
        raise TypeError(error)
    return items


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
