"""Model-state memory per rank before running anything: the table in docs/stages.md for a model and a world size.

The figures are ``expected_model_state_bytes``, the same formula the tests hold
the measured bytes (``measure_model_states``) to. Activations, module buffers, the
constant bucket buffers and stage 3's gathered units come on top.
"""

from __future__ import annotations

import difflib
import importlib
import inspect
import math
import re
from typing import TYPE_CHECKING, Any, Optional

import torch
import yaml

from lightning_zero.config import ZeroConfig
from lightning_zero.engine.auto.choice import BudgetTooSmall, ModelFacts, choose
from lightning_zero.engine.auto.facts import model_sizes
from lightning_zero.pretrained import loading as pretrained
from lightning_zero.shards.accounting import (  # noqa: F401  (human_bytes, parse_bytes: the CLI's imports)
    BYTES_PER_PARAM,
    expected_disk_bytes,
    expected_model_state_bytes,
    expected_offload_bytes,
    human_bytes,
    parse_bytes,
)
from lightning_zero.shards.accounting import (
    number as _number,
)
from lightning_zero.stages import all_policies

if TYPE_CHECKING:
    from lightning_zero.lightning.simulated import MeasuredRank

STRATEGIES = {"ddp": 0, **{policy.name: policy.stage for policy in all_policies()}}
#: Columns of the offload tables: ``(stage, offload_params)``, all with ``offload_optimizer=True``.
OFFLOADED = {"zero1": (1, False), "zero2": (2, False), "zero3": (3, False), "zero3+params": (3, True)}
PRECISIONS = tuple(BYTES_PER_PARAM)


def count_parameters(class_path: str, init_args: Optional[dict[str, Any]] = None) -> int:
    """Trainable parameters of ``class_path(**init_args)``, built on the meta device (no memory, no weights)."""
    return sum(p.numel() for p in build_on_meta(class_path, init_args).parameters() if p.requires_grad)


def build_on_meta(class_path: str, init_args: Optional[dict[str, Any]] = None) -> torch.nn.Module:
    """``class_path(**init_args)`` built on the meta device (no memory, no weights).

    ``configure_model`` runs as zero3 runs it: ``load_pretrained`` there checks the names and shapes against the
    files' headers and reads no weights (see [Note: three moments to load pretrained weights] in
    ``pretrained/loading.py``).
    """
    cls = _import_class(class_path)
    try:
        with torch.device("meta"), pretrained.deferring():
            model = cls(**(init_args or {}))
            configure = getattr(model, "configure_model", None)
            if isinstance(model, torch.nn.Module) and callable(configure):
                configure()  # Lightning's default does nothing
    except Exception as error:
        raise ValueError(
            f"Building {class_path}(**{init_args or {}!r}) on the meta device failed: "
            f"{type(error).__name__}: {error}{_signature_hint(cls, error)}"
        ) from error
    if not isinstance(model, torch.nn.Module):
        raise ValueError(f"{class_path} built a {type(model).__name__}, not a torch.nn.Module.")
    return model


def auto_lines(
    num_params: int, world_size: int, memory_bytes: float, module: Optional[torch.nn.Module] = None
) -> list[str]:
    """What ``zero_auto`` would choose for ``memory_bytes`` of device memory per rank, one line per precision,
    without activations (they come from the data at setup: see ``docs/zero_auto.md``). With ``module``: its buffers
    and stage 3's units from its plan; without: Ψ alone (no unit gathered is counted)."""
    config = ZeroConfig(stage=3)
    facts = model_sizes(module, config) if module is not None else ModelFacts(num_params, 0, 0, (), 0)
    lines = [
        "",
        (
            f"`strategy='zero_auto'` with `memory_budget` {both_units(memory_bytes)} per device (activations "
            "not counted: the run measures them on its first micro-batch at setup):"
        ),
        "",
    ]
    for precision in ("32-true", "bf16-mixed"):
        try:
            lines.append(
                f"- {precision}: "
                + choose(facts, world_size, precision, config, memory_bytes, on_host=False).line("would choose")
            )
        except BudgetTooSmall as error:
            lines.append(f"- {precision}: {error}")
    return lines


def _import_class(class_path: str) -> Any:
    """The class (or factory) that ``package.module.ClassName`` names."""
    module_name, _, name = class_path.rpartition(".")
    if not module_name:
        raise ValueError(f"`{class_path}` is not an importable class path; write it as `package.module.ClassName`.")
    try:
        return getattr(importlib.import_module(module_name), name)
    except (ImportError, AttributeError) as error:
        raise ValueError(f"Cannot import {class_path}: {error}") from error


def _signature_hint(cls: Any, error: Exception) -> str:
    """For a ``TypeError`` (an argument the class does not take, or one it needs): the class's arguments."""
    if not isinstance(error, TypeError):
        return ""
    try:
        signature = inspect.signature(cls)
    except (TypeError, ValueError):
        return ""
    hint = f". {getattr(cls, '__name__', cls)} takes {signature}: pass them with `--init-args`"
    unknown = re.search(r"unexpected keyword argument '([^']+)'", str(error))
    if unknown is None:
        return hint + "."
    match = difflib.get_close_matches(unknown.group(1), list(signature.parameters), n=1)
    return hint + (f" (`{unknown.group(1)}`: did you mean `{match[0]}`?)." if match else ".")


def parse_init_args(text: str) -> dict[str, Any]:
    """``--init-args``: a YAML or JSON mapping of the class's init arguments (``'{width: 512, depth: 12}'``)."""
    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError as error:
        raise ValueError(
            f"{text!r} is not YAML or JSON ({str(error).splitlines()[0]}): write a mapping such as "
            "'{width: 512, depth: 12}' (quoted for the shell)."
        ) from None
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ValueError(f"{text!r} is not a mapping of init arguments: write e.g. '{{width: 512, depth: 12}}'.")
    return value


def model_state_table(num_params: int, world_size: int) -> dict[str, dict[str, float]]:
    """``{precision: {strategy: bytes per rank}}``."""
    return {
        precision: {
            name: expected_model_state_bytes(num_params, world_size, stage, precision)
            for name, stage in STRATEGIES.items()
        }
        for precision in PRECISIONS
    }


def offload_table(num_params: int, world_size: int) -> dict[str, dict[str, tuple[float, float]]]:
    """``{precision: {column: (device bytes, host bytes) per rank}}`` with ``offload_optimizer=True``, and for
    ``"zero3+params"`` also ``offload_params=True`` (columns: ``OFFLOADED``)."""
    return {
        precision: {
            name: expected_offload_bytes(num_params, world_size, stage, precision, offload_params=params)
            for name, (stage, params) in OFFLOADED.items()
        }
        for precision in PRECISIONS
    }


def disk_table(num_params: int, world_size: int) -> dict[str, dict[str, tuple[float, float, float]]]:
    """``{precision: {column: (device, host, disk) bytes per rank}}`` with ``offload_optimizer="disk"``, and for
    ``"zero3+params"`` also ``offload_params="disk"`` (columns: ``OFFLOADED``)."""
    return {
        precision: {
            name: expected_disk_bytes(num_params, world_size, stage, precision, offload_params=params)
            for name, (stage, params) in OFFLOADED.items()
        }
        for precision in PRECISIONS
    }


def largest_offloaded_model(memory_bytes: float, world_size: int) -> dict[str, dict[str, Optional[int]]]:
    """``{precision: {column: parameters}}`` whose device model states fit in ``memory_bytes`` per rank with the
    offload of each column of ``OFFLOADED`` (the host is assumed to hold its part). ``None``: no model state
    stays on the device (``zero3+params``), so device memory sets no bound on the model states."""
    table: dict[str, dict[str, Optional[int]]] = {}
    for precision in PRECISIONS:
        row: dict[str, Optional[int]] = {}
        for name, (stage, params) in OFFLOADED.items():
            per_param = expected_offload_bytes(1, world_size, stage, precision, offload_params=params)[0]
            row[name] = int(memory_bytes / per_param) if per_param > 0 else None
        table[precision] = row
    return table


def largest_model(memory_bytes: float, world_size: int) -> dict[str, dict[str, int]]:
    """``{precision: {strategy: parameters}}`` whose model states fit in ``memory_bytes`` per rank."""
    return {
        precision: {
            name: int(memory_bytes / expected_model_state_bytes(1, world_size, stage, precision))
            for name, stage in STRATEGIES.items()
        }
        for precision in PRECISIONS
    }


def parse_count(text: str) -> int:
    """``"1.5e9"``, ``"1.5B"``, ``"350M"``, ``"125k"`` or a plain integer: a positive number of parameters."""
    scale = {"k": 1e3, "m": 1e6, "b": 1e9, "t": 1e12}
    lowered = text.strip().lower().replace("_", "").replace(",", "")
    factor = scale.get(lowered[-1:], 1)
    number = _number(lowered[:-1] if lowered[-1:] in scale else lowered)
    if number is None or math.isinf(number) or int(number * factor) < 1:
        raise ValueError(f"{text!r} is not a positive parameter count: write e.g. 350M, 1.5B, 7e9 or 125000.")
    return int(number * factor)


def human_count(n: float) -> str:
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f}{unit}"
    return f"{n:.0f}"


def decimal_bytes(n: float) -> str:
    """``n`` bytes in the paper's decimal units: B, KB, MB, GB or TB (powers of 1000)."""
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n:.0f} B"


def both_units(n: float) -> str:
    """``n`` bytes in binary and decimal units, ``"15.3 GiB (16.4 GB)"``: the paper's tables count in GB."""
    return f"{human_bytes(n)} ({decimal_bytes(n)})" if abs(n) >= 1000 else human_bytes(n)


#: Working-parameter bytes per element of the precisions stage 3 gathers in (the traffic table's rows).
WORKING_BYTES = {"fp32": 4, "bf16/fp16": 2}


def zeropp_traffic_table(num_params: int, block: int = 256) -> dict[str, dict[str, float]]:
    """Stage 3's collective bytes per rank and micro-batch, as ``strategy.traffic`` counts them (the logical payload:
    a ring moves (N-1)/N of it on the wire), exact and with ZeRO++'s quantized collectives, ignoring the padding of
    buckets and blocks: forward and backward all-gather Ψw each and the gradient reduction Ψw, w the working dtype's
    bytes; qwZ sends ``Ψ(1 + 4/block)`` per all-gather, qgZ ``Ψ(1 + 4/block)`` by all-to-all (see the Notes of
    ``comm/quantize.py``). hpZ moves the backward all-gather into the node group and leaves the bytes as they are."""
    quantized = num_params * (1 + 4 / block)
    table = {}
    for name, w in WORKING_BYTES.items():
        exact = num_params * w
        table[name] = {
            "zero3": 3 * exact,
            "qwZ": 2 * quantized + exact,
            "qgZ": 2 * exact + quantized,
            "qwZ+qgZ": 3 * quantized,
        }
    return table


def format_estimate(
    num_params: int, world_size: int, memory_bytes: Optional[float] = None, module: Optional[torch.nn.Module] = None
) -> str:
    """The markdown tables ``lightning-zero estimate`` prints; with ``memory_bytes`` also ``zero_auto``'s choice
    (see ``auto_lines``)."""
    lines = [
        f"Model states per rank for {num_params:,} trainable parameters on {world_size} "
        f"rank{'s' if world_size != 1 else ''} (Adam; activations, buffers and bucket buffers come on top; "
        "GiB = 2^30 bytes, GB = 10^9 as in the paper):",
        "",
        "| precision | " + " | ".join(STRATEGIES) + " |",
        "|---|" + "---|" * len(STRATEGIES),
    ]
    for precision, row in model_state_table(num_params, world_size).items():
        lines.append(f"| {precision} | " + " | ".join(both_units(b) for b in row.values()) + " |")
    offloaded = list(OFFLOADED)
    lines += [
        "",
        "With `offload_optimizer=True`: device + host bytes per rank (master weights, optimizer states and the "
        "gradient shard on the host; `zero3+params`: also `offload_params=True`, the parameter shard on the "
        "host, which leaves the device only the units in flight and the bucket buffers):",
        "",
        "| precision | " + " | ".join(offloaded) + " |",
        "|---|" + "---|" * len(offloaded),
    ]
    for precision, cells in offload_table(num_params, world_size).items():
        lines.append(
            f"| {precision} | "
            + " | ".join(f"{both_units(d)} + {both_units(h)} host" for d, h in cells.values())
            + " |"
        )
    lines += [
        "",
        "With `offload_optimizer='disk'`: device + host + disk bytes per rank (master weights and optimizer "
        "states in files under `offload_path`, only the step's windows resident; the gradient shard on the "
        "host; `zero3+params`: also `offload_params='disk'`):",
        "",
        "| precision | " + " | ".join(offloaded) + " |",
        "|---|" + "---|" * len(offloaded),
    ]
    for precision, triples in disk_table(num_params, world_size).items():
        lines.append(
            f"| {precision} | "
            + " | ".join(
                f"{both_units(d)} + {both_units(h)} host + {both_units(f)} disk" for d, h, f in triples.values()
            )
            + " |"
        )
    if memory_bytes is not None:
        lines += [
            "",
            f"Largest model whose model states fit in {both_units(memory_bytes)} per rank:",
            "",
            "| precision | " + " | ".join(STRATEGIES) + " | " + " | ".join(f"{n}+offload" for n in offloaded) + " |",
            "|---|" + "---|" * (len(STRATEGIES) + len(offloaded)),
        ]
        on_host = largest_offloaded_model(memory_bytes, world_size)
        for precision, fitting in largest_model(memory_bytes, world_size).items():
            counts = [*fitting.values(), *on_host[precision].values()]
            lines.append(
                f"| {precision} | " + " | ".join("no bound" if n is None else human_count(n) for n in counts) + " |"
            )
        lines.append(
            "(with offload, device memory only: the host holds the rest, see the table above; no bound: no "
            "model state on the device, only the units in flight and the bucket buffers)"
        )
    if memory_bytes is not None:
        lines += auto_lines(num_params, world_size, memory_bytes, module)
    return "\n".join(lines + _zeropp_lines(num_params))


def _zeropp_lines(num_params: int, block: int = 256) -> list[str]:
    """The ZeRO++ section of the estimate: ``zeropp_traffic_table`` as markdown."""
    table = zeropp_traffic_table(num_params, block)
    columns = list(next(iter(table.values())))
    lines = [
        "",
        "Stage 3 collective bytes per rank and micro-batch (the payload `strategy.traffic` counts: forward and "
        f"backward all-gathers plus the gradient reduction; ZeRO++ `quantized_weights` / `quantized_gradients` "
        f"with `quantization_block_size={block}`; hpZ moves the backward all-gather into the node and keeps its "
        "bytes):",
        "",
        "| working dtype | " + " | ".join(columns) + " |",
        "|---|" + "---|" * len(columns),
    ]
    for name, row in table.items():
        lines.append(f"| {name} | " + " | ".join(both_units(b) for b in row.values()) + " |")
    return lines


def expected_by_kind(num_params: int, world_size: int, stage: int, precision: str) -> dict[str, float]:
    """The table in docs/stages.md split by kind (the keys of ``MeasuredRank.model_states``): 16-bit or fp32
    parameters and gradients, fp32 masters (mixed precision only) and the optimizer's two states."""
    param_b, grad_b, opt_b = BYTES_PER_PARAM.get(precision, BYTES_PER_PARAM["32-true"])
    master_b = 4 if precision.endswith("-mixed") else 0
    psi, n = float(num_params), float(world_size)
    return {
        "parameters": param_b * psi / (n if stage >= 3 else 1),
        "gradients": grad_b * psi / (n if stage >= 2 else 1),
        "fp32 masters": master_b * psi / n,
        "optimizer states": (opt_b - master_b) * psi / n,
    }


def measure_model(
    class_path: str,
    init_args: Optional[dict[str, Any]],
    world_size: int,
    **kwargs: Any,
) -> "MeasuredRank":
    """``measure_rank`` of ``class_path(**init_args)`` (a LightningModule with
    its own ``train_dataloader``), built under the Trainer's ``init_module`` as a zero3 run builds it."""
    from lightning_zero.lightning.simulated import (  # the Trainer only when asked for
        check_lightning_module_class,
        measure_rank,
    )

    cls = _import_class(class_path)
    check_lightning_module_class(cls, class_path)

    def build() -> Any:
        return cls(**(init_args or {}))

    return measure_rank(build, world_size, **kwargs)


def _ratio(measured: float, expected: float) -> str:
    return f"{measured / expected:.3f}" if expected else "-"


def format_measured(result: "MeasuredRank") -> str:
    """The markdown ``lightning-zero estimate --measure`` prints: rank 0's measured figures beside the formula."""
    n = result.world_size
    expected = expected_by_kind(result.params, result.shard_size, result.stage, result.precision)
    sharded = f", sharded over {result.shard_size}" if result.shard_size != n else ""
    lines = [
        f"Measured: rank 0 of {n} ranks{sharded} (torch's fake process group), zero{result.stage}, "
        f"{result.precision}, {result.params:,} trainable parameters, after optimizer step {result.steps}; "
        f"{', '.join(result.standing_aside)} stood aside.",
        "",
        "| model states | measured | formula | measured / formula |",
        "|---|---|---|---|",
    ]
    for kind, value in result.model_states.items():
        lines.append(
            f"| {kind} | {both_units(value)} | {both_units(expected[kind])} | {_ratio(value, expected[kind])} |"
        )
    total, formula = result.model_states_bytes, result.expected_model_states_bytes
    lines.append(f"| **total** | {both_units(total)} | {both_units(formula)} | {_ratio(total, formula)} |")
    lines += [
        "",
        f"Peak resident memory above the level after imports: {both_units(result.peak_rss_bytes)} "
        f"(model states + {both_units(result.peak_rss_bytes - total)}). At the highest reading "
        f"({result.peak_at}):",
        "",
        "| part | bytes |",
        "|---|---|",
    ]
    lines += [f"| {part} | {both_units(value)} |" for part, value in result.peak_parts.items()]
    factor = result.expected_traffic_elements // max(1, result.params)
    lines += [
        "",
        f"Elements rank 0 sent in step {result.steps} (all-gather outputs, reduce-scatter inputs, all-reduces "
        f"counted twice), against {factor}Ψ = {result.expected_traffic_elements:,}:",
        "",
        "| collective | elements | calls |",
        "|---|---|---|",
    ]
    for kind, elements in result.traffic_elements.items():
        lines.append(f"| {kind} | {elements:,} | {result.traffic_calls.get(kind, 0):,} |")
    per_step = result.traffic_elements_per_step
    lines.append(f"| **total** | {per_step:,} ({_ratio(per_step, result.expected_traffic_elements)} of {factor}Ψ) | |")
    return "\n".join(lines)
