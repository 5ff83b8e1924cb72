"""Preflight: one round trip of host facts, judged before anything is synced.

The facts are collected as the user the service will run as, so they are the interpreter,
files and permissions the service will see; the verdicts are doctor's ABI rules plus the
deploy-specific ones (disk for a release, systemd, the port).
"""

from __future__ import annotations

from ddtree_cli.deploy.config import DeployConfig
from ddtree_cli.deploy.sync import Manifest
from ddtree_cli.deploy.units import service_port
from ddtree_cli.doctor.checkpoints import check_draft_layers, launch_checkpoints
from ddtree_cli.doctor.compatibility import run_abi_checks
from ddtree_cli.doctor.snapshot_abi import read_snapshot_abi
from ddtree_cli.doctor.verdict import Verdict, failed, passed, warned
from ddtree_cli.remote import facts as host_facts
from ddtree_cli.remote.hostspec import HostSpec
from ddtree_cli.remote.ssh import Connection

GPU_CHECK_PREFIXES = ("gpu.", "cuda.", "torch.cuda", "flashinfer.", "sglang.")


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
            return self.conn.run(
                ["sudo", "-n", "-u", self.user, "--", *argv], stdin=stdin, timeout=timeout
            )
        return self.conn.run(argv, stdin=stdin, timeout=timeout, sudo=self.user is None)


def preflight(
    conn: Connection, cfg: DeployConfig, host: HostSpec, python: str, manifest: Manifest
) -> list[Verdict]:
    port = service_port(cfg, host)
    facts = host_facts.collect_remote(
        _AsServiceUser(conn, cfg.user),
        python=python,
        unit=cfg.unit_name,
        ports=[port],
        disk_paths=[cfg.remote_dir],
        probes=cfg.preflight_gpu,
        timeout=90,
        checkpoints=launch_checkpoints(cfg.launch),
    )
    rows = []
    # The ABI of exactly what will be shipped: the synced tree's files, read by doctor's reader.
    verdicts = run_abi_checks(facts, read_snapshot_abi(cfg.source, manifest))
    # A draft SGLang cannot feed would pass every other check and fail the first request.
    verdicts.append(check_draft_layers(facts))
    for verdict in verdicts:
        if not cfg.preflight_gpu and verdict.id.startswith(GPU_CHECK_PREFIXES):
            continue
        rows.append(verdict)
    need = int(sum(entry[1] for entry in manifest.values()) * 1.2) + 200_000_000
    disks = facts.get("disk") or []
    target = next(
        (d for d in disks if d.get("path") == cfg.remote_dir), disks[0] if disks else None
    )
    if target is None:
        rows.append(warned("disk.free", "free space unknown"))
    elif target["free_bytes"] < need:
        rows.append(
            failed(
                "disk.free",
                f"{fmt_bytes(target['free_bytes'])} free under {cfg.remote_dir}, "
                f"a release needs about {fmt_bytes(need)}",
                "free space on the host or lower remote.keep_releases",
            )
        )
    else:
        rows.append(
            passed("disk.free", f"{fmt_bytes(target['free_bytes'])} free under {cfg.remote_dir}")
        )
    systemd = facts.get("systemd") or {}
    if systemd.get("present"):
        rows.append(passed("systemd", "systemd is running"))
    else:
        rows.append(
            failed(
                "systemd",
                systemd.get("error") or "systemd not found",
                "deploy to a host booted with systemd",
            )
        )
    ours = (systemd.get("properties") or {}).get("ActiveState") == "active"
    port_fact = next((p for p in facts.get("ports") or [] if p.get("port") == port), {})
    if port_fact.get("listening") and not ours:
        owner = "; ".join(port_fact.get("processes") or []) or "another process"
        rows.append(
            failed(
                "port.free",
                f"port {port} is taken by {owner[:120]}",
                "stop that process or set server.port / --port",
            )
        )
    else:
        detail = (
            f"port {port} held by {cfg.unit_name} (will restart)"
            if port_fact.get("listening")
            else f"port {port} is free"
        )
        rows.append(passed("port.free", detail))
    return rows
