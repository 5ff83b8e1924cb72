"""Optional dependencies ("extras"): which command needs which, and the one-line refusal.

A plain install runs ``patch``, ``deploy``, ``doctor`` and ``bench --url``/``--host``. The
embedded engine (``serve``, the embedded bench, export, training) needs the ``engine`` extra
(torch, safetensors); the bench's PNG plots need the ``plots`` extra (matplotlib).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

from ddtree_cli.errors import DdtreeError, ExitCode

PACKAGE = "ddtree-cli"


@dataclass(frozen=True)
class Extra:
    name: str
    modules: tuple[str, ...]  # import names
    distributions: tuple[str, ...]  # what pip/pipx install

    def missing(self) -> list[str]:
        return [m for m in self.modules if importlib.util.find_spec(m) is None]

    def install_line(self) -> str:
        return (
            f"pip install '{PACKAGE}[{self.name}]' "
            f"(pipx: pipx inject {PACKAGE} {' '.join(self.distributions)})"
        )


ENGINE = Extra("engine", ("torch", "safetensors"), ("torch", "safetensors"))
PLOTS = Extra("plots", ("matplotlib",), ("matplotlib",))


class MissingExtraError(DdtreeError):
    """A command needs an optional dependency that is not installed."""

    exit_code = ExitCode.CONFIG


def require(extra: Extra, what: str) -> None:
    """Raise one line naming the install command when ``extra`` is not importable."""
    missing = extra.missing()
    if missing:
        raise MissingExtraError(
            f"{what} needs the {extra.name} extra ({', '.join(missing)} not installed): "
            f"{extra.install_line()}"
        )
