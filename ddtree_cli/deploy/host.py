"""One host's deploy: connect → preflight → sync → unit → switch → restart → readiness, with
an automatic rollback when the new release does not serve.

Progress goes through a callback ``on_event(host_label, phase, detail)`` so the CLI can draw
a live table; nothing here prints.
"""

from __future__ import annotations

import difflib
import hashlib
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from ddtree_cli.deploy import readiness, systemd, units
from ddtree_cli.deploy.config import DeployConfig
from ddtree_cli.deploy.preflight import preflight
from ddtree_cli.deploy.report import HostReport, HostStatus
from ddtree_cli.deploy.sync import Manifest, Releases, diff_manifests, release_id, sync
from ddtree_cli.errors import DdtreeError
from ddtree_cli.remote.hostspec import HostSpec
from ddtree_cli.remote.ssh import Connection, connect

EventFn = Callable[[str, str, str], None]


@dataclass
class DeployOptions:
    algo: str | None = None
    remote_python: str | None = None
    identity: str | None = None
    accept_new_host_key: bool = False
    known_hosts: str | None = None
    ssh_config: str | None = None
    service_port: int | None = None
    force: bool = False
    environ: dict[str, str] = field(default_factory=lambda: dict(os.environ))


def effective_algo(cfg: DeployConfig, opts: DeployOptions) -> str:
    return opts.algo or cfg.launch.algo


def python_of(cfg: DeployConfig, opts: DeployOptions) -> str:
    return opts.remote_python or cfg.python


def with_port(host: HostSpec, opts: DeployOptions) -> HostSpec:
    return replace(host, service_port=opts.service_port) if opts.service_port else host


def service_url(cfg: DeployConfig, host: HostSpec, conn: Connection | None) -> str:
    bind = cfg.service_host
    where = (conn.hostname if conn else host.host) if bind in ("0.0.0.0", "::") else bind
    where = f"[{where}]" if ":" in where else where
    return f"http://{where}:{units.service_port(cfg, host)}"


def connect_to(host: HostSpec, opts: DeployOptions) -> Connection:
    return connect(
        host,
        identity=opts.identity,
        accept_new_host_key=opts.accept_new_host_key,
        known_hosts=opts.known_hosts,
        ssh_config=opts.ssh_config,
    )


class HostDeployment:
    """The steps of one host's deploy; the caller runs them in order (or in phases)."""

    def __init__(
        self,
        cfg: DeployConfig,
        host: HostSpec,
        opts: DeployOptions,
        manifest: Manifest,
        on_event: EventFn,
        node: units.NodeRole | None = None,
    ):
        self.cfg = cfg
        self.host = with_port(host, opts)
        self.opts = opts
        self.manifest = manifest
        self.node = node
        self.algo = effective_algo(cfg, opts)
        self.python = python_of(cfg, opts)
        self.unit_text = units.render_unit(cfg, self.host, self.algo, self.python, node)
        unit_hash = hashlib.sha256(self.unit_text.encode()).hexdigest()
        self.rid = release_id({**manifest, ".ddtree/unit.service": [unit_hash, 0, 0]})
        self.report = HostReport(
            host=self.host.label, unit=cfg.unit_name, status=HostStatus.PENDING, release=self.rid
        )
        self.emit = lambda phase, detail="": on_event(self.host.label, phase, detail)
        self.conn: Connection | None = None
        self.releases: Releases | None = None
        self.started = time.monotonic()
        self._since: str | None = None  # the host's clock at the last restart

    @property
    def unit_path(self) -> str:
        return f"{units.UNIT_DIR}/{self.cfg.unit_name}"

    def fail(self, status: HostStatus, message: str) -> None:
        self.report.status, self.report.message = status, message
        self.emit(status, message)

    def open(self) -> None:
        self.emit("connecting")
        self.conn = connect_to(self.host, self.opts)
        self.conn.check_root()
        self.releases = Releases(self.conn, self.cfg.remote_dir)
        self.report.url = service_url(self.cfg, self.host, self.conn)

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()
        self.report.seconds = round(time.monotonic() - self.started, 2)

    def run_preflight(self) -> bool:
        self.emit("preflight")
        rows = preflight(self.conn, self.cfg, self.host, self.python, self.manifest)
        self.report.preflight = rows
        failed = [r for r in rows if r.failed]
        if failed and not self.opts.force:
            self.fail(
                HostStatus.PREFLIGHT_FAILED,
                "preflight failed: " + "; ".join(f"{r.id}: {r.detail}" for r in failed[:3]),
            )
            return False
        return True

    def dry_run(self) -> None:
        self.emit("comparing")
        current = self.releases.manifest("current")
        diff = diff_manifests(current, self.manifest)
        self.report.file_diff = {
            "added": diff.added,
            "changed": diff.changed,
            "removed": diff.removed,
        }
        installed = systemd.read_root_file(self.conn, self.unit_path) or ""
        self.report.unit_diff = "".join(
            difflib.unified_diff(
                installed.splitlines(keepends=True),
                self.unit_text.splitlines(keepends=True),
                fromfile=f"{self.unit_path} (installed)",
                tofile=f"{self.unit_path} (new)",
            )
        )
        self.report.status = HostStatus.DRY_RUN
        self.report.message = (
            f"{len(diff.added)} added, {len(diff.changed)} changed, "
            f"{len(diff.removed)} removed; unit "
            f"{'changes' if self.report.unit_diff else 'unchanged'}"
        )

    def sync(self) -> None:
        self.emit("syncing")
        st = self.releases.state()
        self.report.previous = (
            st["current"] if st["current"] != self.rid else self.releases.previous()
        )
        result = sync(
            self.conn,
            self.releases,
            self.cfg.source,
            self.manifest,
            rid=self.rid,
            metadata={"unit.service": self.unit_text},
            progress=lambda msg: self.emit("syncing", msg),
        )
        self.report.uploaded_files = result.uploaded_files
        self.report.uploaded_bytes = result.uploaded_bytes
        self.report.linked_files = result.linked_files
        self._already_current = st["current"] == self.rid

    def install(self) -> bool:
        """Write env file and unit, switch ``current``. False when nothing needs a restart."""
        cfg, conn = self.cfg, self.conn
        changed = not self._already_current
        if cfg.secret_env:
            text = units.render_env_file(cfg, self.opts.environ)
            path = units.env_file_path(cfg)
            if systemd.read_root_file(conn, path) != text:
                systemd.write_root_file(conn, path, text, mode=0o600)
                changed = True
        if systemd.read_root_file(conn, self.unit_path) != self.unit_text:
            systemd.write_root_file(conn, self.unit_path, self.unit_text)
            changed = True
        systemd.systemctl(conn, "daemon-reload")
        systemd.systemctl(conn, "enable", "--quiet", cfg.unit_name)
        self.releases.switch(self.rid, cfg.keep_releases)
        state = systemd.unit_state(conn, cfg.unit_name)
        return changed or state.get("ActiveState") != "active"

    def restart(self) -> None:
        self.emit("starting")
        self._since = systemd.host_now(self.conn)
        systemd.systemctl(self.conn, "reset-failed", self.cfg.unit_name, check=False)
        # Blocks until the old server has stopped and the new one is exec'd (Type=exec); a
        # start that fails here shows up in the unit's state, which wait_ready reads.
        systemd.systemctl(self.conn, "restart", self.cfg.unit_name, check=False, timeout=300)

    def verify(self, status: HostStatus) -> None:
        self.emit("waiting for /health")
        readiness.wait_ready(
            self.conn,
            self.cfg,
            self.host,
            self.cfg.unit_name,
            note=lambda msg: self.emit("starting", msg),
        )
        self.report.status = status
        self.emit(status)

    def roll_back_after_failure(self, reason: str) -> None:
        self.report.journal = systemd.journal_tail(
            self.conn, self.cfg.unit_name, 20, since=self._since
        )
        previous = self.report.previous
        if not previous:
            systemd.systemctl(self.conn, "stop", self.cfg.unit_name, check=False)
            self.report.status = HostStatus.FAILED
            self.report.message = f"{reason}; no earlier release to roll back to (unit stopped)"
            self.emit(HostStatus.FAILED, reason)
            return
        self.emit("rolling back", previous)
        self.activate_release(previous)
        try:
            readiness.wait_ready(self.conn, self.cfg, self.host, self.cfg.unit_name)
        except readiness.NotReady as again:
            self.fail(
                HostStatus.FAILED, f"{reason}; rollback to {previous} did not serve either: {again}"
            )
            return
        self.releases.call("discard", self.rid)
        self.report.status = HostStatus.ROLLED_BACK
        self.report.message = f"{reason}; rolled back to {previous}, which serves again"
        self.emit(HostStatus.ROLLED_BACK, previous)

    def activate_release(self, rid: str) -> None:
        """Switch to an existing release and run it with the unit it was deployed with."""
        unit = systemd.read_root_file(
            self.conn, f"{self.cfg.remote_dir}/releases/{rid}/.ddtree/unit.service"
        )
        if unit is not None and unit != systemd.read_root_file(self.conn, self.unit_path):
            systemd.write_root_file(self.conn, self.unit_path, unit)
            systemd.systemctl(self.conn, "daemon-reload")
        self.releases.switch(rid, self.cfg.keep_releases)
        self.restart()


def guard(dep: HostDeployment, step: Callable[[], None]) -> bool:
    """Run a step; turn a user-facing error into the host's failed status."""
    try:
        step()
        return True
    except readiness.NotReady as exc:
        dep.report.message = str(exc)
        dep.report.status = HostStatus.FAILED
        return False
    except DdtreeError as exc:
        dep.fail(HostStatus.UNREACHABLE if dep.conn is None else HostStatus.FAILED, str(exc))
        return False


def deploy_one(dep: HostDeployment, dry_run: bool) -> HostReport:
    try:
        if not guard(dep, dep.open):
            return dep.report
        if not guard(dep, dep.run_preflight) or dep.report.status is HostStatus.PREFLIGHT_FAILED:
            return dep.report
        if dry_run:
            guard(dep, dep.dry_run)
            return dep.report
        if not guard(dep, dep.sync):
            return dep.report
        needs_restart = [True]

        def install() -> None:
            needs_restart[0] = dep.install()

        if not guard(dep, install):
            return dep.report
        if not needs_restart[0]:
            # Same release, same unit, running: only prove it still answers.
            guard(dep, lambda: dep.verify(HostStatus.UNCHANGED))
            return dep.report
        if not guard(dep, dep.restart):
            return dep.report
        try:
            dep.verify(HostStatus.DEPLOYED)
        except readiness.NotReady as exc:
            reason = str(exc)
            guard(dep, lambda: dep.roll_back_after_failure(reason))
        except DdtreeError as exc:
            dep.report.status, dep.report.message = HostStatus.FAILED, str(exc)
        return dep.report
    finally:
        dep.close()
