"""Every example runs, briefly, the way the README and docs/getting-started.md tell a user to run it, so none rots.

Each command starts like a user's (Lightning's launcher starts the other processes), in a scratch directory, with a
hard timeout. The GPT walk-through is docs/getting-started.md's: train with zero3 from the shipped YAML config,
resume on a different number of processes after a Ctrl-C (delivered by a fault point inside a checkpoint write, not
by a timer), inspect the checkpoint, generate text from it.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import yaml

import lightning_zero
from lightning_zero.testing.launch import run_in_own_session
from lightning_zero.testing.zygote import ZYGOTE
from tests.compare import assert_params_close

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
TIMEOUT = 420  # a generous bound for a loaded machine; about 30 s each when idle

# Small and short: the shipped config's model is 4 layers of width 128 and trains 300 steps.
TINY = {"max_steps": 4, "val_check_interval": 2, "limit_val_batches": 1, "enable_progress_bar": False}
TINY_MODEL = {"n_layer": 2, "n_embd": 32, "n_head": 2}


def user_env() -> dict[str, str]:
    """The environment of a user's shell: no launcher variables of the test run; one thread per process."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "NODE_RANK")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    return env


def run(*cmd: str, cwd: Path) -> str:
    """Run a user's ``python ...`` command (its first process forked from the test zygote, lightning_zero/testing/zygote.py); fail with
    its output if it fails or hangs; return what it printed to stdout."""
    assert cmd[0] == sys.executable, cmd
    out, err = cwd / "stdout.txt", cwd / "stderr.txt"
    proc = ZYGOTE.spawn(list(cmd[1:]), user_env(), cwd, out, err, session=True)
    try:
        code = proc.wait(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise AssertionError(f"{' '.join(cmd)} did not finish in {TIMEOUT}s:\n{out.read_text()}\n{err.read_text()}")
    assert code == 0, f"{' '.join(cmd)} failed ({code}):\n{out.read_text()[-3000:]}\n{err.read_text()[-5000:]}"
    return out.read_text()


def tiny_config(stage: int, tmp_path: Path, **trainer: object) -> Path:
    """The shipped ``examples/configs/zero<stage>.yaml`` with a tiny model and a few steps."""
    config = yaml.safe_load((EXAMPLES / "configs" / f"zero{stage}.yaml").read_text())
    config["trainer"].update(TINY, **trainer)
    config["trainer"]["callbacks"][0]["init_args"]["every_n_train_steps"] = 2
    config["model"].update(TINY_MODEL)
    path = tmp_path / f"zero{stage}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def test_gpt_walkthrough_stop_resume_on_other_world_size_generate(tmp_path):
    """Train zero3 from the YAML config, stop it with Ctrl-C, resume on 3 processes, inspect, generate."""
    config = tiny_config(3, tmp_path, max_steps=10_000)
    with_checkpointing = yaml.safe_load(config.read_text())  # ZeRO-R on too: recompute each block in backward
    with_checkpointing["trainer"]["strategy"]["init_args"]["activation_checkpointing"] = True
    config.write_text(yaml.safe_dump(with_checkpointing))
    last = tmp_path / "checkpoints" / "gpt-zero3" / "last.ckpt"
    stopped = interrupt_in_second_save([sys.executable, str(EXAMPLES / "gpt.py"), "fit", "--config", str(config)],
                                       cwd=tmp_path)
    assert stopped.returncode == 1 and "Detected KeyboardInterrupt" in stopped.stdout, stopped.stdout[-3000:]
    assert "SIGINT received; every rank stopped" in stopped.stdout, stopped.stdout[-3000:]
    for broken in ("mismatch", "Traceback", "Aborted", "Fatal Python error"):
        assert broken not in stopped.stdout, stopped.stdout[-3000:]
    saved = json.loads(run(sys.executable, "-m", "lightning_zero", "inspect", str(last), "--json", cwd=tmp_path))
    assert saved["global_step"] == 4 and saved["world_size"] == 2  # the save the signal landed in completed

    resume_to = saved["global_step"] + 2
    resumed = run(sys.executable, str(EXAMPLES / "gpt.py"), "fit", "--config", str(config), "--trainer.devices", "3",
                  "--trainer.max_steps", str(resume_to), "--ckpt_path", str(last), "--trainer.enable_progress_bar",
                  "true", cwd=tmp_path)
    # the progress bar as the README describes it: resumed inside the epoch (batch 4 of 233 on 3 processes) it counts
    # on from the restored batch, against the steps left to max_steps less one (the walkthrough's resume, past the
    # end of a 3-process epoch, counts from 1 instead: measured 10/9 for 10 steps)
    assert "Epoch 0/-2 " in resumed and f" {resume_to}/{resume_to - saved['global_step'] - 1} " in resumed, resumed[-2000:]
    summary = json.loads(run(sys.executable, "-m", "lightning_zero", "inspect", str(last), "--json", cwd=tmp_path))
    assert (summary["world_size"], summary["stage"], summary["global_step"]) == (3, 3, resume_to)

    text = run(sys.executable, str(EXAMPLES / "generate.py"), str(last), "--prompt", "ROMEO:", "--tokens", "16",
               cwd=tmp_path)
    assert text.rstrip("\n") == plain_generate(last, "ROMEO:", 16), text


def plain_generate(checkpoint: Path, prompt: str, tokens: int) -> str:
    """What ``examples/generate.py`` prints by default, from a plain ``GPT`` given the checkpoint's full weights
    (``load_full_checkpoint``: the dict DDP would have saved) instead of ``load_from_checkpoint``."""
    import torch

    from examples.gpt import GPT

    full = lightning_zero.load_full_checkpoint(checkpoint, weights_only=True)
    model = GPT(**{k: v for k, v in full["hyper_parameters"].items() if not k.startswith("_")})  # not the CLI's
    model.load_state_dict(full["state_dict"])
    model.eval()
    return model.generate(prompt, tokens, temperature=0.8, top_k=40, generator=torch.Generator().manual_seed(0))


def interrupt_in_second_save(cmd: list[str], cwd: Path) -> subprocess.CompletedProcess:
    """Run ``cmd`` in its own process group and press Ctrl-C (SIGINT to the group) while rank 0 writes the second
    checkpoint event's first directory: a fault point sends it (see lightning_zero/process/faults.py), so where the signal
    lands never depends on timing."""
    log = cwd / "interrupted.log"
    fault = "point=save.written,signal=SIGINT,rank=0,target=group,occurrence=3"  # 2 writes per event: top-k, last
    code = run_in_own_session(cmd, dict(user_env(), LIGHTNING_ZERO_FAULT=fault), cwd, log, TIMEOUT)
    return subprocess.CompletedProcess(cmd, code, log.read_text(), "")


def test_gpt_configs_with_the_script_and_with_the_lightning_zero_command(tmp_path):
    # stage 1 by the script, stage 2 by `lightning-zero fit` (no script: the classes by import path, the repository
    # root on PYTHONPATH, the strategy names from the command); the shipped configs differ only in the stage, and
    # stages 1 and 2 do the same arithmetic in the same order, so from the config's seed both save the same weights
    for stage in (1, 2):
        (tmp_path / f"zero{stage}").mkdir()
    configs = {stage: tiny_config(stage, tmp_path / f"zero{stage}", max_steps=2) for stage in (1, 2)}
    run(sys.executable, str(EXAMPLES / "gpt.py"), "fit", "--config", str(configs[1]), cwd=tmp_path / "zero1")
    run(sys.executable, "-m", "lightning_zero", "fit", "--model", "examples.gpt.GPT", "--data",
        "examples.gpt.ShakespeareData", "--config", str(configs[2]), cwd=tmp_path / "zero2")
    saved = {stage: lightning_zero.load_full_checkpoint(
        tmp_path / f"zero{stage}" / "checkpoints" / f"gpt-zero{stage}" / "last.ckpt", weights_only=True)
        for stage in (1, 2)}
    assert saved[1]["global_step"] == saved[2]["global_step"] == 2
    assert saved[1]["hyper_parameters"]["n_embd"] == TINY_MODEL["n_embd"]
    assert_params_close(saved[2]["state_dict"], saved[1]["state_dict"], 1e-6)


def test_engine_example_under_torchrun_with_a_distributed_sampler(tmp_path):
    # torchrun starts 2 gloo ranks; the plain loop of the README's `ZeroEngine` section, then the Trainer's format
    out = run(sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
              str(EXAMPLES / "engine_gpt.py"), "--max-steps", "3", cwd=tmp_path)
    assert "step 2: loss" in out and "saved checkpoints/gpt-engine/last.ckpt" in out, out
    from examples.gpt import GPT  # what examples/generate.py does with it, in this process

    model = lightning_zero.load_from_checkpoint(GPT, tmp_path / "checkpoints" / "gpt-engine" / "last.ckpt")
    assert model.hparams.n_layer == 2 and model.generate("ROMEO:", 4).startswith("ROMEO:")
    # the Trainer resumes it as the example's docstring says: weights, optimizer states, and on from its step 3
    run(sys.executable, str(EXAMPLES / "gpt.py"), "fit", "--config", str(EXAMPLES / "configs" / "zero3.yaml"),
        "--model.n_layer", "2", "--model.dropout", "0", "--ckpt_path", "checkpoints/gpt-engine/last.ckpt",
        "--trainer.max_steps", "5", "--trainer.limit_val_batches", "1", "--trainer.enable_progress_bar", "false",
        cwd=tmp_path)
    resumed = json.loads(run(sys.executable, "-m", "lightning_zero", "inspect", "checkpoints/gpt-zero3/last.ckpt",
                             "--json", cwd=tmp_path))
    assert resumed["global_step"] == 5


def test_docs_engine_snippet_is_the_shipped_example():
    # every line of the docs' `ZeroEngine` snippet is a line of examples/engine_gpt.py, which the test above runs
    section = (ROOT / "docs" / "engine.md").read_text()
    snippet = section[section.index("```python") + len("```python"):section.index("```", section.index("```python") + 3)]
    example = {line.strip() for line in (EXAMPLES / "engine_gpt.py").read_text().splitlines()}
    lines = [line.strip() for line in snippet.splitlines() if line.strip() and line.strip() != "..."]
    assert len(lines) >= 10 and [line for line in lines if line not in example] == []


def test_manual_optimization_with_two_optimizers(tmp_path):
    out = run(sys.executable, str(EXAMPLES / "manual_optimization.py"), "--stage", "3", "--max-steps", "20",
              cwd=tmp_path)
    assert "distance of generated points to the circle" in out and "(zero3, 2 processes)" in out


def test_quick_start_demo(tmp_path):
    out = run(sys.executable, str(EXAMPLES / "train_tiny.py"), "--strategy", "zero2", "--devices", "2",
              "--max-steps", "4", cwd=tmp_path)
    # each rank prints its measured model states next to the formula in docs/stages.md: they agree within 5%
    figures = re.findall(r"\[rank (\d)\] .*? model states ([\d.]+) MiB \(formula ([\d.]+) MiB", out)
    assert sorted(rank for rank, _, _ in figures) == ["0", "1"], out
    for _, measured, formula in figures:
        assert abs(float(measured) - float(formula)) <= 0.05 * float(formula), out
    assert "after 4 steps with strategy=zero2 on 2 processes" in out, out


def test_fabric_example_saves_a_checkpoint_generate_reads(tmp_path):
    # Fabric's own launcher starts rank 1; zero3 built by fabric.init_module(); fabric.save in the Trainer's format
    out = run(sys.executable, str(EXAMPLES / "fabric_gpt.py"), "--max-steps", "3", "--accumulate", "1", cwd=tmp_path)
    assert "step 2: loss" in out and "saved checkpoints/gpt-fabric/last.ckpt" in out
    from examples.gpt import GPT  # what examples/generate.py does with it, in this process

    model = lightning_zero.load_from_checkpoint(GPT, tmp_path / "checkpoints" / "gpt-fabric" / "last.ckpt")
    assert model.hparams.n_layer == 2 and model.generate("ROMEO:", 4).startswith("ROMEO:")
