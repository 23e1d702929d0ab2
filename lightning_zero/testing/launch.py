"""Run a worker script on N gloo ranks on this machine, the way torchrun would, with a hard timeout.

Each rank is a separate process with ``RANK``/``LOCAL_RANK``/``WORLD_SIZE``/``MASTER_*`` set, so Lightning sees an
externally launched job and does not start processes itself. The ranks are forked from a zygote that imported torch
and Lightning once (lightning_zero/testing/zygote.py), which saves the ~6 s those imports cost each process. A hung
collective fails the test after ``timeout`` seconds instead of eating CI's time.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from lightning_zero.checkpoints.trust import torch_load
from lightning_zero.testing.zygote import ZYGOTE, ZYGOTE_ENV, Child

ROOT = Path(__file__).resolve().parents[2]  # the repository (tests/ and benchmarks/ beside the package)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(
    script: str, world_size: int, out_dir: Path, args: tuple[str, ...] = (), finalize: bool = False
) -> list[Child]:
    """Start ``tests/workers/<script>`` on ``world_size`` ranks (logs in ``out_dir/rank<r>.log``); returns them.
    ``finalize``: each rank ends through the interpreter's own shutdown (see ``Zygote.spawn``)."""
    port = str(free_port())
    procs = []
    for rank in range(world_size):
        # ZYGOTE_ENV fixes glibc's mmap threshold: freed tensors go back to the OS, so resident memory tracks live
        # memory (the memory tests rely on it).
        env = dict(
            os.environ,
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=port,
            WORLD_SIZE=str(world_size),
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            NODE_RANK="0",
            PL_DISABLE_FORK="1",
            **ZYGOTE_ENV,
        )
        procs.append(
            ZYGOTE.spawn(
                [str(ROOT / "tests" / "workers" / script), str(out_dir), *args],
                env,
                out_dir,
                out_dir / f"rank{rank}.log",
                finalize=finalize,
            )
        )
    return procs


def launch(script: str, world_size: int, out_dir: Path, args: tuple[str, ...] = (), timeout: float = 300) -> list[Any]:
    """Run ``tests/workers/<script>`` on ``world_size`` ranks; return what each rank saved to ``out_dir/rank{r}.pt``."""
    procs = start(script, world_size, out_dir, args)
    deadline = time.monotonic() + timeout
    try:
        for p in procs:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        raise AssertionError(
            f"{script} on {world_size} ranks did not finish in {timeout}s:\n{_tail(out_dir)}"
        ) from None
    finally:
        for p in procs:
            p.kill()
            p.wait()
    codes = [p.returncode for p in procs]
    if any(codes):
        raise AssertionError(f"{script} on {world_size} ranks failed with exit codes {codes}:\n{_tail(out_dir)}")
    # the reports the workers of this test run wrote: trusted (they hold arbitrary results)
    return [torch_load(out_dir / f"rank{r}.pt", out_dir / f"rank{r}.pt", trusted=True) for r in range(world_size)]


def launch_nodes(script: str, nodes: int, out_dir: Path, timeout: float = 300) -> list[Any]:
    """Run ``tests/workers/<script>`` as a user runs a job of ``nodes`` nodes, on this machine: one launcher per node
    (``python script OUT`` with ``NODE_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT``, no rank variables), whose
    Lightning script launcher starts that node's other ranks; return what each global rank saved to
    ``out_dir/rank{r}.pt`` (the script sets ``num_nodes`` and ``devices``, and so the world size)."""
    port = str(free_port())
    launcher_vars = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "GROUP_RANK")
    base = {k: v for k, v in os.environ.items() if k not in launcher_vars}
    base.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, PL_DISABLE_FORK="1", **ZYGOTE_ENV)
    procs = [
        ZYGOTE.spawn(
            [str(ROOT / "tests" / "workers" / script), str(out_dir)],
            dict(base, NODE_RANK=str(node)),
            ROOT,
            out_dir / f"node{node}.log",
            session=True,
        )
        for node in range(nodes)
    ]
    deadline = time.monotonic() + timeout
    try:
        codes = [p.wait(timeout=max(0.0, deadline - time.monotonic())) for p in procs]
    except subprocess.TimeoutExpired:
        raise AssertionError(
            f"{script} on {nodes} nodes did not finish in {timeout}s:\n{_tail(out_dir, 'node')}"
        ) from None
    finally:
        for p in procs:  # each launcher leads its session: the node's ranks Lightning started go with it
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    if any(codes):
        raise AssertionError(f"{script} on {nodes} nodes failed with exit codes {codes}:\n{_tail(out_dir, 'node')}")
    return [
        torch_load(path, path, trusted=True)  # the reports of this test run's workers
        for path in sorted(out_dir.glob("rank*.pt"), key=lambda p: int(p.stem[4:]))
    ]


def wait_all(procs: list[Any], timeout: float) -> list[int]:
    """Wait for every process (``TimeoutExpired`` past ``timeout`` seconds in all), then make sure none is left."""
    deadline = time.monotonic() + timeout
    try:
        return [p.wait(timeout=max(0.0, deadline - time.monotonic())) for p in procs]
    finally:
        for p in procs:
            p.kill()
            p.wait()


def run_in_own_session(cmd: list[str], env: dict[str, str], cwd: Path, log: Path, timeout: float) -> int:
    """Run ``cmd`` (``[sys.executable, ...]``: a user's launch, where Lightning starts the other ranks as its
    children) in a session and process group of its own, so that a signal to the group reaches this run only, as
    Ctrl-C reaches a terminal's foreground job. The first process is forked from the zygote
    (lightning_zero/testing/zygote.py); Lightning's ranks are fresh ``python`` processes. Returns the exit code; on a
    hang every process prints where it is stuck (SIGABRT with ``PYTHONFAULTHANDLER``) and it fails.
    """
    assert cmd[0] == sys.executable, cmd
    # SIGINT as in a terminal's foreground job: the zygote's children start with Python's own handler for it
    proc = ZYGOTE.spawn(cmd[1:], dict(env, PYTHONFAULTHANDLER="1"), cwd, log, session=True)
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGABRT)
        time.sleep(5)
        raise AssertionError(f"{' '.join(cmd)} did not end in {timeout}s:\n{log.read_text()[-8000:]}") from None
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _tail(out_dir: Path, prefix: str = "rank", lines: int = 60) -> str:
    parts = []
    for log in sorted(out_dir.glob(f"{prefix}*.log")):
        text = log.read_text().splitlines()
        parts.append(f"--- {log.name}\n" + "\n".join(text[-lines:]))
    return "\n".join(parts)
