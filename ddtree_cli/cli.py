"""The Typer app. One sub-app per command, each in ``ddtree_cli/commands/``; no logic here."""

from __future__ import annotations

from typing import Annotated

import typer

from ddtree_cli import __version__

app = typer.Typer(
    name="ddtree",
    help="Patch, deploy, benchmark and diagnose DDTree speculative decoding on SGLang.",
    no_args_is_help=True,
    pretty_exceptions_show_locals=False,
    add_completion=False,
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"ddtree {__version__}")
        raise typer.Exit()


@app.callback()
def root(
    version: Annotated[
        bool,
        typer.Option(
            "--version", callback=_version, is_eager=True, help="Print the version and exit."
        ),
    ] = False,
) -> None:
    """Patch, deploy, benchmark and diagnose DDTree speculative decoding on SGLang."""


def _register() -> None:
    # Each command module exposes `register(app)`; add one line per command.
    from ddtree_cli.commands import REGISTERED

    for register in REGISTERED:
        register(app)


_register()
