"""The test zygote (lightning_zero/testing/zygote.py) runs a script the way ``python script.py`` would: these are the behaviours the
multi-process tests rely on."""

from __future__ import annotations

import os
import signal
from pathlib import Path

from lightning_zero.testing.zygote import ZYGOTE

SCRIPT = """
import atexit, os, sys, threading, time
atexit.register(lambda: print("atexit ran", flush=True))
threading.Thread(target=lambda: (time.sleep(0.3), print("thread joined", flush=True))).start()
print(sys.argv[1:], os.getcwd(), os.environ.get("ONLY_HERE"), os.environ.get("HOME"), __name__, sep="|")
print("to stderr", file=sys.stderr)
mode = sys.argv[1]
if mode == "exit3":
    sys.exit(3)
if mode == "ctrl-c":
    raise KeyboardInterrupt
if mode == "error":
    raise ValueError("boom")
"""


def run(tmp_path: Path, mode: str, session: bool = False) -> tuple[int, str, str]:
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    out, err = tmp_path / f"{mode}.out", tmp_path / f"{mode}.err"
    child = ZYGOTE.spawn([str(script), mode], {"ONLY_HERE": "1", "PATH": os.environ["PATH"]}, tmp_path, out, err,
                         session=session)
    code = child.wait(timeout=60)
    return code, out.read_text(), err.read_text()


def test_a_script_runs_as_main_with_its_own_argv_environment_and_directory(tmp_path):
    code, out, err = run(tmp_path, "ok")
    assert code == 0, err
    assert out.splitlines()[0] == f"['ok']|{tmp_path}|1|None|__main__"  # the environment is replaced, not merged
    assert "thread joined" in out and out.rstrip().endswith("atexit ran")  # the interpreter's exit: threads, atexit
    assert err == "to stderr\n"


def test_exit_codes_come_back_as_subprocess_gives_them(tmp_path):
    assert run(tmp_path, "exit3")[0] == 3
    code, _, err = run(tmp_path, "error")
    assert code == 1 and "ValueError: boom" in err
    code, _, err = run(tmp_path, "ctrl-c", session=True)  # an uncaught Ctrl-C ends the process by SIGINT
    assert code == -signal.SIGINT and "KeyboardInterrupt" in err


def test_a_session_child_leads_its_own_process_group(tmp_path):
    script = tmp_path / "group.py"
    script.write_text("import os\nprint(os.getpgrp() == os.getpid(), os.getsid(0) == os.getpid())\n")
    for session, expected in ((True, "True True"), (False, "False False")):
        out = tmp_path / f"group-{session}.out"
        child = ZYGOTE.spawn([str(script)], {"PATH": os.environ["PATH"]}, tmp_path, out, session=session)
        assert child.wait(timeout=60) == 0
        assert out.read_text().strip() == expected
