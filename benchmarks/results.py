"""The results page from the committed records: ``benchmarks/RESULTS.md``, ``docs/results.md`` and the plots.

    python -m benchmarks.results              # write both pages and docs/images/*.png from benchmarks/records/*.json
    python -m benchmarks.results --no-plots   # the pages only (the plots need matplotlib: pip install -e ".[bench]")
    python -m benchmarks.results --check      # exit 1 if a committed page differs from what the records give

One record (a JSON file in ``benchmarks/records/``) answers one question with its newest run: a ``header`` (the
commit, date, machine, torch, command and repeats of that run), where its numbers came from (``source``), and
``parts``, each an optional ``heading``, paragraphs of ``text``, a ``table`` (``columns``, ``rows``, and per column
an optional ``formats`` entry, a ``str.format`` pattern for its numbers; a list is a range, a ``null`` a cell
that does not apply) and paragraphs ``after`` it. ``order`` places the record on the page and ``kind`` puts it
among the current results (``"current"``) or the measurements behind a default that the package's notes cite by
heading (``"evidence"``: keep those headings, ``tests/test_notes.py`` checks them).

A new run replaces its question's record (the earlier one lives in git history): write the new table into the
record, update its header, run this module and commit the record, the pages and the plots together.
``tests/test_benchmarks.py`` checks that the committed pages are what the records render.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RECORDS = ROOT / "benchmarks" / "records"
PAGE = ROOT / "benchmarks" / "RESULTS.md"
DOCS_PAGE = ROOT / "docs" / "results.md"
IMAGES = ROOT / "docs" / "images"
HEADER_KEYS = ("commit", "date", "machine", "torch", "command", "repeats")
MISSING = "–"
PLOTS = {
    "step_time.png": "Step time against model size at N = 2, beside DDP and FSDP2",
    "peak_memory.png": "Peak memory per rank against N and model size, beside DDP and FSDP2",
}
STRATEGIES = ("ddp", "zero1", "zero2", "zero3", "fsdp2")

Record = dict[str, Any]


def load_records(directory: Path = RECORDS) -> list[Record]:
    """Every record in ``directory``, current ones first, each group in its ``order``."""
    records = [json.loads(path.read_text(encoding="utf-8")) for path in sorted(directory.glob("*.json"))]
    for record in records:
        missing = [key for key in HEADER_KEYS if key not in record["header"]]
        if missing:
            raise ValueError(f"record {record['id']!r} has no {', '.join(missing)} in its header")
    return sorted(records, key=lambda r: (r["kind"] != "current", r["order"]))


def dumps_record(record: Record) -> str:
    """``record`` as the JSON text committed for it: one line per table row, the rest indented."""
    return _dumps(record, 0) + "\n"


def _dumps(value: Any, depth: int) -> str:
    flat = json.dumps(value, ensure_ascii=False)
    if not isinstance(value, (dict, list)) or len(flat) <= 100 or (isinstance(value, list) and _one_line(value)):
        return flat
    pad, inner = " " * depth, " " * (depth + 1)
    if isinstance(value, dict):
        items = [f"{inner}{json.dumps(k, ensure_ascii=False)}: {_dumps(v, depth + 1)}" for k, v in value.items()]
        return "{\n" + ",\n".join(items) + f"\n{pad}}}"
    return "[\n" + ",\n".join(f"{inner}{_dumps(v, depth + 1)}" for v in value) + f"\n{pad}]"


def _one_line(items: list[Any]) -> bool:
    """A table row or a list of column names, not a list of rows or of long paragraphs."""
    short = all(not isinstance(v, str) or len(v) <= 60 for v in items)
    return short and all(not isinstance(v, (dict, list)) or (isinstance(v, list) and len(v) <= 2) for v in items)


def cell(value: Any, fmt: str | None) -> str:
    """One table cell: a number through the column's format, a range as ``low–high``, ``None`` as a dash."""
    if value is None:
        return MISSING
    if isinstance(value, list):
        return "–".join(cell(v, fmt) for v in value)
    if isinstance(value, (int, float)) and fmt:
        return fmt.format(value)
    return str(value)


def render_table(table: dict[str, Any]) -> list[str]:
    """The markdown lines of one record table."""
    columns, formats = table["columns"], table.get("formats", {})
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for row in table["rows"]:
        lines.append("| " + " | ".join(cell(v, formats.get(c)) for c, v in zip(columns, row)) + " |")
    return lines


def render_header(record: Record) -> list[str]:
    """The block under a record's title: where, when and how the run was made, and where its numbers came from."""
    h = record["header"]
    return [
        f"- **Commit** {h['commit']}, **date** {h['date']}, **torch** {h['torch']}",
        f"- **Machine**: {h['machine']}",
        f"- **Command**: `{h['command']}`",
        f"- **Repeats**: {h['repeats']}",
        f"- **Record**: `benchmarks/records/{record['id']}.json`, {record['source']}",
        "",
    ]


def render_record(record: Record, level: int) -> list[str]:
    """A record's section: its title at heading ``level``, the header block, then its parts."""
    lines = ["#" * level + " " + record["title"], "", *render_header(record)]
    for part in record["parts"]:
        if part.get("heading"):
            lines += ["#" * (level + 1) + " " + part["heading"], ""]
        for paragraph in part.get("text", []):
            lines += [paragraph, ""]
        if part.get("table"):
            lines += [*render_table(part["table"]), ""]
        for paragraph in part.get("after", []):
            lines += [paragraph, ""]
    return lines


def render_page(records: Iterable[Record], images: str) -> str:
    """The results page; ``images`` is the path from the page to ``docs/images``."""
    records = list(records)
    lines = [
        "# Measured results",
        "",
        "<!-- Generated by `python -m benchmarks.results` from benchmarks/records/*.json: edit a record, not this "
        "page. -->",
        "",
        "One section per question, each with the newest run that answers it: its commit, date, machine, torch, "
        "command and repeats, and the table it printed. Earlier runs are in the git history of this page and of "
        "`benchmarks/records/`. Each benchmark is a module run from the repository root, `python -m "
        "benchmarks.<question>` (`benchmarks/__init__.py` lists them); the Benchmarks page says how to run them.",
        "",
        *(f"![{alt}]({images}/{name})" for name, alt in PLOTS.items()),
        "",
    ]
    for record in (r for r in records if r["kind"] == "current"):
        lines += render_record(record, 2)
    lines += [
        "## Measurements behind the package's defaults",
        "",
        "The package's notes (`[Note: ...]` blocks) cite these sections by heading for the measurement behind a "
        "default or a design choice.",
        "",
    ]
    for record in (r for r in records if r["kind"] == "evidence"):
        lines += render_record(record, 3)
    return "\n".join(lines).rstrip("\n") + "\n"


def pages(records: list[Record]) -> dict[Path, str]:
    """Both pages: the repository's ``benchmarks/RESULTS.md`` and the site's ``docs/results.md``."""
    return {PAGE: render_page(records, "../docs/images"), DOCS_PAGE: render_page(records, "images")}


def _table(records: list[Record], record_id: str) -> list[dict[str, Any]]:
    """The first table of record ``record_id`` as one dict per row, keyed by column."""
    record = next(r for r in records if r["id"] == record_id)
    table = next(p["table"] for p in record["parts"] if p.get("table"))
    return [dict(zip(table["columns"], row)) for row in table["rows"]]


def plot(records: list[Record], directory: Path = IMAGES) -> list[Path]:
    """Write the PNG plots of ``PLOTS`` under ``directory`` (matplotlib, Agg); the paths written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    directory.mkdir(parents=True, exist_ok=True)
    speed = [row for row in _table(records, "speed") if row["N"] == 2]
    memory = _table(records, "memory")
    written = []

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for strategy in STRATEGIES:
        rows = [r for r in speed if r["strategy"] == strategy]
        sizes = [r["Ψ (M)"] for r in rows]
        left.plot(sizes, [r["step (ms)"] for r in rows], marker="o", label=strategy)
        ratios = [r["step vs ddp"] for r in rows]
        spread = [
            [v - r["per repeat"][0] for v, r in zip(ratios, rows)],
            [r["per repeat"][1] - v for v, r in zip(ratios, rows)],
        ]
        right.errorbar(sizes, ratios, yerr=spread, marker="o", capsize=3, label=strategy)
    left.set(xlabel="parameters (millions)", ylabel="median step (ms)", title="Step time, N = 2")
    right.set(xlabel="parameters (millions)", ylabel="step / DDP's step", title="Against DDP (bars: the repeats)")
    left.legend()
    written.append(_save(fig, directory / "step_time.png"))

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for strategy in STRATEGIES:
        for size, style in ((25.5, "--"), (85.4, "-")):
            rows = [r for r in memory if r["strategy"] == strategy and r["Ψ (M)"] == size]
            left.plot(
                [r["N"] for r in rows],
                [r["whole peak"] for r in rows],
                style,
                marker="o",
                label=f"{strategy}, {size}M",
                color=f"C{STRATEGIES.index(strategy)}",
            )
        rows = [r for r in speed if r["strategy"] == strategy]
        right.plot([r["Ψ (M)"] for r in rows], [r["peak vs ddp"] for r in rows], marker="o", label=strategy)
    left.set(
        xlabel="N (ranks)",
        ylabel="peak per rank above imports (MiB)",
        xticks=[2, 4],
        title="Peak memory per rank (25.5M dashed, 85.4M solid)",
    )
    right.set(xlabel="parameters (millions)", ylabel="peak / DDP's peak", title="Peak against DDP's, N = 2")
    right.legend()
    written.append(_save(fig, directory / "peak_memory.png"))
    return written


def _save(fig: Any, path: Path) -> Path:
    """Save ``fig`` as a PNG without a timestamp or version in its metadata, and close it."""
    fig.tight_layout()
    fig.savefig(path, dpi=80, metadata={"Software": None})
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 if a page differs")
    parser.add_argument("--no-plots", action="store_true", help="write the pages only")
    args = parser.parse_args(argv)
    records = load_records()
    stale = []
    for path, text in pages(records).items():
        if args.check:
            if not path.exists() or path.read_text(encoding="utf-8") != text:
                stale.append(path.relative_to(ROOT).as_posix())
        else:
            path.write_text(text, encoding="utf-8")
    if args.check:
        if stale:
            print(f"out of date: {', '.join(stale)}; run `python -m benchmarks.results`", file=sys.stderr)
        return 1 if stale else 0
    if not args.no_plots:
        for path in plot(records):
            print(f"wrote {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
