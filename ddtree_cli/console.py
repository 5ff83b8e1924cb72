"""Console helpers: stdout carries results (tables, or one JSON object), stderr the rest.

Only command modules (``ddtree_cli/commands/``) import this; the logic packages stay free
of Rich so they can be used and tested without a terminal.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from enum import Enum
from pathlib import Path, PurePath
from typing import Any

from rich.console import Console
from rich.markup import escape

console = Console(highlight=False)
# soft_wrap: an error stays one line when stderr is a pipe or a log file.
err_console = Console(stderr=True, highlight=False, soft_wrap=True)

STATUS_STYLE = {
    "pass": "[green]pass[/]",
    "ok": "[green]ok[/]",
    "warn": "[yellow]warn[/]",
    "fail": "[red]fail[/]",
    "skip": "[dim]skip[/]",
}


def _jsonable(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {k: _jsonable(v) for k, v in dataclasses.asdict(obj).items()}
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple, set, frozenset)):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, Enum):
        return obj.value
    if isinstance(obj, (Path, PurePath)):
        return str(obj)
    if hasattr(obj, "to_json"):
        return _jsonable(obj.to_json())
    return obj


def to_json(obj: Any) -> str:
    """Serialise dataclasses, enums, paths and containers to a JSON string."""
    return json.dumps(_jsonable(obj), indent=2, sort_keys=False, default=str)


def emit_json(obj: Any) -> None:
    """Write exactly one JSON object to stdout (the ``--json`` contract)."""
    sys.stdout.write(to_json(obj) + "\n")
    sys.stdout.flush()


def error(message: str, hint: str | None = None) -> None:
    err_console.print(f"[red]Error:[/] {escape(message)}")
    if hint:
        err_console.print(f"[dim]Hint: {escape(hint)}[/]")


def warn(message: str) -> None:
    err_console.print(f"[yellow]Warning:[/] {escape(message)}")


def info(message: str) -> None:
    err_console.print(escape(message))
