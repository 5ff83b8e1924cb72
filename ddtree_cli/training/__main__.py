"""``python -m ddtree_cli.training``: refuses in one line without the engine extra."""

from __future__ import annotations

import sys

from ddtree_cli.errors import DdtreeError
from ddtree_cli.extras import ENGINE, require


def run() -> int:
    try:
        require(ENGINE, "python -m ddtree_cli.training")
    except DdtreeError as exc:
        print(f"Error: {exc.message}", file=sys.stderr)
        return int(exc.exit_code)
    from ddtree_cli.training.cli import main

    return main()


if __name__ == "__main__":
    sys.exit(run())
