"""Errors meant for the person at the terminal.

A ``UserError`` is a mistake in what the user asked for (a bad key, a missing file, an output dir
that exists). The CLI prints its message as one line and exits with code 2, without a traceback.
Anything else is a bug and keeps its traceback.
"""

from __future__ import annotations


class UserError(Exception):
    """A one-line, actionable error caused by user input. Exit code 2."""

    exit_code = 2


class ConfigError(UserError):
    """A bad configuration value, named by its dotted key (``zenflow.topk_ratio``)."""

    def __init__(self, key: str, value: object, fix: str) -> None:
        self.key, self.value, self.fix = key, value, fix
        super().__init__(f"{key}={value!r}: {fix}")


class RunFailed(UserError):
    """A run that started stopped for a reason outside the command line: the loss diverged, the
    disk filled up, a write failed. One line saying what and what to do, exit code 1 (code 2 stays
    "your command was refused before anything ran")."""

    exit_code = 1
