"""Options shared across commands, declared once so flags and help stay consistent."""

from __future__ import annotations

from typing import Annotated

import typer

JsonOpt = Annotated[
    bool, typer.Option("--json", help="Print one JSON object on stdout and nothing else there.")
]
DryRunOpt = Annotated[
    bool, typer.Option("--dry-run", help="Show what would change; change nothing.")
]
