"""``python -m benchmarks.compare`` end to end in its smallest form: two strategies, the tiny GPT, two ranks, a few
steps."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

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
    assert rows["ddp"]["step_median_vs_ddp"] == 1.0
    assert rows["zero2"]["model_states_vs_ddp"] < 1.0  # gradients and optimizer states are sharded
