"""Turn ``compare.py``'s runs into the report: one summary row per (world size, model size, strategy), markdown tables
with ratios against ``ddp``, a JSON file for machines, and a PNG plot (matplotlib, a benchmark-only extra).

[Note: what one row says]
- step (ms): the median over every measured step of every repeat (after warm-up), where a step's time is the
  slowest rank's; the range is the lowest and highest of the repeats' own medians, so machine noise shows.
- best step: the fastest measured step of any repeat. A shared machine only ever adds time to a step, so the
  fastest step is the estimate of a strategy's own cost least moved by the machine.
- step vs ddp per repeat: each repeat's median against DDP's median in the same repeat (the two ran minutes apart,
  so a slow phase of the machine moves both); the range of those ratios says how far one run can be trusted.
- peak / rank: the highest rank's peak (resident high-water mark on CPU, ``max_memory_allocated`` on GPU), and its
  growth above the level before ``fit`` (imports, interpreter), the part the training adds.
- model states / rank: measured from live tensors after a backward (rank 0).
- faults / step: the median of the slowest rank's minor page faults per measured step (fresh pages the kernel
  mapped: memory freed and made again shows here, whoever made it).
- allocs / step, copied / step: ZeRO only, ``ZeroEngine.step_costs()`` (``lightning_zero/memory/costs.py``): the
  engine's own large allocations per measured step (0 once it owns its memory) and the bytes it copied, in units
  of 4Ψ (one fp32 copy of the model).
- comm / step: bytes of collective payload one rank issued in one measured step (plus the bytes it sent point to
  point, see [Note: one traffic counter for everybody] in ``_probes.py``), also in units of Ψ fp32 words.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any, Optional

MiB = 2**20


def summarize(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (world size, size, strategy) from the per-repeat records (see [Note: what one row says])."""
    groups: dict[tuple[int, str, str], list[dict[str, Any]]] = {}
    for rec in records:
        groups.setdefault((rec["world_size"], rec["size_name"], rec["strategy"]), []).append(rec)
    rows = []
    for (world_size, size_name, strategy), recs in groups.items():
        ok = [r for r in recs if not r.get("error") and not r.get("skipped") and r.get("step_times")]
        row: dict[str, Any] = {"world_size": world_size, "size": size_name, "strategy": strategy,
                               "params": recs[0].get("params"), "repeats": len(ok)}
        if not ok:
            row["error"] = next((r.get("skipped") or r.get("error") for r in recs), "no result")
            rows.append(row)
            continue
        steps = [t for r in ok for t in r["step_times"]]
        medians = [statistics.median(r["step_times"]) for r in ok]
        row.update(step_median=statistics.median(steps), step_min=min(medians), step_max=max(medians),
                   step_best=min(steps),
                   peak_memory=max(r["peak_memory"] for r in ok),
                   peak_growth=max(r["peak_growth"] for r in ok),
                   model_states=ok[-1].get("model_states"), comm_bytes=ok[-1]["comm_bytes"],
                   comm_calls=ok[-1]["comm_calls"], comm_total=sum(ok[-1]["comm_bytes"].values()),
                   loss=ok[-1].get("loss"),
                   faults=statistics.median([f for r in ok for f in r.get("step_faults", [])] or [0]),
                   **_median_costs([c for r in ok for c in r.get("step_costs", [])]))
        rows.append(row)
    _add_ratios(rows, paired_ratios(records))
    return rows


def paired_ratios(records: list[dict[str, Any]], key: str = "step_times") -> dict[tuple[int, str, str], list[float]]:
    """Per (world size, size, strategy): its median step over DDP's median step *of the same repeat*, one ratio per
    repeat (see [Note: what one row says]); ``key`` names the per-step times (``step_times`` wall, ``step_cpu``).
    Records without a ``repeat`` number cannot be paired and are left out."""
    step = {(r["world_size"], r["size_name"], r["strategy"], r["repeat"]): statistics.median(r[key])
            for r in records if r.get(key) and "repeat" in r}
    out: dict[tuple[int, str, str], list[float]] = {}
    for (world_size, size_name, strategy, repeat), median in sorted(step.items()):
        ddp = step.get((world_size, size_name, "ddp", repeat))
        if ddp:
            out.setdefault((world_size, size_name, strategy), []).append(median / ddp)
    return out


def _median_costs(steps: list[dict[str, int]]) -> dict[str, Optional[float]]:
    """The median per step of the engine's large allocations and copied bytes (``None`` without an engine)."""
    if not steps:
        return {"allocations": None, "copied": None}
    return {"allocations": statistics.median(c["large_allocations"] for c in steps),
            "copied": statistics.median(c["copied_bytes"] for c in steps)}


def _add_ratios(rows: list[dict[str, Any]], paired: dict[tuple[int, str, str], list[float]]) -> None:
    base = {(r["world_size"], r["size"]): r for r in rows if r["strategy"] == "ddp" and "error" not in r}
    for row in rows:
        ddp = base.get((row["world_size"], row["size"]))
        if ddp is None or "error" in row:
            continue
        for key in ("step_median", "step_best", "peak_memory", "peak_growth", "model_states", "comm_total", "faults"):
            if row.get(key) is not None and ddp.get(key):
                row[f"{key}_vs_ddp"] = row[key] / ddp[key]
        each = paired.get((row["world_size"], row["size"], row["strategy"]))
        if each:
            row["repeat_ratio_min"], row["repeat_ratio_max"] = min(each), max(each)


def _fmt(value: Optional[float], scale: float = 1.0, digits: int = 1) -> str:
    return "–" if value is None else f"{value / scale:,.{digits}f}"


def _ratio(row: dict[str, Any], key: str) -> str:
    value = row.get(f"{key}_vs_ddp")
    return "–" if value is None else f"{value:.2f}"


def markdown(rows: list[dict[str, Any]], machine: str) -> str:
    """The comparison tables, one per (world size, model size), ratios against ``ddp``."""
    out = [f"Machine: {machine}", ""]
    for world_size, size in sorted({(r["world_size"], r["size"]) for r in rows}, key=lambda k: (k[1], k[0])):
        group = [r for r in rows if (r["world_size"], r["size"]) == (world_size, size)]
        psi = next((r["params"] for r in group if r.get("params")), 0)
        out += [f"### {size} GPT ({psi / 1e6:.1f}M parameters), world size {world_size}", "",
                "| strategy | step (ms) | range of repeats (ms) | vs ddp | peak / rank (MiB) | growth in fit (MiB) | "
                "vs ddp | model states / rank (MiB) | vs ddp | comm / step (MiB) | comm / 4Ψ | collectives / step | "
                "faults / step | vs ddp | allocs / step | copied / 4Ψ |",
                "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in group:
            if "error" in r:
                out.append(f"| {r['strategy']} | skipped: {str(r['error'])[:150]} |" + " |" * 14)
                continue
            comm = r["comm_total"]
            calls = sum(r["comm_calls"].values())
            copied = "–" if r.get("copied") is None or not psi else f"{r['copied'] / (4 * psi):.2f}"
            out.append(
                f"| {r['strategy']} | {_fmt(r['step_median'], 1e-3)} | {_fmt(r['step_min'], 1e-3)}–"
                f"{_fmt(r['step_max'], 1e-3)} | {_ratio(r, 'step_median')} | {_fmt(r['peak_memory'], MiB, 0)} | "
                f"{_fmt(r['peak_growth'], MiB, 0)} | {_ratio(r, 'peak_growth')} | {_fmt(r['model_states'], MiB)} | "
                f"{_ratio(r, 'model_states')} | {_fmt(comm, MiB)} | {comm / (4 * psi) if psi else 0:.2f} | {calls} | "
                f"{_fmt(r.get('faults'), 1, 0)} | {_ratio(r, 'faults')} | {_fmt(r.get('allocations'), 1, 0)} | "
                f"{copied} |")
        out.append("")
    return "\n".join(out)


def scaling_markdown(rows: list[dict[str, Any]]) -> str:
    """Peak growth and model states per rank against the world size, and step time against the model size."""
    sizes = sorted({r["size"] for r in rows})
    worlds = sorted({r["world_size"] for r in rows})
    strategies = list(dict.fromkeys(r["strategy"] for r in rows))
    index = {(r["size"], r["world_size"], r["strategy"]): r for r in rows if "error" not in r}
    out = ["| size | strategy | " + " | ".join(f"N={n}: states / growth (MiB), step (ms)" for n in worlds) + " |",
           "|---|---|" + "---|" * len(worlds)]
    for size in sizes:
        for strategy in strategies:
            cells = []
            for n in worlds:
                r = index.get((size, n, strategy))
                cells.append("–" if r is None else f"{_fmt(r.get('model_states'), MiB, 0)} / "
                             f"{_fmt(r['peak_growth'], MiB, 0)}, {_fmt(r['step_median'], 1e-3, 0)}")
            out.append(f"| {size} | {strategy} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def fit_markdown(fits: list[dict[str, Any]], budget: int, world_size: int, depth: int) -> str:
    """The largest width each strategy trains within ``budget`` bytes per rank, and its Ψ against DDP's."""
    ddp = next((f["params"] for f in fits if f["strategy"] == "ddp" and f["params"]), None)
    out = [f"Budget {budget / MiB:,.0f} MiB per rank (growth of the rank's peak during `fit`), world size "
           f"{world_size}, depth {depth}; largest width found by bisection (multiples of 64).", "",
           "| strategy | largest width | Ψ | Ψ vs ddp | peak growth at that width (MiB) | probes |",
           "|---|---|---|---|---|---|"]
    for f in fits:
        if f.get("error"):
            out.append(f"| {f['strategy']} | skipped: {f['error'][:150]} | | | | |")
            continue
        ratio = f"{f['params'] / ddp:.2f}" if ddp and f["params"] else "–"
        out.append(f"| {f['strategy']} | {f['width']} | {f['params']:,} | {ratio} | "
                   f"{_fmt(f.get('growth'), MiB, 0)} | {f['probes']} |")
    return "\n".join(out)


def plot(rows: list[dict[str, Any]], path: Path) -> Optional[str]:
    """Peak growth per rank against N (one panel per model size) and step time against N; ``None`` or why not."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install matplotlib): no plot"
    sizes = sorted({r["size"] for r in rows})
    fig, axes = plt.subplots(2, len(sizes), figsize=(5.5 * len(sizes), 8), squeeze=False)
    for col, size in enumerate(sizes):
        for strategy in dict.fromkeys(r["strategy"] for r in rows):
            pts = sorted((r["world_size"], r) for r in rows
                         if r["size"] == size and r["strategy"] == strategy and "error" not in r)
            if not pts:
                continue
            ns = [n for n, _ in pts]
            axes[0][col].plot(ns, [r["peak_growth"] / MiB for _, r in pts], marker="o", label=strategy)
            axes[1][col].errorbar(ns, [r["step_median"] * 1e3 for _, r in pts],
                                  yerr=[[(r["step_median"] - r["step_min"]) * 1e3 for _, r in pts],
                                        [(r["step_max"] - r["step_median"]) * 1e3 for _, r in pts]],
                                  marker="o", capsize=3, label=strategy)
        axes[0][col].set(title=f"{size}: peak memory growth per rank", xlabel="world size N", ylabel="MiB")
        axes[1][col].set(title=f"{size}: median step time (range of repeats)", xlabel="world size N", ylabel="ms")
        for ax in (axes[0][col], axes[1][col]):
            ax.set_xticks(sorted({r["world_size"] for r in rows}))
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


def write_json(path: Path, payload: dict[str, Any]) -> None:
    path.write_text(json.dumps(payload, indent=1, default=str))
