"""Options shared across commands, declared once so flags and help stay consistent.

Short flags follow OpenSSH where it has one: ``-i`` is the identity (private key) file, as in
``ssh -i``; ``-H`` a host, ``-I`` the inventory, ``-g`` its group.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

JsonOpt = Annotated[
    bool, typer.Option("--json", help="Print one JSON object on stdout and nothing else there.")
]
DryRunOpt = Annotated[
    bool, typer.Option("--dry-run", help="Show what would change; change nothing.")
]

# The SSH side: deploy, doctor and bench --host reach hosts the same way.
HostsOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--host", "-H", help="[USER@]HOST[:PORT] or an ~/.ssh/config alias; repeat for several."
    ),
]
InventoryOpt = Annotated[
    Path | None, typer.Option("--inventory", "-I", help="Inventory YAML of hosts and groups.")
]
GroupOpt = Annotated[
    str | None, typer.Option("--group", "-g", help="Only this inventory group (needs --inventory).")
]
IdentityOpt = Annotated[
    str | None,
    typer.Option(
        "--identity", "-i", help="SSH private key file (default: ssh config, agent, ~/.ssh/id_*)."
    ),
]
KnownHostsOpt = Annotated[
    str | None,
    typer.Option(
        "--known-hosts",
        help="known_hosts file to check against and record in (default ~/.ssh/known_hosts).",
    ),
]
SshConfigOpt = Annotated[
    str | None, typer.Option("--ssh-config", help="ssh config file (default ~/.ssh/config).")
]
AcceptNewHostKeyOpt = Annotated[
    bool,
    typer.Option(
        "--accept-new-host-key",
        help="Trust and record a host key seen for the first time (like OpenSSH's accept-new); "
        "a changed key is always refused.",
    ),
]
