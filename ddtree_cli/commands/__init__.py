"""Command modules: parse options, call the logic packages, print. One module per command.

Each module defines ``register(app)``; ``REGISTERED`` lists them in the order ``--help``
shows them.
"""

from __future__ import annotations

from collections.abc import Callable

import typer

from ddtree_cli.commands.bench import register as _bench
from ddtree_cli.commands.deploy import register as _deploy
from ddtree_cli.commands.doctor import register as _doctor
from ddtree_cli.commands.patch import register as _patch
from ddtree_cli.commands.serve import register as _serve

REGISTERED: list[Callable[[typer.Typer], None]] = [_patch, _deploy, _bench, _doctor, _serve]
