"""A stand-in for a collective's work handle in single-process unit tests: its ``wait`` is written to a log."""

from __future__ import annotations


class LoggedWork:
    """A work handle whose ``wait()`` appends ``"wait"`` to ``log`` (the order of waits is what tests check)."""

    def __init__(self, log: list[str]) -> None:
        self.log = log

    def wait(self) -> None:
        self.log.append("wait")
