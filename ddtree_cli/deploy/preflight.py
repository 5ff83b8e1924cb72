"""Preflight: one round trip of host facts, judged before anything is synced.

The facts are collected as the user the service will run as, so they are the interpreter,
files and permissions the service will see; the verdicts are doctor's ABI rules plus the
deploy-specific ones (disk for a release, systemd, the port).
"""

from __future__ import annotations

import re
from pathlib import Path

from ddtree_cli.abi import SnapshotABI, run_abi_checks
from ddtree_cli.checkpoints import check_draft_layers, launch_checkpoints
from ddtree_cli.deploy.config import DeployConfig
from ddtree_cli.deploy.report import PreflightRow
from ddtree_cli.deploy.sync import Manifest
from ddtree_cli.deploy.units import service_port
from ddtree_cli.remote import facts as host_facts
from ddtree_cli.remote.hostspec import HostSpec
from ddtree_cli.remote.ssh import Connection

GPU_CHECK_PREFIXES = ("gpu.", "cuda.", "torch.cuda", "flashinfer.", "sglang.")


def snapshot_abi(source: Path, manifest: Manifest) -> SnapshotABI:
    """What the synced tree needs from the interpreter: compiled modules' tags, dist-info."""
    compiled = []
    for path in manifest:
        m = re.search(r"\.cpython-(\d+)(t?)-[^/]*\.so$", path)
        if m:
            compiled.append((path, f"cp{m.group(1)}{m.group(2)}"))
        elif path.endswith(".abi3.so"):
            compiled.append((path, "abi3"))
    version = requires = None
    tags: list[str] = []
    for path in manifest:
        if re.fullmatch(r"sglang-[^/]+\.dist-info/METADATA", path):
            for line in (source / path).read_text(errors="replace").splitlines():
                if line.startswith("Version: "):
                    version = line.split(": ", 1)[1].strip()
                elif line.startswith("Requires-Python: "):
                    requires = line.split(": ", 1)[1].strip()
                elif not line:
                    break
        elif re.fullmatch(r"sglang-[^/]+\.dist-info/WHEEL", path):
            tags = [line.split(": ", 1)[1].strip()
                    for line in (source / path).read_text(errors="replace").splitlines()
                    if line.startswith("Tag: ")]
    return SnapshotABI(version=version, requires_python=requires, compiled=compiled,
                       wheel_tags=tags)


def fmt_bytes(n: int) -> str:
    return f"{n / 1e6:.1f} MB" if n >= 100_000 else f"{n / 1e3:.1f} KB"


class _AsServiceUser:
    """Runs commands as the user the service will run as (root unless ``remote.user``), so
    preflight sees the interpreter, files and permissions the service will see."""

    def __init__(self, conn: Connection, user: str | None):
        self.conn = conn
        self.user = user

    def run(self, argv, stdin=None, timeout=None):
        if self.user and self.user != self.conn.user:
            return self.conn.run(["sudo", "-n", "-u", self.user, "--", *argv], stdin=stdin,
                                 timeout=timeout)
        return self.conn.run(argv, stdin=stdin, timeout=timeout, sudo=self.user is None)


def preflight(conn: Connection, cfg: DeployConfig, host: HostSpec, python: str,
              manifest: Manifest) -> list[PreflightRow]:
    port = service_port(cfg, host)
    facts = host_facts.collect_remote(_AsServiceUser(conn, cfg.user), python=python,
                                      unit=cfg.unit_name, ports=[port],
                                      disk_paths=[cfg.remote_dir], probes=cfg.preflight_gpu,
                                      timeout=90, checkpoints=launch_checkpoints(cfg.launch))
    rows = []
    verdicts = run_abi_checks(facts, snapshot_abi(cfg.source, manifest))
    # A draft SGLang cannot feed would pass every other check and fail the first request.
    verdicts.append(check_draft_layers(facts))
    for verdict in verdicts:
        if not cfg.preflight_gpu and verdict.id.startswith(GPU_CHECK_PREFIXES):
            continue
        rows.append(PreflightRow.of(verdict))
    need = int(sum(entry[1] for entry in manifest.values()) * 1.2) + 200_000_000
    disks = facts.get("disk") or []
    target = next((d for d in disks if d.get("path") == cfg.remote_dir), disks[0] if disks else None)
    if target is None:
        rows.append(PreflightRow("disk.free", "warn", "free space unknown"))
    elif target["free_bytes"] < need:
        rows.append(PreflightRow("disk.free", "fail",
                                 f"{fmt_bytes(target['free_bytes'])} free under {cfg.remote_dir}, "
                                 f"a release needs about {fmt_bytes(need)}",
                                 "free space on the host or lower remote.keep_releases"))
    else:
        rows.append(PreflightRow("disk.free", "pass",
                                 f"{fmt_bytes(target['free_bytes'])} free under {cfg.remote_dir}"))
    systemd = facts.get("systemd") or {}
    rows.append(PreflightRow("systemd", "pass" if systemd.get("present") else "fail",
                             "systemd is running" if systemd.get("present")
                             else systemd.get("error") or "systemd not found",
                             "" if systemd.get("present") else "deploy to a host booted with systemd"))
    ours = (systemd.get("properties") or {}).get("ActiveState") == "active"
    port_fact = next((p for p in facts.get("ports") or [] if p.get("port") == port), {})
    if port_fact.get("listening") and not ours:
        owner = "; ".join(port_fact.get("processes") or []) or "another process"
        rows.append(PreflightRow("port.free", "fail", f"port {port} is taken by {owner[:120]}",
                                 "stop that process or set server.port / --port"))
    else:
        detail = f"port {port} held by {cfg.unit_name} (will restart)" if port_fact.get(
            "listening") else f"port {port} is free"
        rows.append(PreflightRow("port.free", "pass", detail))
    return rows
