"""Console-script entry point: runs the app and turns project errors into one line + exit code."""

from __future__ import annotations

import os
import sys

from ddtree_cli.errors import DdtreeError, ExitCode


def main(argv: list[str] | None = None) -> None:
    from ddtree_cli.cli import app
    from ddtree_cli.console import error

    try:
        # Standalone mode: click handles --help, usage errors (exit 2) and typer.Exit itself.
        app(args=argv, prog_name="ddtree")
    except DdtreeError as exc:
        if os.environ.get("DDTREE_DEBUG"):
            raise
        error(exc.message, exc.hint)
        sys.exit(int(exc.exit_code))
    except KeyboardInterrupt:
        error("interrupted")
        sys.exit(int(ExitCode.INTERRUPTED))


if __name__ == "__main__":
    main()
