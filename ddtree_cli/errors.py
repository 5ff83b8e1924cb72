"""The project's one error type, and the exit codes the CLI turns errors into.

Errors a user can act on are raised as :class:`DdtreeError` (or a subclass) carrying a
one-line message and an optional hint. The CLI prints them as one red line on stderr and
exits with the error's code; anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

from enum import IntEnum


class ExitCode(IntEnum):
    OK = 0
    FAILURE = 1
    USAGE = 2
    CONFIG = 3
    REMOTE = 4
    CHECK_FAILED = 5
    INTERRUPTED = 130


class DdtreeError(Exception):
    """A problem the user can fix; shown as one line (plus a hint), never a traceback."""

    exit_code: ExitCode = ExitCode.FAILURE

    def __init__(self, message: str, *, hint: str | None = None, exit_code: int | None = None):
        super().__init__(message)
        self.message = message
        self.hint = hint
        if exit_code is not None:
            self.exit_code = ExitCode(exit_code)

    def __str__(self) -> str:
        return self.message


class ConfigError(DdtreeError):
    """Invalid configuration or input file (YAML, inventory, arguments)."""

    exit_code = ExitCode.CONFIG


class RemoteError(DdtreeError):
    """A remote host could not be reached or refused us (SSH, host key, sudo)."""

    exit_code = ExitCode.REMOTE
