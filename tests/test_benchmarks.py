"""``python -m benchmarks.compare`` end to end in its smallest form: two strategies, the tiny GPT, two ranks, a few
steps."""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

import pytest

from benchmarks._report import markdown, summarize
from lightning_zero.testing.zygote import ZYGOTE

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.timeout(240)
def test_compare_writes_the_table_and_the_json(tmp_path):
    cmd = [sys.executable, "-m", "benchmarks.compare", "--world-sizes", "2", "--sizes", "tiny",
           "--strategies", "ddp", "zero2", "--steps", "3", "--warmup", "1", "--repeats", "1", "--timeout", "180",
           "--out", str(tmp_path)]
    out, err = tmp_path / "stdout.txt", tmp_path / "stderr.txt"
    env = dict(os.environ, PYTHONPATH=str(ROOT))  # run from anywhere: `-m benchmarks.compare` needs the root
    done = ZYGOTE.spawn(cmd[1:], env, tmp_path, out, err, session=True)  # its workers: fresh processes
    try:
        code = done.wait(timeout=230)
    finally:
        if done.poll() is None:
            os.killpg(done.pid, 9)
    assert code == 0, out.read_text()[-3000:] + err.read_text()[-3000:]
    table = (tmp_path / "compare.md").read_text()
    assert "| ddp |" in table and "| zero2 |" in table and "vs ddp" in table
    rows = {r["strategy"]: r for r in json.loads((tmp_path / "compare.json").read_text())["rows"]}
    for name in ("ddp", "zero2"):
        row = rows[name]
        assert "error" not in row, row
        assert row["world_size"] == 2 and row["step_median"] > 0 and row["peak_memory"] > 0
        assert row["model_states"] > 0 and row["comm_total"] > 0, row  # ddp's all-reduce is counted too
    zero2, ddp = rows["zero2"], rows["ddp"]
    for key in ("step_median", "peak_memory", "model_states", "comm_total"):  # ratios of the measured numbers
        assert zero2[f"{key}_vs_ddp"] == pytest.approx(zero2[key] / ddp[key]), key
    assert zero2["model_states_vs_ddp"] < 1.0  # gradients and optimizer states are sharded
    assert _table_cells(table, "zero2")[3] == f"{zero2['step_median_vs_ddp']:.2f}"  # the table's step "vs ddp"


def _table_cells(table: str, strategy: str) -> list[str]:
    """The cells of ``strategy``'s row in a markdown table of :func:`benchmarks._report.markdown`."""
    row = next(line for line in table.splitlines() if line.startswith(f"| {strategy} |"))
    return [cell.strip() for cell in row.strip("|").split("|")]


def _record(strategy: str, step_times: list[float], peak: int, states: int, comm: int) -> dict:
    """One repeat's record as ``benchmarks/_worker.py`` returns it (only the fields the report reads)."""
    return {"world_size": 2, "size_name": "tiny", "strategy": strategy, "params": 1_000_000, "step_times": step_times,
            "peak_memory": peak, "peak_growth": peak // 2, "model_states": states, "comm_bytes": {"all_reduce": comm},
            "comm_calls": {"all_reduce": 3}, "loss": 1.0}


def test_report_ratios_and_table_come_from_the_records():
    # hand-made records: ddp's median step 0.2 s, zero2's 0.3 s over two repeats (medians 0.1 and 0.3 s)
    rows = {r["strategy"]: r for r in summarize([_record("ddp", [0.2, 0.2, 0.2], 800, 400, 64),
                                                 _record("zero2", [0.1, 0.1, 0.3], 600, 100, 64),
                                                 _record("zero2", [0.3, 0.3, 0.3], 700, 100, 64)])}
    zero2 = rows["zero2"]
    assert zero2["repeats"] == 2 and zero2["step_median"] == 0.3
    assert (zero2["step_min"], zero2["step_max"]) == (0.1, 0.3)
    assert zero2["step_median_vs_ddp"] == pytest.approx(1.5) and zero2["peak_memory_vs_ddp"] == pytest.approx(0.875)
    assert zero2["model_states_vs_ddp"] == pytest.approx(0.25) and zero2["comm_total_vs_ddp"] == pytest.approx(1.0)
    cells = _table_cells(markdown(list(rows.values()), "test"), "zero2")
    assert cells[1:4] == ["300.0", "100.0–300.0", "1.50"] and cells[8] == "0.25"


def test_speed_table_shows_the_best_step_and_each_repeats_ratio():
    """The speed table's "per repeat" pairs each repeat's median with DDP's of the same repeat, and "best step" divides
    the fastest steps: a slow repeat of the machine moves neither."""
    from benchmarks.speed_table import table
    records = [{**_record("ddp", [0.2, 0.3, 0.2], 8, 4, 1), "repeat": 0},
               {**_record("zero1", [0.18, 0.2, 0.19], 6, 1, 1), "repeat": 0},
               {**_record("ddp", [0.4, 0.4, 0.5], 8, 4, 1), "repeat": 1},  # a slow phase of the machine
               {**_record("zero1", [0.44, 0.42, 0.5], 6, 1, 1), "repeat": 1}]
    rows = {r["strategy"]: r for r in summarize(records)}
    zero1 = rows["zero1"]
    assert zero1["step_best_vs_ddp"] == pytest.approx(0.18 / 0.2)
    assert (zero1["repeat_ratio_min"], zero1["repeat_ratio_max"]) == (pytest.approx(0.95), pytest.approx(1.1))
    line = next(x for x in table(list(rows.values())).splitlines() if "| zero1 |" in x)
    cells = [c.strip() for c in line.strip("|").split("|")]
    assert cells[5:7] == ["0.95–1.10", "0.90"]


def test_check_speed_pairs_each_repeat_with_ddps():
    """The ratio repeat by repeat divides by DDP's median of the same repeat, not by DDP's pooled median."""
    from benchmarks.check_speed import medians, paired_ratios
    records = [{**_record("ddp", [0.2, 0.2, 0.2], 1, 1, 1), "repeat": 0},
               {**_record("zero3", [0.3, 0.3, 0.3], 1, 1, 1), "repeat": 0},
               {**_record("ddp", [0.4, 0.4, 0.4], 1, 1, 1), "repeat": 1},  # a slow phase of the machine
               {**_record("zero3", [0.4, 0.4, 0.4], 1, 1, 1), "repeat": 1}]
    assert paired_ratios(records, "wall") == {"ddp": [1.0, 1.0], "zero3": [pytest.approx(1.5), 1.0]}
    pooled = medians(records, "wall")
    assert pooled["zero3"]["step"] / pooled["ddp"]["step"] == pytest.approx(0.35 / 0.3)


@pytest.mark.timeout(300)
def test_zeropp_loss_writes_every_mode(tmp_path):
    """``python -m benchmarks.zeropp_loss`` in its smallest form: two steps of each mode, the quantized ones send
    fewer bytes than the exact run."""
    summary = tmp_path / "zeropp.json"
    cmd = [sys.executable, "-m", "benchmarks.zeropp_loss", "--steps", "2", "--val-batches", "1", "--timeout", "240",
           "--out", str(summary)]
    out, err = tmp_path / "stdout.txt", tmp_path / "stderr.txt"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    done = ZYGOTE.spawn(cmd[1:], env, tmp_path, out, err, session=True)
    try:
        code = done.wait(timeout=290)
    finally:
        if done.poll() is None:
            os.killpg(done.pid, 9)
    assert code == 0, out.read_text()[-3000:] + err.read_text()[-3000:]
    modes = json.loads(summary.read_text())
    assert set(modes) == {"exact", "qwz", "qgz", "qwz+qgz"}
    exact = modes["exact"]["bytes_per_step"]
    assert modes["qwz"]["bytes_per_step"]["all_gather"] < exact["all_gather"] / 2
    assert modes["qgz"]["bytes_per_step"]["all_to_all"] < exact["reduce_scatter"] / 2
    assert modes["exact"]["max_step_rel_diff"] == 0


def test_check_speed_gives_compare_every_option_it_reads():
    """``benchmarks.check_speed`` hands ``compare`` a command line of its own: every ``args.X`` that ``compare.py``
    reads must be in it (an option added to ``compare`` once broke the check with an ``AttributeError``)."""
    from benchmarks.check_speed import _arguments, _compare_args

    read = set(re.findall(r"\bargs\.(\w+)", (ROOT / "benchmarks" / "compare.py").read_text()))
    given = vars(_compare_args(_arguments(["--repeats", "3"])))
    assert read and not read - set(given), sorted(read - set(given))
    assert given["world_sizes"] == [2] and given["clip"] == 1.0 and given["repeats"] == 3


def test_the_results_pages_are_what_the_committed_records_render():
    # benchmarks/RESULTS.md and docs/results.md are generated: a figure is changed in its record, never on the page
    from benchmarks import results

    for path, text in results.pages(results.load_records()).items():
        assert path.read_text(encoding="utf-8") == text, (
            f"{path.relative_to(ROOT)} is not what benchmarks/records/ renders; fix: edit the record and run "
            "`python -m benchmarks.results`")


def test_every_record_has_its_header_and_tables_whose_rows_fit_their_columns():
    from benchmarks import results

    records = results.load_records()
    assert len({r["id"] for r in records}) == len(records) >= 10
    assert {"speed", "memory"} <= {r["id"] for r in records}  # what the plots are drawn from
    for record in records:
        path = results.RECORDS / f"{record['id']}.json"
        assert path.exists(), f"record {record['id']!r} is not in a file of its name"
        assert path.read_text(encoding="utf-8") == results.dumps_record(record), f"{path.name}: rewrite it"
        assert record["kind"] in ("current", "evidence") and all(record["header"][k] for k in results.HEADER_KEYS)
        for part in record["parts"]:
            table = part.get("table")
            if table:
                assert all(len(row) == len(table["columns"]) for row in table["rows"]), record["id"]
                assert set(table.get("formats", {})) <= set(table["columns"]), record["id"]


def test_a_table_cell_is_formatted_by_its_column():
    from benchmarks.results import render_table

    table = {"columns": ["strategy", "step (ms)", "per repeat"],
             "formats": {"step (ms)": "{:,.0f}", "per repeat": "{:.2f}"},
             "rows": [["ddp", 1163, [1.0, 1.0]], ["zero3", None, [0.91, 0.96]]]}
    assert render_table(table)[2:] == ["| ddp | 1,163 | 1.00–1.00 |", "| zero3 | – | 0.91–0.96 |"]


def test_the_plots_are_drawn_from_the_records(tmp_path):
    pytest.importorskip("matplotlib")
    from benchmarks import results

    written = results.plot(results.load_records(), tmp_path)
    assert sorted(p.name for p in written) == sorted(results.PLOTS)
    for path in written:
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert (results.IMAGES / path.name).exists(), f"docs/images/{path.name} is not committed"


def test_the_changelog_is_keep_a_changelog_and_names_only_files_that_exist():
    # the release documents: one [Unreleased] section in Keep a Changelog's groups, and no path that has moved away
    text = (ROOT / "CHANGELOG.md").read_text(encoding="utf-8")
    assert "https://keepachangelog.com/en/1.1.0/" in text and "## [Unreleased]" in text
    groups = re.findall(r"^### (\w+)", text, flags=re.MULTILINE)
    assert groups == [g for g in ("Added", "Changed", "Deprecated", "Removed", "Fixed", "Security") if g in groups]
    paths = re.findall(r"`([\w.-]+(?:/[\w.*-]*)+|[\w-]+\.(?:py|md|ya?ml|json|toml))`", text)
    assert paths
    missing = [p for p in paths if not any((base / p.rstrip("*")).exists() for base in (ROOT, ROOT / "lightning_zero"))]
    assert not missing, f"CHANGELOG.md names paths that do not exist: {missing}"


def test_speed_table_writes_a_record_the_results_page_renders():
    from benchmarks import results
    from benchmarks.speed_table import record

    records = [{**_record("ddp", [0.2, 0.3, 0.2], 8, 4, 1), "repeat": 0},
               {**_record("zero1", [0.18, 0.2, 0.19], 6, 1, 1), "repeat": 0},
               {**_record("ddp", [0.4, 0.4, 0.5], 8, 4, 1), "repeat": 1},
               {**_record("zero1", [0.44, 0.42, 0.5], 6, 1, 1), "repeat": 1}]
    header = dict.fromkeys(results.HEADER_KEYS, "as given")
    made = json.loads(results.dumps_record(record(summarize(records), records, header)))
    assert all(made["header"][key] for key in results.HEADER_KEYS) and len(made["raw"]) == 4
    lines = results.render_record(made, 2)
    zero1 = next(x for x in lines if x.startswith("| 2 | tiny | 1.0 | zero1 |"))
    assert zero1.split(" | ")[6:8] == ["0.95–1.10", "0.90"]
