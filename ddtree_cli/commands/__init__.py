"""Command modules: parse options, call the logic packages, print. One module per command.

Each module defines ``register(app)``; list it in ``REGISTERED`` (one line per command,
so parallel work on different commands does not collide).
"""

from __future__ import annotations

from collections.abc import Callable

import typer

REGISTERED: list[Callable[[typer.Typer], None]] = []
from ddtree_cli.commands.serve import register as _serve; REGISTERED.append(_serve)  # noqa: E402, E702, I001
from ddtree_cli.commands.bench import register as _bench; REGISTERED.append(_bench)  # noqa: E402, E702, I001
from ddtree_cli.commands.doctor import register as _doctor; REGISTERED.append(_doctor)  # noqa: E402, E702, I001
from ddtree_cli.commands.patch import register as _patch; REGISTERED.append(_patch)  # noqa: E402, E702, I001
from ddtree_cli.commands.deploy import register as _deploy; REGISTERED.append(_deploy)  # noqa: E402, E702, I001
