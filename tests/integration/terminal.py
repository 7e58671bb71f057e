"""Commands started as a terminal starts its foreground command, for tests that stop them with Ctrl+C (SIGINT).

A suite started in the background (`make test &`, `nohup`) runs with SIGINT ignored, and every process it starts
inherits that; Python then installs no KeyboardInterrupt handler, and the command never sees the Ctrl+C. A
terminal's foreground command has SIGINT at its default action: this wrapper restores it, then execs the command
(exec keeps a default action, as it would have kept the ignore)."""

from __future__ import annotations

import sys

_EXEC_WITH_SIGINT = ("import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); "
                     "os.execv(sys.argv[1], sys.argv[1:])")


def from_a_terminal(command: list[str]) -> list[str]:
    """`command` (its program by path) run with SIGINT's default action; same process, same argv."""
    return [sys.executable, "-c", _EXEC_WITH_SIGINT, *command]
