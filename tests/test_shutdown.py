"""Ctrl-C and SIGTERM at chosen points: every rank ends soon, cleanly, and the last complete checkpoint is intact.

Each case runs a user's script on 2 CPU ranks (Lightning's launcher starts rank 1 in the same process group) with
``LIGHTNING_ZERO_FAULT`` set, so a fault point delivers the signal at a chosen place (see lightning_zero/process/faults.py):
the outcome never depends on when a timer fired. The signal goes to the whole process group, as Ctrl-C does, so
rank 1 receives it wherever it happens to be; the outcome must be the same wherever that is.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_zero import inspect_checkpoint
from lightning_zero.testing.launch import ROOT, _tail, run_in_own_session, start, wait_all
from lightning_zero.testing.zygote import ZYGOTE

TIMEOUT = 300  # a safety net for the whole run, start-up included: what is tested is how it ends, not when
STALLED_TIMEOUT = 120  # a safety net for a run that ends 2 s after its signal, start-up included
BROKEN = ("Traceback", "Aborted", "core dumped", "Fatal Python error", "terminate called", "mismatch")


def run_with_fault(tmp_path: Path, fault: str, stage: int = 3, state_dict_type: str = "sharded",
                   max_steps: int = 12, extra: tuple[str, ...] = ()) -> tuple[int, str]:
    """Run tests/workers/interrupt.py with ``LIGHTNING_ZERO_FAULT=fault``; returns (exit code, log)."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), LIGHTNING_ZERO_FAULT=fault)
    log = tmp_path / "run.log"
    cmd = [sys.executable, str(ROOT / "tests" / "workers" / "interrupt.py"), str(tmp_path), str(stage),
           state_dict_type, str(max_steps), *extra]
    code = run_in_own_session(cmd, env, tmp_path, log, TIMEOUT)
    text = log.read_text()
    assert "lightning-zero fault" in text, f"the fault point was never reached:\n{text[-4000:]}"
    return code, text


def assert_clean_stop(code: int, text: str, signal_name: str) -> None:
    """Every rank acted on the signal at the same step boundary: exit code 1 (Lightning's interrupted run), the
    agreed message, no failure. A rank that never reached a boundary would end by the shutdown deadline instead
    (exit code 143 and its line), and one that hung past it by the safety net: neither passes."""
    assert code == 1, f"exit code {code}:\n{text[-4000:]}"
    assert f"{signal_name} received; every rank stopped" in text, text[-4000:]
    assert not any(word in text for word in BROKEN), text[-6000:]
    assert "finished at step" not in text and "did not stop within" not in text, text[-3000:]


def checkpoints(tmp_path: Path) -> dict[str, int]:
    """Every checkpoint in ``ckpts/`` by name, with its global step; each must be complete (every file present with
    the size ``meta.pt`` records and its CRC-32, what ``lightning-zero inspect --verify`` checks)."""
    folder = tmp_path / "ckpts"
    leftovers = [p.name for p in folder.iterdir() if p.name.startswith(".")] if folder.is_dir() else []
    assert not leftovers, f"a partial checkpoint is visible: {leftovers}"
    return {path.name: inspect_checkpoint(path, verify=True)["global_step"]
            for path in (sorted(folder.iterdir()) if folder.is_dir() else [])}


@pytest.mark.parametrize("signal_name", ["SIGINT", "SIGTERM"])
def test_signal_inside_a_sharded_checkpoint_write(tmp_path, signal_name):
    """The signal lands after every rank wrote its shard file, before meta.pt: the write completes, then all stop."""
    code, text = run_with_fault(
        tmp_path, f"point=save.written,signal={signal_name},rank=0,target=group,occurrence=2")
    assert_clean_stop(code, text, signal_name)
    assert checkpoints(tmp_path) == {"epoch=0-step=2.ckpt": 2, "epoch=0-step=4.ckpt": 4}
    last = tmp_path / "ckpts" / "epoch=0-step=4.ckpt"
    assert f"at global step 4: resume with `ckpt_path={str(last)!r}`" in text, text[-3000:]


def test_ctrl_c_with_the_output_piped_through_tee_exits_1(tmp_path):
    """``python train.py 2>&1 | tee log`` and Ctrl-C: ``tee`` gets the signal too and ends before the stop message is
    printed; the run still exits 1 (see [Note: a message nobody can read is not an error] in process/say.py)."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT),
               LIGHTNING_ZERO_FAULT="point=save.written,signal=SIGINT,rank=0,target=group,occurrence=2")
    script = (f'"{sys.executable}" "{ROOT / "tests" / "workers" / "interrupt.py"}" "{tmp_path}" 3 sharded 12 2>&1 '
              f'| tee "{tmp_path / "tee.log"}"; exit "${{PIPESTATUS[0]}}"')
    # a session of its own: the group signal reaches python, its ranks and tee, as Ctrl-C reaches a terminal's job
    done = subprocess.run(["bash", "-c", script], env=env, cwd=tmp_path, start_new_session=True, timeout=TIMEOUT,
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    assert done.returncode == 1, (done.returncode, (tmp_path / "tee.log").read_text()[-3000:])
    assert checkpoints(tmp_path) == {"epoch=0-step=2.ckpt": 2, "epoch=0-step=4.ckpt": 4}


def test_sigint_inside_a_full_checkpoint_write(tmp_path):
    code, text = run_with_fault(
        tmp_path, "point=save.full,signal=SIGINT,rank=0,target=group,occurrence=2", state_dict_type="full")
    assert_clean_stop(code, text, "SIGINT")
    assert sorted(p.name for p in (tmp_path / "ckpts").iterdir()) == ["epoch=0-step=2.ckpt", "epoch=0-step=4.ckpt"]


def test_sigterm_inside_a_gradient_collective(tmp_path):
    """Stage 2, the fifth bucket reduce-scatter (after the checkpoint of step 2): the step ends on every rank, then all
    stop before the next one; the checkpoint of step 2 is there and complete."""
    code, text = run_with_fault(
        tmp_path, "point=collective.reduce_scatter,signal=SIGTERM,rank=0,target=group,occurrence=5", stage=2)
    assert_clean_stop(code, text, "SIGTERM")
    assert checkpoints(tmp_path) == {"epoch=0-step=2.ckpt": 2}  # the signal landed after it, before step 4's


@pytest.mark.parametrize("signal_name", ["SIGINT", "SIGTERM"])
def test_a_signal_inside_a_disk_offloaded_step_stops_cleanly_and_leaves_no_file(tmp_path, signal_name):
    """Stage 3 with the optimizer and the parameters on disk: the signal lands as a window is written back (within
    the checkpoint of step 2); the step completes, every rank stops, that checkpoint is intact and the offload
    directory is empty (the files have no name: see [Note: the files have no name] in disk.py)."""
    code, text = run_with_fault(
        tmp_path, f"point=offload.write,signal={signal_name},rank=0,target=group,occurrence=40", extra=("disk",))
    assert_clean_stop(code, text, signal_name)
    assert checkpoints(tmp_path) == {"epoch=0-step=2.ckpt": 2}  # the signal landed after it, before step 4's
    assert (tmp_path / "offload").is_dir() and list((tmp_path / "offload").iterdir()) == []


def test_sigint_during_stage3_construction(tmp_path):
    code, text = run_with_fault(tmp_path, "point=materialize.unit,signal=SIGINT,rank=0,target=group,"
                                                   "occurrence=2")
    assert_clean_stop(code, text, "SIGINT")
    assert checkpoints(tmp_path) == {}


def test_sigint_during_validation(tmp_path):
    """Validation runs after step 3; the signal lands at its first batch; steps 2's checkpoint is the last."""
    code, text = run_with_fault(tmp_path, "point=evaluation.step,signal=SIGINT,rank=0,target=group,"
                                                   "occurrence=3")  # 2 sanity-check batches come first
    assert_clean_stop(code, text, "SIGINT")
    assert checkpoints(tmp_path) == {"epoch=0-step=2.ckpt": 2}


def test_slurm_requeue_signal_saves_on_every_rank_then_the_requeued_job_resumes(tmp_path):
    """Lightning's SLURM auto-requeue under ZeroStrategy: SIGUSR1 (a fault point sends it to both tasks inside a
    gradient collective) makes every rank save ``hpc_ckpt_1.ckpt`` at the next step boundary and rank 0 call
    ``scontrol requeue``; the requeued job picks the checkpoint up by itself and trains on."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "scontrol.calls"
    (bin_dir / "scontrol").write_text(f"#!/bin/sh\necho \"$@\" >> {calls}\n")
    (bin_dir / "scontrol").chmod(0o755)
    fault = "point=collective.reduce_scatter,signal=SIGUSR1,rank=0,target=group,occurrence=5"
    first = run_slurm_job(tmp_path, bin_dir, fault, max_steps=6, job="first")
    assert all(code == 0 for code, _ in first), first[0][1][-4000:]
    assert calls.read_text().split() == ["requeue", "4242"]
    hpc = tmp_path / "hpc_ckpt_1.ckpt"
    assert (hpc / "meta.pt").is_file(), sorted(p.name for p in tmp_path.iterdir())
    second = run_slurm_job(tmp_path, bin_dir, None, max_steps=8, job="requeued")
    assert all(code == 0 for code, _ in second), second[0][1][-4000:]
    assert "Restoring states from the checkpoint path at" in second[0][1] and "hpc_ckpt_1.ckpt" in second[0][1]
    assert "finished at step 8" in second[0][1]


def run_slurm_job(tmp_path: Path, bin_dir: Path, fault: str | None, max_steps: int,
                  job: str) -> list[tuple[int, str]]:
    """Start the two tasks of a SLURM job step the way ``srun`` would: one process group apart from this test (the
    fault point's ``target=group`` signal reaches both tasks and nothing else), SLURM's variables, each task forked
    from the test zygote (lightning_zero/testing/zygote.py)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    base = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "RANK", "LOCAL_RANK", "WORLD_SIZE"))}
    base.update(OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), PATH=f"{bin_dir}:{os.environ['PATH']}", MASTER_PORT=str(port),
                SLURM_NTASKS="2", SLURM_NTASKS_PER_NODE="2", SLURM_JOB_ID="4242", SLURM_JOB_NAME="train",
                SLURM_NODELIST="127.0.0.1", SLURM_NODEID="0", PYTHONFAULTHANDLER="1")
    if fault:
        base["LIGHTNING_ZERO_FAULT"] = fault
    argv = [str(ROOT / "tests" / "workers" / "interrupt.py"), str(tmp_path), "2", "sharded", str(max_steps), "slurm"]
    tasks: list = []
    for r in range(2):
        env = dict(base, SLURM_PROCID=str(r), SLURM_LOCALID=str(r))
        leader = tasks[0].pid if tasks else 0
        tasks.append(ZYGOTE.spawn(argv, env, tmp_path, tmp_path / f"{job}{r}.log", group=leader))
    codes = wait_all(tasks, TIMEOUT)
    return [(code, (tmp_path / f"{job}{r}.log").read_text()) for r, code in enumerate(codes)]


@pytest.mark.parametrize("stall", ["python", "native"])
def test_a_rank_stalled_away_from_a_step_boundary_ends_every_rank_at_the_deadline(tmp_path, stall):
    """Rank 1 stalls at its third step (in Python, or blocked in gloo's C++ while rank 0 waits in the gradient
    exchange) and SIGTERM reaches both ranks: with ``shutdown_timeout=2`` each rank's deadline thread ends it with
    exit code 143 and one line naming rank 1 as the rank that did not arrive and where rank 0 waited."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    log = tmp_path / "run.log"
    cmd = [sys.executable, str(ROOT / "tests" / "workers" / "stuck.py"), str(tmp_path), stall]
    code = run_in_own_session(cmd, env, tmp_path, log, STALLED_TIMEOUT)
    text = log.read_text()
    assert code == 143, f"exit code {code}:\n{text[-4000:]}"
    lines = [line for line in text.splitlines() if "did not stop within `shutdown_timeout=2`" in line]
    assert sorted(line.rsplit("Ending rank ", 1)[1][0] for line in lines) == ["0", "1"], text[-4000:]
    where = "stuck.py" if stall == "python" else "in recv, from stuck.py"
    for line in lines:
        assert "SIGTERM received" in line and "exit code 143" in line, line
        assert "rank 1 did not arrive (at " in line and where in line and "in training_step" in line, line
        assert "; ranks 0 waited in " in line and "rank 0 did not" not in line, line
    assert "finished" not in text and "every rank stopped at the same step boundary" not in text, text[-4000:]


def test_a_second_ctrl_c_claims_no_agreed_stop():
    """After the second Ctrl-C this rank stops alone: at teardown nothing claims that every rank stopped together."""
    from lightning_zero.process.shutdown import SignalGuard

    guard = SignalGuard()
    signal.signal(signal.SIGINT, signal.default_int_handler)
    guard.install()
    try:
        os.kill(os.getpid(), signal.SIGINT)
        with pytest.raises(KeyboardInterrupt, match="second Ctrl-C"):
            os.kill(os.getpid(), signal.SIGINT)  # a signal to this process is handled before `os.kill` returns
    finally:
        guard.remove()
    guard.raise_pending()  # raised `Stopped` ("every rank stopped at the same step boundary") before
    signal.signal(signal.SIGINT, signal.default_int_handler)


def test_a_stop_message_nobody_can_read_changes_nothing(monkeypatch):
    """``python train.py 2>&1 | tee log`` and Ctrl-C: ``tee`` is gone before the stop message is printed."""
    from lightning_zero.process.shutdown import SignalGuard, Stopped

    read, write = os.pipe()
    os.close(read)  # the reader (tee) ended with the signal
    stderr, stdout = os.fdopen(write, "w"), os.fdopen(os.dup(write), "w")  # `2>&1 | tee`: one pipe for both
    monkeypatch.setattr(sys, "stderr", stderr)
    monkeypatch.setattr(sys, "stdout", stdout)
    guard = SignalGuard()
    guard.where = lambda: ", at global step 4: resume with `ckpt_path='ckpts/last.ckpt'`, the last checkpoint."
    with pytest.raises(Stopped, match="every rank stopped at the same step boundary, at global step 4: resume with"):
        guard._act({signal.SIGINT: 1, signal.SIGTERM: 0, signal.SIGUSR1: 0})
    for stream in (stderr, stdout):  # both now write to os.devnull: nothing fails
        stream.write("Lightning's own message, then the flush at exit\n")
        stream.flush()
        stream.close()


def test_the_guard_records_acts_once_and_gives_the_signals_back():
    """One process, no collective: what the guard does with Lightning's handlers around it."""
    from lightning_zero.comm.groups import ShardGroups
    from lightning_zero.process.shutdown import SignalGuard, Stopped

    guard, seen, groups = SignalGuard(), [], ShardGroups()
    signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a terminal, even if pytest runs under nohup
    before = signal.getsignal(signal.SIGTERM)
    guard.install()
    try:
        found = signal.getsignal(signal.SIGTERM)  # Lightning registers a handler that also calls the one it found
        signal.signal(signal.SIGTERM, lambda s, f: (seen.append("lightning"), found(s, f)))
        guard.safe_point(groups)  # takes SIGTERM back
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGINT)  # recorded, not raised
        assert seen == [] and guard.pending == {signal.SIGTERM: 1, signal.SIGINT: 1}
        with guard:  # inside a checkpoint write even a second Ctrl-C waits
            os.kill(os.getpid(), signal.SIGINT)
        assert guard.pending[signal.SIGINT] == 2
        with pytest.raises(Stopped, match="SIGTERM received"):
            guard.safe_point(groups)
    finally:
        guard.remove()
    assert signal.getsignal(signal.SIGTERM) == before
    signal.signal(signal.SIGINT, guard._handler)  # Lightning's teardown puts back what it found: the guard's
    try:
        with pytest.raises(KeyboardInterrupt):  # inactive: Ctrl-C does what it did before, no recursion
            os.kill(os.getpid(), signal.SIGINT)  # handled before `os.kill` returns
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def test_each_guard_counts_its_step_boundaries_for_its_deadline():
    """The step boundaries the deadline's report names are the installed guard's own count (see [Note: who did not
    arrive] in ``process/deadline.py``): counted at each safe point, from 0 at each install, read by its watchdog."""
    from lightning_zero.comm.groups import ShardGroups
    from lightning_zero.process import deadline
    from lightning_zero.process.shutdown import SignalGuard

    guard, other, groups = SignalGuard(), SignalGuard(), ShardGroups()
    guard.install(shutdown_timeout=60.0)
    try:
        guard.safe_point(groups)
        guard.safe_point(groups)
        assert guard._watchdog is not None and guard._watchdog.progress is guard.progress
        assert deadline.position(None, guard._watchdog.progress.boundaries)["boundaries"] == 2
        assert other.progress.boundaries == 0
        guard.install(shutdown_timeout=60.0)  # a second fit in the same process counts from 0 again
        guard.safe_point(groups)
        assert guard._watchdog.progress.boundaries == 1
    finally:
        guard.remove()
        signal.signal(signal.SIGINT, signal.default_int_handler)


def test_the_deadline_runs_from_the_first_signal_whatever_signals_follow(monkeypatch):
    """A scheduler that sends SIGTERM again and again (and a user's Ctrl-C on top) does not postpone the deadline: it
    ends the rank ``shutdown_timeout`` seconds after the first signal, naming that signal. The watchdog's clock is
    this test's (a fake ``time.monotonic``), and the test waits for each of its waits, so nothing depends on timing."""
    import queue
    import types

    from lightning_zero.process import deadline

    clock, waits, ended = [0.0], queue.Queue(), []

    def select(readers, writers, errors, timeout):  # the thread's wait, seen by the test
        waits.put(timeout)
        return original_select(readers, writers, errors, None if timeout is None else max(timeout, 0.0))

    def end(signum, timeout, generation, boundaries):  # instead of the report and `os._exit`
        ended.append((signal.Signals(signum).name, timeout, clock[0]))
        watchdog._writer.send(deadline._STOP)  # the thread returns at its next wait

    original_select = deadline.select.select
    monkeypatch.setattr(deadline, "select", types.SimpleNamespace(select=select))
    monkeypatch.setattr(deadline, "time", types.SimpleNamespace(monotonic=lambda: clock[0]))
    monkeypatch.setattr(deadline, "_end", end)
    previous = {s: signal.signal(s, lambda *args: None) for s in (signal.SIGTERM, signal.SIGINT)}  # C handler on
    watchdog = deadline.Watchdog(10.0, 0, deadline.Progress())
    try:
        assert waits.get(timeout=30) is None  # no deadline yet
        for now, signum in ((0.0, signal.SIGTERM), (4.0, signal.SIGTERM), (6.0, signal.SIGINT), (9.5, signal.SIGTERM)):
            clock[0] = now
            os.kill(os.getpid(), signum)
            assert waits.get(timeout=30) == pytest.approx(10.0 - now), f"after the signal at {now} s"
        clock[0] = 10.5
        os.kill(os.getpid(), signal.SIGTERM)
        watchdog._thread.join(timeout=30)
        assert ended == [("SIGTERM", 10.0, 10.5)]  # at the first deadline past, for the first signal
    finally:
        watchdog.stop()
        for signum, handler in previous.items():
            signal.signal(signum, handler)


CLEAN_EXIT_RUNS = 12  # an abort in 1 run of 4 goes unseen by all 12 with probability (3/4)**12, about 3 %
CLEAN_EXIT_RUNS_AT_ONCE = 4  # independent runs side by side: a run mostly waits (rendezvous, ranks taking turns)


def test_a_zero3_run_that_saves_after_fit_exits_with_0_every_time(tmp_path):
    """Train, save after ``fit``, return: each rank ends through the interpreter's own shutdown (C++ static
    destructors included, where a communicator thread left alive aborts with "terminate called without an active
    exception", exit code 134), and every run of every rank exits with 0."""
    for first in range(0, CLEAN_EXIT_RUNS, CLEAN_EXIT_RUNS_AT_ONCE):
        outs = [tmp_path / f"run{run}" for run in range(first, min(first + CLEAN_EXIT_RUNS_AT_ONCE, CLEAN_EXIT_RUNS))]
        started = []
        try:
            for out in outs:
                out.mkdir()
                started.append(start("save_exit.py", 2, out, finalize=True))
            codes = [wait_all(procs, TIMEOUT) for procs in started]
        finally:
            for proc in (p for procs in started for p in procs):
                proc.kill()
                proc.wait()
        for out, run_codes in zip(outs, codes):
            assert run_codes == [0, 0], f"{out.name}: exit codes {run_codes}\n{_tail(out)}"
            assert (out / "final.ckpt" / "meta.pt").is_file(), sorted(p.name for p in out.iterdir())
            assert "terminate called" not in _tail(out), _tail(out)
