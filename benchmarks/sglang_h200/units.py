"""The units `ddtree deploy` would install for a config and its hosts, rendered without SSH,
with the command, environment and directory of each, for ``run.py start-units``.

    PYTHONPATH=<folder holding ddtree_cli> python3 units.py --config DEPLOY.yaml \\
        --inventory HOSTS.yaml [--group G] [--algo ddtree|dflash] [--python PY] --out units.json

A config with ``multinode`` gives one server unit per host, hosts in rank order (rank 0
first; only rank 0 serves HTTP). Otherwise each host gets a server unit (a replica) and, when
the config has a ``router``, the router's unit follows, its workers the replicas' URLs as
deploy computes them. Rendering and quoting are deploy's own (``ddtree_cli.deploy.units``); the
commands are read back from the rendered text, so what starts is what systemd would run.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ddtree_cli.deploy.config import DeployConfig, load_deploy_config, load_inventory
from ddtree_cli.deploy.host import DeployOptions, effective_algo, python_of, service_url, with_port
from ddtree_cli.deploy.units import (
    NodeRole,
    read_unit,
    render_router_unit,
    render_unit,
    router_unit_name,
    service_port,
)
from ddtree_cli.errors import DdtreeError
from ddtree_cli.remote.hostspec import HostSpec


def _local(host: str) -> str:
    return "127.0.0.1" if host in ("0.0.0.0", "::", "") else host


def _entry(name: str, role: str, host: str, text: str, health_url: str | None) -> dict:
    unit = read_unit(text)
    return {"name": name, "role": role, "host": host, "health_url": health_url,
            "argv": unit.argv, "env": unit.env, "working_directory": unit.working_directory,
            "environment_file": unit.environment_file, "unit": text}  # fmt: skip


def render(cfg: DeployConfig, hosts: list[HostSpec], opts: DeployOptions) -> list[dict]:
    algo, python = effective_algo(cfg, opts), python_of(cfg, opts)
    hosts = [with_port(h, opts) for h in hosts]
    mn = cfg.multinode
    if mn and len(hosts) != mn.nnodes:
        raise DdtreeError(f"multinode.nnodes is {mn.nnodes} but {len(hosts)} host(s) were given")
    units = []
    for rank, host in enumerate(hosts):
        node = NodeRole(rank, mn.nnodes, mn.dist_init_addr) if mn else None
        port = service_port(cfg, host)
        serves = node is None or rank == 0
        health = f"http://{_local(cfg.service_host)}:{port}/health" if serves else None
        role = f"rank{rank}" if node else "replica"
        units.append(_entry(f"{cfg.name}-{host.label}", role, host.label,
                            render_unit(cfg, host, algo, python, node), health))  # fmt: skip
    if cfg.router and not mn:
        workers = [service_url(cfg, h, None) for h in hosts]
        text = render_router_unit(cfg, cfg.router, workers, python)
        name = router_unit_name(cfg).removesuffix(".service")
        units.append(_entry(name, "router", cfg.router.host, text,
                            f"http://127.0.0.1:{cfg.router.port}/health"))  # fmt: skip
    return units


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", required=True)
    p.add_argument("--inventory", required=True)
    p.add_argument("--group")
    p.add_argument("--algo", choices=["dflash", "ddtree"])
    p.add_argument("--python", help="the interpreter in the units (default: remote.python)")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    try:
        cfg = load_deploy_config(args.config)
        hosts = load_inventory(args.inventory).select(args.group)
        opts = DeployOptions(algo=args.algo, remote_python=args.python)
        units = render(cfg, hosts, opts)
    except DdtreeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    Path(args.out).write_text(json.dumps({"config": str(cfg.path), "units": units}, indent=1))
    print(json.dumps([{k: u[k] for k in ("name", "role", "health_url")} for u in units]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
