"""Disk offload (``offload_optimizer="disk"``, ``offload_params="disk"``, see lightning_zero/shards/disk.py): the files,
residency, the refusals, a full disk mid-step. DDP parity and checkpoint moves between disk, host and plain runs are
in test_offload.py (the same scenarios, parametrized over the disk placements)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import lightning as L
import pytest
import torch

from lightning_zero import ZeroConfig, ZeroStrategy
from lightning_zero.shards import disk
from lightning_zero.process import faults
from lightning_zero.shards.disk import DiskOffloadError
from lightning_zero.testing.launch import ROOT
from tests.models import TinyLM

MIB = 2**20


def _rss_file() -> int:
    """Bytes of file mappings resident in this process (``RssFile`` of /proc/self/status)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssFile:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no RssFile in /proc/self/status")


@pytest.fixture
def fault(monkeypatch):
    """Set ``LIGHTNING_ZERO_FAULT`` for this process's fault points (re-read at the next one)."""

    def set_fault(spec: str) -> None:
        monkeypatch.setenv("LIGHTNING_ZERO_FAULT", spec)

    yield set_fault


def test_a_disk_tensor_is_a_nameless_file_whose_pages_leave_the_process_and_keep_their_values(tmp_path):
    t = disk.zeros(16 * MIB, torch.float32, str(tmp_path))  # 64 MiB
    assert disk.on_disk(t) and disk.on_disk(t[5:100]) and not disk.on_disk(torch.zeros(10))
    assert list(tmp_path.iterdir()) == []  # the file has no name: nothing to clean up on any exit
    maps = Path("/proc/self/maps").read_text()
    assert f"{tmp_path}/lightning-zero-{os.getpid()}-" in maps and "(deleted)" in maps
    before = _rss_file()
    t.copy_(torch.arange(t.numel(), dtype=torch.float32))
    assert _rss_file() - before >= 60 * MIB
    disk.COUNTERS.reset()
    disk.evict([t], written=True)
    assert _rss_file() - before < 4 * MIB  # the pages left the process ...
    assert disk.COUNTERS.written == t.numel() * 4
    disk.read([t[: 4 * MIB]])
    assert disk.COUNTERS.read == 16 * MIB and _rss_file() - before >= 15 * MIB  # ... a read brings a window back
    assert torch.equal(t, torch.arange(t.numel(), dtype=torch.float32))  # ... with the values written


def test_copies_to_and_from_a_disk_shard_keep_one_window_resident(tmp_path):
    source = disk.zeros(8 * MIB, torch.float32, str(tmp_path))
    source.normal_()
    disk.evict([source], written=True)
    target = torch.empty(8 * MIB)
    before = _rss_file()
    disk.copy_windowed(target, source, MIB, lambda a, b: a.copy_(b))
    assert _rss_file() - before < 2 * MIB
    assert torch.equal(target, source)


def test_an_unwritable_path_is_refused_with_the_path_named(tmp_path, fault):
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(ValueError, match="is not a directory"):
        ZeroConfig(stage=3, offload_optimizer="disk", offload_path=str(blocker / "sub"))
    with pytest.raises(ValueError, match="neither is set"):
        ZeroConfig(stage=3, offload_optimizer=True, offload_path=str(tmp_path))
    with pytest.raises(TypeError, match="must be a bool .* or 'disk'"):
        ZeroConfig(offload_optimizer="nvme")
    with pytest.raises(ValueError, match="`offload_params='disk'` offloads stage 3's"):
        ZeroConfig(stage=2, offload_params="disk")
    # a directory that became unwritable after the options were checked (root ignores chmod: a fault point)
    fault("point=offload.create,error=EACCES")
    with pytest.raises(DiskOffloadError, match=f"make a file in '{tmp_path}' \\(Permission denied\\).*offload_path"):
        disk.zeros(100, torch.float32, str(tmp_path))


def test_a_disk_without_room_is_refused_when_the_files_are_made(tmp_path):
    # posix_fallocate reserves the blocks at setup: a file larger than the file system can hold fails there
    free = os.statvfs(tmp_path).f_bavail * os.statvfs(tmp_path).f_frsize
    with pytest.raises(DiskOffloadError, match="disk is full"):
        disk.zeros(2 * free // 4 + 4 * MIB, torch.float32, str(tmp_path))
    assert list(tmp_path.iterdir()) == []


def _trainer(tmp_path: Path, **kwargs) -> L.Trainer:
    strategy = ZeroStrategy(stage=3, offload_optimizer="disk", offload_params="disk", offload_path=str(tmp_path / "off"),
                            persistence_threshold=0, reduce_bucket_size=2_000)
    return L.Trainer(strategy=strategy, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                     enable_progress_bar=False, enable_model_summary=False, **kwargs)


class SaveAt(L.Callback):
    def __init__(self, path: Path, step: int) -> None:
        self.path, self.step = path, step

    def on_train_batch_end(self, trainer: L.Trainer, *args) -> None:
        if trainer.global_step == self.step:
            trainer.save_checkpoint(self.path)


def _files(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(path.iterdir())} if path.is_dir() else {path.name: path.read_bytes()}


def test_a_full_disk_mid_step_is_a_clear_error_and_the_last_checkpoint_is_intact(tmp_path, fault, monkeypatch):
    ckpt = tmp_path / "last.ckpt"
    fault("point=offload.write,error=ENOSPC,occurrence=1000000000")  # only counts the window writes
    L.seed_everything(0)
    probe = _trainer(tmp_path, max_steps=2, callbacks=[SaveAt(ckpt, 2)])
    probe.fit(TinyLM())
    saved = _files(ckpt)
    per_step = faults._ARMED.reached // 2  # the armed point's count since the variable was set
    assert per_step >= 2  # several windows per step
    # the same run again, with the file system failing the first window's write of the third step (after the save)
    fault(f"point=offload.write,error=ENOSPC,occurrence={2 * per_step + 1}")
    L.seed_everything(0)
    failing = _trainer(tmp_path, max_steps=6, callbacks=[SaveAt(tmp_path / "other.ckpt", 99)])
    with pytest.raises(DiskOffloadError, match=f"write the optimizer's window back to '{tmp_path / 'off'}' "
                                               r"\(No space left on device\). This step is incomplete: resume from "
                                               "the last checkpoint. The disk is full"):
        failing.fit(TinyLM())
    assert failing.global_step == 2
    assert _files(ckpt) == saved  # the checkpoint written before is untouched
    assert list((tmp_path / "off").iterdir()) == []
    monkeypatch.delenv("LIGHTNING_ZERO_FAULT")  # disarmed from the next point on
    resumed = _trainer(tmp_path, max_steps=3)
    resumed.fit(TinyLM(), ckpt_path=ckpt)  # and it resumes
    assert resumed.global_step == 3


def test_a_killed_process_leaves_no_file_behind(tmp_path):
    code = ("import sys, torch, time; from lightning_zero.shards import disk; "
            f"t = disk.zeros(1 << 20, torch.float32, {str(tmp_path)!r}); t.fill_(1); print('ready', flush=True); "
            "time.sleep(60)")
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                             env=dict(os.environ, PYTHONPATH=str(ROOT)))
    try:
        assert child.stdout.readline().strip() == "ready"
        maps = Path(f"/proc/{child.pid}/maps").read_text()
        assert f"{tmp_path}/lightning-zero-{child.pid}-" in maps  # the file exists while the process holds it
        assert list(tmp_path.iterdir()) == []  # under no name
    finally:
        child.kill()  # SIGKILL: no handler, no atexit
        child.wait(timeout=30)
    assert list(tmp_path.iterdir()) == []


def test_estimate_knows_disk_offload(capsys):
    from lightning_zero.shards.accounting import expected_disk_bytes
    from lightning_zero.cli import main as cli

    psi, n = 150_000_000, 2
    # fp32, both on disk: nothing on the device, the gradient shard on the host, master and Adam states in files
    assert expected_disk_bytes(psi, n, 3, "32-true", offload_params=True) == (0.0, 4 * psi / n, 12 * psi / n)
    # bf16-mixed: the 16-bit working shard is a file of its own next to the fp32 master's
    assert expected_disk_bytes(psi, n, 3, "bf16-mixed", offload_params=True) == (0.0, 4 * psi / n, 14 * psi / n)
    assert expected_disk_bytes(psi, n, 1, "32-true") == (8 * psi, 4 * psi / n, 12 * psi / n)
    cli(["estimate", "--params", str(psi), "-n", str(n)])
    out = capsys.readouterr().out
    assert "With `offload_optimizer='disk'`" in out and "0 B + 286.1 MiB (300.0 MB) host + 858.3 MiB (900.0 MB) disk" in out


def test_the_engine_steps_window_by_window_reading_ahead_and_evicting(tmp_path, monkeypatch):
    """``ZeroEngine`` (what Fabric and the Trainer drive) with ``offload_optimizer="disk"``: each piece is read before
    it steps, the next one's read is started before it steps, each window is written back after; the weights are
    those of one plain AdamW step, and the master and the states are file mappings."""
    from torch import nn

    from lightning_zero import ZeroEngine

    def build():
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(4)])
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)

    model, optimizer = build()
    engine = ZeroEngine(model, [optimizer], stage=2, offload_optimizer="disk", offload_path=str(tmp_path),
                        reduce_bucket_size=2_000)
    events = []
    for name in ("read", "evict", "_touch"):
        original = getattr(disk, name)
        monkeypatch.setattr(disk, name, lambda *a, _f=original, _n=name, **k: events.append(_n) or _f(*a, **k))
    step = type(optimizer).step
    monkeypatch.setattr(type(optimizer), "step", lambda self, *a, **k: events.append("step") or step(self, *a, **k))
    reference, ref_optimizer = build()
    for _ in range(2):
        x = torch.randn(8, 64)
        model(x).square().mean().backward()
        engine.finish_backward()
        engine.step()
        reference(x).square().mean().backward()
        ref_optimizer.step()
        ref_optimizer.zero_grad()
    storage = engine.optimizers[0].storage
    pieces = events.count("step") // 2
    assert pieces > 2 and events.count("read") >= 2  # the first window of each step, read before it steps
    assert events.count("_touch") >= 2 * (pieces - 1)  # every later window read ahead (on the pool's thread)
    assert events[events.index("step") - 1] in ("_touch", "read") and events[-1] == "evict"
    states = [v for st in optimizer.state.values() for v in st.values() if isinstance(v, torch.Tensor) and v.dim()]
    assert states and all(disk.on_disk(v) for v in states) and disk.on_disk(storage.master_storage)
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p, q)


def test_a_truncated_offload_file_is_an_error_naming_it_not_a_bus_error(tmp_path):
    """Another process of the same user truncates a live offload file through ``/proc/<pid>/fd`` (the descriptor
    ``mmap`` keeps): the next window read raises an error naming the file, instead of a ``SIGBUS`` on its pages.
    Run in a child, so that a bus error (the bug) fails the test instead of ending pytest."""
    code = ("import os, torch; from lightning_zero.shards import disk\n"
            f"t = disk.zeros(1 << 20, torch.float32, {str(tmp_path)!r}); t.fill_(1); disk.evict([t], written=True)\n"
            "for fd in os.listdir('/proc/self/fd'):\n"
            "    try:\n        target = os.readlink(f'/proc/self/fd/{fd}')\n"
            "    except OSError:\n        continue\n"
            "    if 'lightning-zero-' in target:\n        os.truncate(f'/proc/self/fd/{fd}', 4096)\n"
            "try:\n    disk.copy_windowed(torch.empty(1 << 20), t, 1 << 16, lambda a, b: a.copy_(b))\n"
            "except disk.DiskOffloadError as e:\n    print('error:', e)\n")
    child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                           env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert child.returncode == 0, f"exit code {child.returncode} (-7: SIGBUS):\n{child.stderr[-3000:]}"
    assert f"The offload file '{tmp_path}/lightning-zero-" in child.stdout, child.stdout
    assert "was truncated to 4096 of its 4194304 bytes" in child.stdout, child.stdout


def _run_two_ranks_with_fault(tmp_path: Path, fault: str) -> tuple[int, str]:
    """tests/workers/interrupt.py (a user's script: Lightning's launcher starts rank 1) at stage 3 with both tiers on
    disk, ``LIGHTNING_ZERO_FAULT=fault``; returns (exit code, log)."""
    from lightning_zero.testing.launch import run_in_own_session

    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), LIGHTNING_ZERO_FAULT=fault)
    cmd = [sys.executable, str(ROOT / "tests" / "workers" / "interrupt.py"), str(tmp_path), "3", "sharded", "6", "disk"]
    code = run_in_own_session(cmd, env, tmp_path, tmp_path / "run.log", timeout=150)  # a safety net (a run takes ~15 s)
    return code, (tmp_path / "run.log").read_text()


@pytest.mark.timeout(400)
def test_a_full_disk_at_setup_on_one_rank_stops_every_rank_with_the_cause(tmp_path):
    """Rank 1 alone cannot make its first file (ENOSPC): both ranks raise at the end of setup, rank 1 its own error,
    rank 0 one naming rank 1 and the cause; neither waits for the other."""
    code, text = _run_two_ranks_with_fault(tmp_path, "point=offload.create,error=ENOSPC,rank=1")
    assert code != 0 and "finished at step" not in text, text[-4000:]
    assert "Offload to disk could not make a file in" in text and "The disk is full" in text, text[-4000:]
    assert "Offload to disk failed on rank 1 (No space left on device); every rank stopped" in text, text[-4000:]
    assert list((tmp_path / "offload").iterdir()) == []


@pytest.mark.timeout(400)
def test_an_io_error_mid_run_on_one_rank_stops_every_rank_after_that_step(tmp_path):
    """Rank 1's file system fails a window's write-back during training (its 100th, after the checkpoints of steps 2
    and 4 of 6): every rank raises at the end of that step, before the checkpoint callback could save it; the
    checkpoints written before are there and complete."""
    code, text = _run_two_ranks_with_fault(tmp_path, "point=offload.write,error=EIO,rank=1,occurrence=100")
    assert code != 0 and "finished at step" not in text, text[-4000:]
    assert "write the optimizer's window back to" in text, text[-4000:]
    assert "Offload to disk failed on rank 1 (Input/output error); every rank stopped" in text, text[-4000:]
    from lightning_zero import inspect_checkpoint

    folder = tmp_path / "ckpts"
    saved = {p.name: inspect_checkpoint(p, verify=True)["global_step"] for p in folder.iterdir()} \
        if folder.is_dir() else {}
    assert sorted(saved.values()) == [2, 4], saved  # complete, and none of the failed step or after
    assert list((tmp_path / "offload").iterdir()) == []
