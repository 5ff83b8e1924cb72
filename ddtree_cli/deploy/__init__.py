"""``ddtree deploy``: ship a snapshot to GPU hosts as a systemd service, health-gated.

config.py     the deploy YAML and host inventories (no paramiko: reading YAML connects nothing)
units.py      the systemd units and env file, rendered from the config (pure)
sync.py       content-hash manifests and incremental, atomic release sync
              (release_helper.py is the stdlib script that runs on the host)
preflight.py  host facts judged before anything is synced
systemd.py    operating a unit on a host: its files, systemctl, state, journal
readiness.py  /health, then a canary /generate
host.py       one host's deploy, with rollback when the new release does not serve
fleet.py      many hosts in parallel, the router in front of them, multi-node servers
rollback_status.py  --rollback and --status
report.py     what each host reports: a HostStatus and the facts behind it

The entry points (``deploy``, ``rollback``, ``status``, ``DeployOptions``) are attributes
of this package, imported on first use so that ``ddtree_cli.deploy.config`` stays light.
"""

from __future__ import annotations

import importlib

_ENTRY_POINTS = {
    "deploy": "ddtree_cli.deploy.fleet",
    "rollback": "ddtree_cli.deploy.rollback_status",
    "status": "ddtree_cli.deploy.rollback_status",
    "DeployOptions": "ddtree_cli.deploy.host",
    "HostReport": "ddtree_cli.deploy.report",
    "HostStatus": "ddtree_cli.deploy.report",
}


def __getattr__(name: str):
    if name in _ENTRY_POINTS:
        return getattr(importlib.import_module(_ENTRY_POINTS[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
