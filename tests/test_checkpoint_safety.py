"""Checkpoints are complete or absent, and bad ones are refused with an error that names the problem.

Single-process cases use a world-size-1 Trainer (quick); the kill test kills two ranks in the middle of a save.
"""

from __future__ import annotations

import errno
import os
import select
import subprocess
import sys
import time
from typing import Callable
from pathlib import Path

import lightning as L
import pytest
import torch

import lightning_zero
from lightning_zero import CheckpointError, ZeroStrategy
from lightning_zero.checkpoints.staging import write_meta_digest
from lightning_zero.checkpoints.shards import Shard
from lightning_zero.checkpoints.storage import _replace, check_files, load_sharded, read_meta
from lightning_zero.cli import main as cli
from lightning_zero.testing.launch import ROOT, _tail, launch, start
from tests.models import TinyGPT, TinyLM
from lightning_zero.testing.zygote import ZYGOTE


def _trainer(strategy="zero3", **kwargs) -> L.Trainer:
    defaults = dict(accelerator="cpu", devices=1, max_steps=2, logger=False, enable_checkpointing=False,
                    enable_progress_bar=False, enable_model_summary=False)
    return L.Trainer(strategy=strategy, **{**defaults, **kwargs})


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    """A zero3 checkpoint directory of a TinyGPT after 2 steps."""
    L.seed_everything(0)
    trainer = _trainer(ZeroStrategy(stage=3, persistence_threshold=0))
    trainer.fit(TinyGPT())
    path = tmp_path_factory.mktemp("saved") / "gpt.ckpt"
    trainer.save_checkpoint(path)
    return path


@pytest.fixture
def copy(saved, tmp_path) -> Path:
    """A private copy of ``saved`` that a test may damage."""
    target = tmp_path / saved.name
    target.mkdir()
    for f in saved.iterdir():
        (target / f.name).write_bytes(f.read_bytes())
    return target


class Fifo:
    """A named pipe the test reads lines from as the code under test writes them: the test waits for an event, not
    for a time (``timeout``: a safety net). It holds a writer end itself, so a worker closing its end is no EOF."""

    def __init__(self, path: Path) -> None:
        os.mkfifo(path)
        self.fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
        self.keep = os.open(path, os.O_WRONLY)
        self.buffer = b""

    def lines(self, count: int, timeout: float, what: Callable[[], str]) -> list[str]:
        """The first ``count`` lines; ``what()`` describes them if they never come (called only then: the logs it
        reads may not exist yet while the workers start)."""
        deadline = time.monotonic() + timeout
        while self.buffer.count(b"\n") < count:
            left = deadline - time.monotonic()
            assert left > 0 and select.select([self.fd], [], [], left)[0], f"{what()} never came in {timeout} s"
            self.buffer += os.read(self.fd, 4096)
        return self.buffer.decode().splitlines()

    def close(self) -> None:
        os.close(self.fd)
        os.close(self.keep)


def test_kill_during_save_leaves_the_previous_checkpoint_intact(tmp_path):
    fifo = Fifo(tmp_path / "saving.fifo")
    procs = start("kill_save.py", 2, tmp_path)
    try:  # every rank is inside the second save (its shard written, meta.pt not) when the test kills them
        assert sorted(fifo.lines(2, 240, lambda: "the second save on every rank:\n" + _tail(tmp_path))) == ["0", "1"]
    finally:
        fifo.close()
        for p in procs:
            p.kill()
            p.wait()
    last = tmp_path / "last.ckpt"
    meta = read_meta(last)
    check_files(last, meta, verify=True)
    assert meta["lightning_zero"]["files"] == torch.load(tmp_path / "first.pt")  # the first save, untouched
    staging = [p for p in tmp_path.iterdir() if p.name.startswith(".last.ckpt.tmp-")]
    assert len(staging) == 1 and any(staging[0].glob("__*.distcp"))  # the killed save had written its shards ...
    with pytest.raises(CheckpointError, match="no meta.pt"):  # ... but is never taken for a checkpoint
        read_meta(staging[0])
    assert isinstance(lightning_zero.load_from_checkpoint(TinyGPT, last), TinyGPT)
    trainer = _trainer("zero2", max_steps=1)
    trainer.fit(TinyGPT())
    trainer.save_checkpoint(last)  # the next save to that name clears the leftovers
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".last")) == []


@pytest.mark.parametrize("fault, rank, code, cause, stage", [
    ("point=save.prepare,error=EACCES,rank=0", 0, "EACCES", "Permission denied", 2),  # a read-only `dirpath`
    ("point=save.shard,error=ENOSPC,rank=1", 1, "ENOSPC", "No space left on device", 3),  # a full disk, inside DCP
])
def test_a_failed_save_names_the_rank_and_the_cause_on_every_rank(tmp_path, monkeypatch, fault, rank, code, cause,
                                                                    stage):
    """One rank's save fails (the fault point raises the errno, as the file system would; root ignores ``chmod``):
    every rank raises the same ``CheckpointError``, which ``except Exception`` catches, naming the rank, the errno
    and the cause, at once, and the ranks stay in step (the next save works, nothing is left behind)."""
    monkeypatch.setenv("LIGHTNING_ZERO_FAULT", fault)
    for r, report in enumerate(launch("save_faults.py", 2, tmp_path, args=(str(stage),), timeout=240)):
        assert report.get("type") == "CheckpointError", (r, report)
        message = report["message"]
        assert f"failed on rank {rank} " in message and f"[{code}]" in message and cause in message, message
        assert "Nothing was written under that name" in message, message
        assert report["rank"] == rank and report["errno"] == getattr(errno, code), report
        # agreed at once, not found out by a timeout: the process group's timeout is 30 minutes, so a rank left
        # waiting for the one that failed would end `launch` by its safety net instead
        assert report["after"] == 1 and report["left"] == ["after.ckpt"], report


def test_two_jobs_writing_one_checkpoint_name_both_succeed_and_the_last_wins(tmp_path):
    """Job A pauses (on a FIFO, at the fault point ``save.written``) with its shard written in its staging
    directory; job B writes the same name from start to end, which clears stale staging directories but must leave A's live one alone; then A
    goes on and replaces B's checkpoint. (Before: B deleted A's staging directory, and A crashed.)"""
    path = tmp_path / "last.ckpt"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE")}
    env["PYTHONPATH"] = str(ROOT)
    stale = tmp_path / ".last.ckpt.tmp-stale"  # what a killed save left behind: nobody holds it
    stale.mkdir()
    script = str(ROOT / "tests" / "workers" / "writer.py")
    paused, go = Fifo(tmp_path / "paused"), tmp_path / "go"
    os.mkfifo(go)
    a = ZYGOTE.spawn([script, str(path), "1", str(tmp_path)], env, tmp_path, tmp_path / "a.log")
    try:
        assert paused.lines(1, 120, lambda: "A's pause:\n" + (tmp_path / "a.log").read_text()) == ["paused"]
        b = ZYGOTE.spawn([script, str(path), "2"], env, tmp_path, tmp_path / "b.log")
        assert b.wait(timeout=120) == 0, (tmp_path / "b.log").read_text()
        assert read_meta(path)["global_step"] == 2 and not stale.exists()
        assert len([p for p in tmp_path.iterdir() if p.name.startswith(".last.ckpt.tmp-")]) == 1  # A's, kept
        with open(go, "w") as release:
            release.write("go\n")
        assert a.wait(timeout=120) == 0, (tmp_path / "a.log").read_text()
    finally:
        a.kill()
        paused.close()
    (tmp_path / "paused").unlink()
    go.unlink()
    meta = read_meta(path)
    check_files(path, meta, verify=True)
    assert meta["global_step"] == 1  # the last writer wins
    loaded = Shard.whole(torch.zeros(1000))
    load_sharded(path, {"w": loaded}, collective=False)
    assert torch.equal(loaded.pieces[0][1], torch.ones(1000))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.log", "b.log", "last.ckpt"]


def test_interrupted_overwrite_points_to_the_kept_checkpoint(saved, tmp_path, monkeypatch):
    target = tmp_path / "last.ckpt"
    target.mkdir()
    staging = tmp_path / ".last.ckpt.tmp-x"
    staging.mkdir()
    real_rename = os.rename

    def crash_on_second(src, dst):
        if Path(src) == staging:
            raise KeyboardInterrupt("killed between the two renames")
        real_rename(src, dst)

    monkeypatch.setattr(os, "rename", crash_on_second)
    with pytest.raises(KeyboardInterrupt):
        _replace(staging, target, "x")
    monkeypatch.undo()
    with pytest.raises(FileNotFoundError, match=r"previous checkpoint is intact at .*\.last\.ckpt\.old-x"):
        read_meta(target)


def test_missing_truncated_and_corrupted_shards_are_named(copy):
    shard = copy / "__0_0.distcp"
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="__0_0.distcp has .* bytes instead of"):
        lightning_zero.load_from_checkpoint(TinyGPT, copy)
    shard.write_bytes(data[:-9] + bytes([data[-9] ^ 0xFF]) + data[-8:])
    with pytest.raises(CheckpointError, match="__0_0.distcp does not match its checksum"):
        lightning_zero.load_full_checkpoint(copy)
    shard.unlink()
    with pytest.raises(CheckpointError, match="__0_0.distcp is missing"):
        _trainer("zero2").fit(TinyGPT(), ckpt_path=copy)


@pytest.mark.parametrize("offset", [0, 2127, -1])
def test_a_flipped_bit_in_meta_pt_is_refused_before_it_is_unpickled(copy, offset, capsys):
    """meta.pt holds the optimizer's hyperparameters and the other files' checksums: one flipped bit anywhere in it
    (at 2127 it once made Adam's beta2 8.6e-78, and the resumed run trained to NaN) is refused by every reader."""
    meta = copy / "meta.pt"
    data = bytearray(meta.read_bytes())
    data[offset] ^= 0x01
    meta.write_bytes(bytes(data))
    damaged = "is damaged: meta.pt does not match its checksum"
    with pytest.raises(CheckpointError, match=damaged):
        lightning_zero.inspect_checkpoint(copy)  # even without verify: meta.pt is always checked
    with pytest.raises(CheckpointError, match=damaged):
        lightning_zero.load_from_checkpoint(TinyGPT, copy)
    with pytest.raises(CheckpointError, match=damaged):
        _trainer("zero2").fit(TinyGPT(), ckpt_path=copy)
    assert cli(["inspect", str(copy), "--verify"]) == 2
    assert "meta.pt does not match its checksum" in capsys.readouterr().err
    (copy / "meta.crc32").unlink()
    with pytest.raises(CheckpointError, match="meta.crc32 .* is missing"):
        lightning_zero.load_full_checkpoint(copy)


def test_paths_that_are_not_our_checkpoints(tmp_path, saved):
    with pytest.raises(FileNotFoundError, match="No checkpoint at"):
        lightning_zero.load_from_checkpoint(TinyGPT, tmp_path / "nothing.ckpt")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="is not a checkpoint: it has no meta.pt"):
        lightning_zero.load_full_checkpoint(tmp_path / "empty")
    (tmp_path / "dcp").mkdir()
    (tmp_path / "dcp" / ".metadata").write_bytes(b"")
    with pytest.raises(CheckpointError, match="torch.distributed.checkpoint directory that lightning-zero did not"):
        lightning_zero.inspect_checkpoint(tmp_path / "dcp")
    (tmp_path / "text").mkdir()
    (tmp_path / "text" / "meta.pt").write_text("hello")
    with pytest.raises(CheckpointError, match=r"meta.crc32 \(the checksum of meta.pt\) is missing"):
        lightning_zero.inspect_checkpoint(tmp_path / "text")
    write_meta_digest(tmp_path / "text", tmp_path / "text" / "meta.pt")
    with pytest.raises(CheckpointError, match="cannot be read"):
        lightning_zero.inspect_checkpoint(tmp_path / "text")
    torch.save({"state_dict": {}}, tmp_path / "text" / "meta.pt")
    write_meta_digest(tmp_path / "text", tmp_path / "text" / "meta.pt")
    with pytest.raises(CheckpointError, match="not lightning-zero checkpoint metadata"):
        lightning_zero.inspect_checkpoint(tmp_path / "text")


def test_a_checkpoint_of_another_model_is_refused_before_anything_is_loaded(saved):
    with pytest.raises(CheckpointError, match=r"shape mismatch for .*wte.weight: checkpoint \(37, 32\), model \(37, 16\)"):
        lightning_zero.load_from_checkpoint(TinyGPT, saved, width=16)
    L.seed_everything(0)
    model = TinyLM()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(CheckpointError, match="missing keys 'embed.weight'.*unexpected keys 'pos', 'wte.weight'"):
        _trainer("zero3").fit(model, ckpt_path=saved)
    after = model.state_dict()
    assert before and all(torch.equal(before[k], after[k]) for k in before)  # refused before a tensor was written


class _Built(TinyGPT):
    """A TinyGPT built in ``configure_model`` that records how far the Trainer got."""

    def __init__(self, **kwargs) -> None:
        super().__init__(meta_init=True, **kwargs)
        self.stages: list[str] = []

    def configure_model(self) -> None:
        self.stages.append("configure_model")
        super().configure_model()

    def on_fit_start(self) -> None:
        self.stages.append("on_fit_start")


def test_a_bad_ckpt_path_through_the_trainer_is_refused_before_the_model_is_built(saved, copy, tmp_path):
    # [Note: a checkpoint is checked before the build] in lightning_zero/lightning/trainer/early_checks.py
    model = _Built()
    with pytest.raises(CheckpointError, match=r"`ckpt_path`: No checkpoint at .*nothing\.ckpt\. Nothing was built yet"):
        _trainer("zero3").fit(model, ckpt_path=tmp_path / "nothing.ckpt")
    assert model.stages == []  # not even configure_model ran
    meta = copy / "meta.pt"
    data = bytearray(meta.read_bytes())
    data[100] ^= 0x01
    meta.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="is damaged: meta.pt does not match its checksum"):
        _trainer("zero3").fit(model, ckpt_path=copy)
    assert model.stages == []
    # another model's shapes: found after configure_model recorded it (zero3: on the meta device), before the engine
    # builds and shards it, by the Trainer's own strictness (`strict_loading`)
    other = _Built(width=16)
    trainer = _trainer("zero3")
    with pytest.raises(CheckpointError, match=r"`ckpt_path`: The checkpoint .* does not fit this model: shape "
                                              r"mismatch for .*wte.weight: checkpoint \(37, 32\), model \(37, 16\).*"
                                              "Found before the model was built and sharded"):
        trainer.fit(other, ckpt_path=saved)
    assert other.stages == ["configure_model"] and trainer.strategy.engine is None
    # the same checkpoint with the right model still resumes
    good = _Built()
    _trainer("zero3", max_steps=3).fit(good, ckpt_path=saved)
    assert good.stages == ["configure_model", "on_fit_start"]


class _GPTWithExtra(TinyGPT):
    def __init__(self, width: int = 32) -> None:
        super().__init__(width=width)
        self.extra = torch.nn.Parameter(torch.ones(3))


def test_strict_false_skips_missing_keys_like_lightning(saved):
    with pytest.raises(CheckpointError, match="missing keys 'extra'"):
        lightning_zero.load_from_checkpoint(_GPTWithExtra, saved)
    model = lightning_zero.load_from_checkpoint(_GPTWithExtra, saved, strict=False)
    reference = lightning_zero.load_from_checkpoint(TinyGPT, saved)
    assert torch.equal(model.extra, torch.ones(3))
    assert torch.equal(model.blocks[0].qkv.weight, reference.blocks[0].qkv.weight)


def test_consolidated_file_loads_with_lightning_and_torch(saved, tmp_path):
    out = tmp_path / "gpt.ckpt"
    assert cli(["consolidate", str(saved), str(out)]) == 0
    plain = torch.load(out, weights_only=False)
    assert plain["global_step"] == 2 and plain["optimizer_states"][0]["state"]
    restored = TinyGPT.load_from_checkpoint(out)
    sharded = lightning_zero.load_from_checkpoint(TinyGPT, saved)
    for (name, a), b in zip(restored.state_dict().items(), sharded.state_dict().values()):
        assert torch.equal(a, b), name
    assert restored.lm_head.weight is restored.wte.weight
    small = tmp_path / "gpt-bf16.ckpt"
    assert cli(["consolidate", str(saved), str(small), "--weights-only", "--dtype", "bf16"]) == 0
    weights = torch.load(small, weights_only=False)
    assert "optimizer_states" not in weights and weights["state_dict"]["wte.weight"].dtype == torch.bfloat16
    assert small.stat().st_size < out.stat().st_size / 4
    assert cli(["inspect", str(out)]) == 0  # a consolidated (or ddp) file: a summary, not "not a directory"
    assert lightning_zero.inspect_checkpoint(small)["has_optimizer_state"] is False
    summary = lightning_zero.inspect_checkpoint(out)
    assert summary["format"] == "file" and summary["global_step"] == 2 and summary["optimizers"] == 1
    assert summary["num_parameters"] == sum(p.numel() for p in TinyGPT().parameters())  # the tied weight once
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(CheckpointError, match="torch.load cannot read"):
        lightning_zero.inspect_checkpoint(tmp_path / "notes.txt")


def test_inspect_summarizes(saved, capsys):
    assert cli(["inspect", str(saved), "--verify"]) == 0
    text = capsys.readouterr().out
    assert "zero3 on 1 rank" in text and "global step 2" in text and "checksums verified" in text
    summary = lightning_zero.inspect_checkpoint(saved)
    assert summary["num_parameters"] == sum(p.numel() for p in TinyGPT().parameters())
    assert cli(["inspect", str(saved.parent / "absent")]) == 2
    assert "No checkpoint at" in capsys.readouterr().err


def test_console_command_and_python_m_share_the_entry_point(saved, tmp_path):
    """The ``lightning-zero`` script installed beside this interpreter (a fresh process, whatever ``PATH`` says) and
    ``python -m lightning_zero`` (forked from the test zygote, run as ``-m`` runs it) print the same summary."""
    command = Path(sys.executable).parent / "lightning-zero"
    assert command.is_file(), f"the console script is not installed in {command.parent}: pip install -e ."
    script = subprocess.run([str(command), "inspect", str(saved), "--json"], capture_output=True, text=True,
                            cwd=ROOT, timeout=120)
    assert script.returncode == 0, script.stderr
    out, err = tmp_path / "m.out", tmp_path / "m.err"
    module = ZYGOTE.spawn(["-m", "lightning_zero", "inspect", str(saved), "--json"], dict(os.environ), ROOT, out, err)
    assert module.wait(timeout=120) == 0, err.read_text()
    assert '"stage": 3' in script.stdout and out.read_text() == script.stdout


def test_ddp_resumes_a_sharded_checkpoint_through_zero_checkpoint_io(saved):
    model = TinyGPT()
    trainer = _trainer("auto", max_steps=3, plugins=[lightning_zero.ZeroCheckpointIO()])
    trainer.fit(model, ckpt_path=saved)
    assert trainer.global_step == 3 and len(model.losses) == 1


def test_lightnings_own_loaders_read_a_sharded_directory(saved, tmp_path):
    """``MyModule.load_from_checkpoint(dir)`` and ``ddp``'s ``ckpt_path=dir`` without a plugin (bare
    ``IsADirectoryError`` before); a directory that is no checkpoint is named as such."""
    restored = TinyGPT.load_from_checkpoint(saved)
    reference = lightning_zero.load_from_checkpoint(TinyGPT, saved)
    for (name, a), b in zip(restored.state_dict().items(), reference.state_dict().values()):
        assert torch.equal(a, b), name
    model = TinyGPT()
    trainer = _trainer("auto", max_steps=3)
    trainer.fit(model, ckpt_path=saved)
    assert trainer.global_step == 3 and len(model.losses) == 1
    (tmp_path / "logs").mkdir()
    with pytest.raises(CheckpointError, match="is not a checkpoint: it has no meta.pt"):
        TinyGPT.load_from_checkpoint(tmp_path / "logs")
