"""The project's one error type, and the exit codes the CLI turns errors into.

Errors a user can act on are raised as :class:`DdtreeError` (or a subclass) carrying a
one-line message and an optional hint. The CLI prints them as one red line on stderr and
exits with the error's code; anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

from enum import IntEnum


class ExitCode(IntEnum):
    """The exit codes of every command (the table in the README)."""

    OK = 0
    FAILURE = 1  # the work itself failed: a host did not deploy, a bench run stopped
    USAGE = 2  # an unknown option, a bad value, options that do not go together
    CONFIG = 3  # an input that cannot be used (YAML, inventory, dataset, folder), a missing extra
    REMOTE = 4  # a host cannot be reached, or refused us (host key, auth, sudo)
    CHECK_FAILED = 5  # a check ran and failed: doctor, patch --check, bench's lossless/confounds
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


class UsageError(DdtreeError):
    """Options that cannot be used as given (like click's own usage errors: exit 2)."""

    exit_code = ExitCode.USAGE


class ConfigError(DdtreeError):
    """Invalid configuration or input file (YAML, inventory, arguments)."""

    exit_code = ExitCode.CONFIG


class RemoteError(DdtreeError):
    """A remote host could not be reached or refused us (SSH, host key, sudo)."""

    exit_code = ExitCode.REMOTE
