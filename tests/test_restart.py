"""A torchrun restart under torch's defaults: rank 1 of a zero3 run is killed (SIGKILL) at a chosen step,
``torchrun --max-restarts 1`` starts both ranks again, they resume from the last checkpoint and train exactly as an
uninterrupted run does; every process group of the package has the default group's timeout; a failure to make a
group in a restarted attempt names the remedy.

The restart keeps torchrun's default rendezvous store, shared with the workers and kept across attempts (see
[Note: a restarted torchrun attempt] in ``lightning_zero/comm/collectives.py``).
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import pytest

from lightning_zero.comm import collectives
from lightning_zero.testing.launch import ROOT, run_in_own_session, start, wait_all
from tests.workers.restart import STEPS, TIMEOUT

KILL_AT = 6  # rank 1 dies at the start of epoch 6 (step 7), after the checkpoint of step 6
RUN_TIMEOUT = 240  # a safety net for each run, start-up included: what is tested is how it ends


def _env() -> dict[str, str]:
    launcher = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK", "TORCH_DISABLE_SHARE")
    env = {k: v for k, v in os.environ.items() if not k.startswith(launcher) and not k.startswith("TORCHELASTIC")}
    return dict(env, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))


def _losses(out: Path, rank: int) -> list[dict]:
    path = out / f"losses-rank{rank}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """The uninterrupted run (2 ranks, no torchrun) and the torchrun run with one restart."""
    plain, restarted = tmp_path_factory.mktemp("plain"), tmp_path_factory.mktemp("restarted")
    codes = wait_all(start("restart.py", 2, plain, ("0",)), RUN_TIMEOUT)
    assert codes == [0, 0], f"the uninterrupted run failed: {codes}"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "--max-restarts",
           "1", str(ROOT / "tests" / "workers" / "restart.py"), str(restarted), str(KILL_AT)]
    try:
        code = run_in_own_session(cmd, _env(), restarted, restarted / "torchrun.log", RUN_TIMEOUT)
    finally:
        _end_workers(restarted)
    assert code == 0, (restarted / "torchrun.log").read_text()[-6000:]
    return {"plain": plain, "restarted": restarted}


def _end_workers(out: Path) -> None:
    """SIGKILL every worker of the run still alive: torchrun starts them in sessions of their own, which the end of
    its own session does not reach (each worker left its id in ``out``)."""
    for marker in out.glob("pid-*"):
        pid = int(marker.name[4:])
        try:
            if b"restart.py" in Path(f"/proc/{pid}/cmdline").read_bytes():
                os.kill(pid, signal.SIGKILL)
        except (FileNotFoundError, ProcessLookupError):
            pass


@pytest.mark.timeout(2 * RUN_TIMEOUT + 60)
def test_a_rank_killed_under_torchrun_restarts_and_resumes_as_the_uninterrupted_run(runs):
    for rank in range(2):
        plain, restarted = _losses(runs["plain"], rank), _losses(runs["restarted"], rank)
        assert [r["step"] for r in plain] == list(range(1, STEPS + 1)), plain
        first = [r for r in restarted if r["attempt"] == 0]
        second = [r for r in restarted if r["attempt"] == 1]
        assert [r["step"] for r in first] == list(range(1, KILL_AT + 1)), restarted  # killed where chosen
        assert [r["step"] for r in second] == list(range(KILL_AT + 1, STEPS + 1)), restarted  # resumed after it
        assert [r["loss"] for r in first + second] == [r["loss"] for r in plain]  # bit for bit


@pytest.mark.timeout(2 * RUN_TIMEOUT + 60)
def test_every_process_group_has_the_default_groups_timeout(runs):
    files = sorted(runs["restarted"].glob("timeouts-rank*-attempt*.json"))
    assert len(files) == 4, files  # 2 ranks x 2 attempts
    for file in files:
        timeouts = json.loads(file.read_text())
        assert len(timeouts) >= 2, timeouts  # the default group and stage 3's lockstep group at least
        assert set(timeouts.values()) == {TIMEOUT}, (file.name, timeouts)


def test_a_failure_to_make_a_group_in_a_restarted_attempt_names_the_remedy(monkeypatch):
    def fail() -> None:
        with collectives.restart_hint("a process group"):
            raise RuntimeError("Gloo connectFullMesh failed with ...\n timed out connecting: Connection refused")

    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    with pytest.raises(RuntimeError, match="^Gloo connectFullMesh"):  # a first attempt: the error as it is
        fail()
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    with pytest.raises(RuntimeError) as error:
        fail()
    message = str(error.value)
    assert "\n" not in message and "Connection refused" in message and "restarted attempt 1" in message
    assert "previous attempt's addresses" in message and "`TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`" in message
