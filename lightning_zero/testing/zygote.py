"""A zygote: one Python process that imports torch, Lightning and lightning_zero once, then forks a fresh process
for each rank a test launches, so a launch costs a fork instead of the ~6 s those imports take on the CI machine.

[Note: a forked rank is a fresh rank]
The zygote imports and never computes: no tensor op, no thread pool, no process group, so a fork carries nothing
but imported modules (module-level state as import leaves it). The child then does what ``python script.py`` would:
the test's environment replaces ``os.environ``, the working directory, ``sys.argv`` and ``sys.path[0]`` are the
script's, stdout and stderr go to files, the script (or ``-m`` module) runs as ``__main__`` (``runpy``), and it ends
as the interpreter would (threads joined, ``atexit`` run, an uncaught Ctrl-C re-raised as SIGINT); its exit code (or
``-signal``) comes back like a ``subprocess`` return code. Processes it starts itself (Lightning's launcher starting
the other ranks) are ordinary ``python`` processes. Variables read only once at process start (glibc's
``MALLOC_MMAP_THRESHOLD_``, ``PYTHONPATH``, ``OMP_NUM_THREADS``) are the ones the zygote itself starts with
(``ZYGOTE_ENV``), equal to what ``lightning_zero.testing.launch`` gives every rank; anything else lightning_zero
reads from the environment, it reads when used, not at import.

Protocol on the zygote's stdin/stdout, one JSON object per line: ``{"argv", "env", "cwd", "stdout", "stderr",
"session", "group"}`` in, ``{"pid"}`` out; then ``{"pid", "code"}`` when that child ends (the zygote reaps its children,
the test cannot).
"""

from __future__ import annotations

import atexit
import json
import os
import select
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional

ROOT = Path(__file__).resolve().parents[2]  # the repository (tests/ and benchmarks/ beside the package)
ZYGOTE_ENV = {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "MALLOC_MMAP_THRESHOLD_": "131072"}


class Lines:
    """Whole lines from a file descriptor, with a timeout (a buffered reader would hide lines from ``select``)."""

    def __init__(self, fd: int) -> None:
        self.fd, self.buffer, self.eof = fd, b"", False

    def next(self, timeout: Optional[float]) -> Optional[bytes]:
        """The next line (``b""`` at end of input), or None if none came within ``timeout`` seconds."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while b"\n" not in self.buffer and not self.eof:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not select.select([self.fd], [], [], left)[0]:
                return None
            chunk = os.read(self.fd, 1 << 16)
            self.buffer += chunk
            self.eof = not chunk
        if b"\n" not in self.buffer:
            return b""
        line, self.buffer = self.buffer.split(b"\n", 1)
        return line + b"\n"


class Child:
    """A rank forked by the zygote, with the part of ``subprocess.Popen``'s interface the tests use."""

    def __init__(self, zygote: "Zygote", pid: int) -> None:
        self.zygote, self.pid, self.returncode = zygote, pid, None

    def poll(self) -> Optional[int]:
        self.zygote.collect(timeout=0)
        return self.returncode

    def wait(self, timeout: Optional[float] = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.returncode is None:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired(f"rank pid {self.pid}", timeout or 0.0)  # timeout is set here
            self.zygote.collect(timeout=1.0 if left is None else min(left, 1.0))
        return self.returncode

    def kill(self) -> None:
        if self.returncode is None:
            try:
                os.kill(self.pid, 9)
            except ProcessLookupError:
                pass


class Zygote:
    """The test side: starts the zygote process on first use and asks it for ranks."""

    def __init__(self) -> None:
        self.proc: Optional[subprocess.Popen] = None
        self.lines: Optional[Lines] = None
        self.children: dict[int, Child] = {}

    def spawn(
        self,
        argv: list[str],
        env: dict[str, str],
        cwd: Path,
        stdout: Path,
        stderr: Optional[Path] = None,
        session: bool = False,
        group: Optional[int] = None,
        finalize: bool = False,
    ) -> Child:
        """Fork a process that runs like ``python *argv`` (``argv``: a script and its arguments, or ``-m``, a module
        and its arguments) with ``env`` as its whole environment, in ``cwd``, writing to ``stdout`` (and ``stderr``,
        the same file if not given); ``session``: in a session and process group of its own, as
        ``start_new_session`` would do; ``group``: in the process group whose leader is ``group`` (``0``: a new one it
        leads), as the tasks of one ``srun`` job step share one; ``finalize``: a script that returns ends through the
        interpreter's own shutdown (module teardown, C++ static destructors: where a native thread left alive aborts
        the process) instead of ``os._exit`` after the same steps (see [Note: a forked rank is a fresh rank])."""
        proc = self._running()
        request = {
            "argv": argv,
            "env": env,
            "cwd": str(cwd),
            "stdout": str(stdout),
            "stderr": str(stderr or stdout),
            "session": session,
            "group": group,
            "finalize": finalize,
        }
        assert proc.stdin is not None
        proc.stdin.write(json.dumps(request) + "\n")
        proc.stdin.flush()
        while True:  # the answer to this request; exits of earlier children may come first
            message = self._read(timeout=300)
            if message is None:
                raise RuntimeError("the test zygote did not answer in 300 s")
            if "code" not in message:
                child = self.children[message["pid"]] = Child(self, message["pid"])
                return child
            self._ended(message)

    def collect(self, timeout: float) -> None:
        """Take the exits the zygote reported, waiting up to ``timeout`` seconds for the first."""
        message = self._read(timeout)
        while message is not None:
            self._ended(message)
            message = self._read(0)

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            assert self.proc.stdin is not None  # made with stdin=PIPE
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()

    def _running(self) -> subprocess.Popen:
        if self.proc is None or self.proc.poll() is not None:
            self.proc = subprocess.Popen(
                [sys.executable, str(Path(__file__))],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
                cwd=ROOT,
                env=dict(os.environ, **ZYGOTE_ENV),
            )
            assert self.proc.stdout is not None  # made with stdout=PIPE
            self.lines = Lines(self.proc.stdout.fileno())
            self.children.clear()
        return self.proc

    def _read(self, timeout: float) -> Optional[dict[str, Any]]:
        assert self.proc is not None and self.lines is not None
        line = self.lines.next(timeout)
        if line is None:
            return None
        if not line:
            raise RuntimeError(f"the test zygote exited with code {self.proc.wait()}")
        return json.loads(line)

    def _ended(self, message: dict[str, Any]) -> None:
        child = self.children.pop(message["pid"], None)
        if child is not None:
            child.returncode = message["code"]


# [Note: one zygote per test process]
# The zygote exists to pay torch's and Lightning's imports once per test session, so it is one per process by
# purpose; it is started lazily by the first launch and closed at exit.
ZYGOTE = Zygote()
if __name__ != "__main__":
    atexit.register(ZYGOTE.close)


class _Finalize(BaseException):
    """Raised in a child whose script returned and whose request asks for the interpreter's own shutdown."""


def _run_child(request: dict[str, Any]) -> None:
    """In the forked child: become ``python *argv`` and run it; exit as that would (never returns)."""
    import signal

    code = 1
    try:
        if request["session"]:
            os.setsid()
        elif request["group"] is not None:
            _join_group(0, request["group"])
        # Ctrl-C raises KeyboardInterrupt, as in a Python started from a terminal, even if the test run ignores
        # SIGINT (a job in the background of a non-interactive shell does, and the zygote inherited that)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        os.environ.clear()
        os.environ.update(request["env"])
        os.chdir(request["cwd"])
        _redirect(request["stdout"], request["stderr"])
        if os.environ.get("PYTHONFAULTHANDLER"):
            import faulthandler

            faulthandler.enable()
        _run_argv(request["argv"])
        code = 0
        if request.get("finalize"):
            raise _Finalize
    except _Finalize:
        raise SystemExit(0) from None  # out of the zygote's loop: the interpreter ends as `python script.py` does
    except SystemExit as stop:
        if isinstance(stop.code, int) or stop.code is None:
            code = stop.code or 0
        else:
            print(stop.code, file=sys.stderr)
    except KeyboardInterrupt:  # as Python does: the traceback, then death by SIGINT
        import traceback

        traceback.print_exc()
        _finish()
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    except BaseException:  # as Python does: the interpreter's excepthook reports it (a script's own, if it set one)
        sys.excepthook(*sys.exc_info())
    _finish()
    os._exit(code)


def _redirect(stdout: str, stderr: str) -> None:
    """stdin from /dev/null, stdout and stderr to the given files (one file if they are the same)."""
    nothing = os.open(os.devnull, os.O_RDONLY)
    os.dup2(nothing, 0)
    os.close(nothing)
    for fd, path in ((1, stdout), (2, stderr)):
        if fd == 2 and stderr == stdout:
            os.dup2(1, 2)
            continue
        out = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(out, fd)
        os.close(out)


def _run_argv(argv: list[str]) -> None:
    """``python *argv`` minus the interpreter's start: the script (or ``-m`` module) as ``__main__``."""
    import runpy

    if argv[0] == "-m":
        sys.argv = [argv[1], *argv[2:]]
        sys.path[0] = os.getcwd()
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = list(argv)
        sys.path[0] = str(Path(argv[0]).resolve().parent)
        runpy.run_path(argv[0], run_name="__main__")


def _finish() -> None:
    """What the interpreter does at exit: join non-daemon threads, run ``atexit`` functions, flush."""
    import threading

    getattr(threading, "_shutdown", lambda: None)()
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()


def _serve() -> None:
    """The zygote's loop: fork a child per request and report each child's exit, until stdin closes (the test run
    ended); then kill what is still running (a test that timed out leaves it) and exit."""
    import torch  # noqa: F401  (the imports every rank needs, done once; lightning_zero imports Lightning)

    import lightning_zero  # noqa: F401

    requests = Lines(0)
    live: dict[int, bool] = {}  # pid -> in a session of its own
    while (line := requests.next(0.2)) != b"":
        if line is not None:
            request = json.loads(line)
            pid = os.fork()
            if pid == 0:
                _run_child(request)
            if request["group"] is not None:  # here too, so that the group exists before the next request
                _join_group(pid, request["group"])
            live[pid] = request["session"] or request["group"] == 0
            _say({"pid": pid})
        for pid in list(live):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                del live[pid]
                _say({"pid": pid, "code": os.waitstatus_to_exitcode(status)})
    for pid, session in live.items():
        try:
            (os.killpg if session else os.kill)(pid, 9)
        except ProcessLookupError:
            pass
        os.waitpid(pid, 0)


def _join_group(pid: int, leader: int) -> None:
    """Put ``pid`` (0: this process) in the group led by ``leader`` (0: a new group that ``pid`` leads)."""
    try:
        os.setpgid(pid, leader)
    except (PermissionError, ProcessLookupError):  # the child already did it, or already exec'd/exited
        pass


def _say(message: dict[str, Any]) -> None:
    os.write(1, (json.dumps(message) + "\n").encode())


if __name__ == "__main__":
    sys.path[0] = str(ROOT)
    _serve()
