"""Deploy, roll back and inspect a deployment on many hosts: preflight → sync → unit →
switch → restart → readiness, with automatic rollback when the new release does not serve.

Each host runs in its own thread; one host failing never stops the others. Progress is
reported through a callback ``on_event(host_label, phase, detail)`` so the CLI can draw a
live table; nothing here prints.
"""

from __future__ import annotations

import difflib
import hashlib
import os
import re
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ddtree_cli import service
from ddtree_cli.abi import SnapshotABI, run_abi_checks
from ddtree_cli.checkpoints import check_draft_layers, launch_checkpoints
from ddtree_cli.config import DeployConfig
from ddtree_cli.errors import DdtreeError, RemoteError
from ddtree_cli.remote import facts as host_facts
from ddtree_cli.remote.ssh import Connection, HostSpec, connect
from ddtree_cli.remote.sync import Manifest, Releases, diff_manifests, release_id, scan, sync

EventFn = Callable[[str, str, str], None]
GPU_CHECK_PREFIXES = ("gpu.", "cuda.", "torch.cuda", "flashinfer.", "sglang.")


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


@dataclass
class PreflightRow:
    check: str
    status: str  # pass | warn | fail | skip
    detail: str
    fix: str = ""


@dataclass
class HostReport:
    host: str
    unit: str
    status: str
    release: str | None = None
    url: str | None = None
    message: str = ""
    previous: str | None = None
    uploaded_files: int = 0
    uploaded_bytes: int = 0
    linked_files: int = 0
    preflight: list[PreflightRow] = field(default_factory=list)
    journal: list[str] = field(default_factory=list)
    file_diff: dict | None = None
    unit_diff: str | None = None
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return self.status in OK_STATUSES

    def to_json(self) -> dict:
        return asdict(self)


OK_STATUSES = ("deployed", "unchanged", "rolled_back_on_request", "dry_run", "active")


# ---------------------------------------------------------------------------- helpers


def effective_algo(cfg: DeployConfig, opts: DeployOptions) -> str:
    return opts.algo or cfg.launch.algo


def python_of(cfg: DeployConfig, opts: DeployOptions) -> str:
    return opts.remote_python or cfg.python


def with_port(host: HostSpec, opts: DeployOptions) -> HostSpec:
    from dataclasses import replace

    return replace(host, service_port=opts.service_port) if opts.service_port else host


def service_url(cfg: DeployConfig, host: HostSpec, conn: Connection | None) -> str:
    bind = cfg.service_host
    where = (conn.hostname if conn else host.host) if bind in ("0.0.0.0", "::") else bind
    where = f"[{where}]" if ":" in where else where
    return f"http://{where}:{service.service_port(cfg, host)}"


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


def _connect(host: HostSpec, opts: DeployOptions) -> Connection:
    return connect(host, identity=opts.identity, accept_new_host_key=opts.accept_new_host_key,
                   known_hosts=opts.known_hosts, ssh_config=opts.ssh_config)


def _fmt_bytes(n: int) -> str:
    return f"{n / 1e6:.1f} MB" if n >= 100_000 else f"{n / 1e3:.1f} KB"


# ---------------------------------------------------------------------------- preflight


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
    port = service.service_port(cfg, host)
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
        rows.append(PreflightRow(verdict.id, verdict.status.value, verdict.detail, verdict.fix))
    need = int(sum(entry[1] for entry in manifest.values()) * 1.2) + 200_000_000
    disks = facts.get("disk") or []
    target = next((d for d in disks if d.get("path") == cfg.remote_dir), disks[0] if disks else None)
    if target is None:
        rows.append(PreflightRow("disk.free", "warn", "free space unknown"))
    elif target["free_bytes"] < need:
        rows.append(PreflightRow("disk.free", "fail",
                                 f"{_fmt_bytes(target['free_bytes'])} free under {cfg.remote_dir}, "
                                 f"a release needs about {_fmt_bytes(need)}",
                                 "free space on the host or lower remote.keep_releases"))
    else:
        rows.append(PreflightRow("disk.free", "pass",
                                 f"{_fmt_bytes(target['free_bytes'])} free under {cfg.remote_dir}"))
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


# ---------------------------------------------------------------------------- one host


class HostDeployment:
    """The steps of one host's deploy; the caller runs them in order (or in phases)."""

    def __init__(self, cfg: DeployConfig, host: HostSpec, opts: DeployOptions,
                 manifest: Manifest, on_event: EventFn, node: service.NodeRole | None = None):
        self.cfg = cfg
        self.host = with_port(host, opts)
        self.opts = opts
        self.manifest = manifest
        self.node = node
        self.algo = effective_algo(cfg, opts)
        self.python = python_of(cfg, opts)
        self.unit_text = service.render_unit(cfg, self.host, self.algo, self.python, node)
        unit_hash = hashlib.sha256(self.unit_text.encode()).hexdigest()
        self.rid = release_id({**manifest, ".ddtree/unit.service": [unit_hash, 0, 0]})
        self.report = HostReport(host=self.host.label, unit=cfg.unit_name, status="pending",
                                 release=self.rid)
        self.emit = lambda phase, detail="": on_event(self.host.label, phase, detail)
        self.conn: Connection | None = None
        self.releases: Releases | None = None
        self.started = time.monotonic()

    @property
    def unit_path(self) -> str:
        return f"{service.UNIT_DIR}/{self.cfg.unit_name}"

    def open(self) -> None:
        self.emit("connecting")
        self.conn = _connect(self.host, self.opts)
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
        failed = [r for r in rows if r.status == "fail"]
        if failed and not self.opts.force:
            self.report.status = "preflight_failed"
            self.report.message = "preflight failed: " + "; ".join(
                f"{r.check}: {r.detail}" for r in failed[:3])
            self.emit("preflight failed", self.report.message)
            return False
        return True

    def dry_run(self) -> None:
        self.emit("comparing")
        current = self.releases.manifest("current")
        diff = diff_manifests(current, self.manifest)
        self.report.file_diff = {"added": diff.added, "changed": diff.changed,
                                 "removed": diff.removed}
        installed = service.read_root_file(self.conn, self.unit_path) or ""
        self.report.unit_diff = "".join(difflib.unified_diff(
            installed.splitlines(keepends=True), self.unit_text.splitlines(keepends=True),
            fromfile=f"{self.unit_path} (installed)", tofile=f"{self.unit_path} (new)"))
        self.report.status = "dry_run"
        self.report.message = (f"{len(diff.added)} added, {len(diff.changed)} changed, "
                               f"{len(diff.removed)} removed; unit "
                               f"{'changes' if self.report.unit_diff else 'unchanged'}")

    def sync(self) -> None:
        self.emit("syncing")
        st = self.releases.state()
        self.report.previous = st["current"] if st["current"] != self.rid else \
            self.releases.previous()
        result = sync(self.conn, self.releases, self.cfg.source, self.manifest, rid=self.rid,
                      metadata={"unit.service": self.unit_text},
                      progress=lambda msg: self.emit("syncing", msg))
        self.report.uploaded_files = result.uploaded_files
        self.report.uploaded_bytes = result.uploaded_bytes
        self.report.linked_files = result.linked_files
        self._already_current = st["current"] == self.rid

    def install(self) -> bool:
        """Write env file and unit, switch ``current``. False when nothing needs a restart."""
        cfg, conn = self.cfg, self.conn
        changed = not self._already_current
        if cfg.secret_env:
            text = service.render_env_file(cfg, self.opts.environ)
            path = service.env_file_path(cfg)
            if service.read_root_file(conn, path) != text:
                service.write_root_file(conn, path, text, mode=0o600)
                changed = True
        if service.read_root_file(conn, self.unit_path) != self.unit_text:
            service.write_root_file(conn, self.unit_path, self.unit_text)
            changed = True
        service.systemctl(conn, "daemon-reload")
        service.systemctl(conn, "enable", "--quiet", cfg.unit_name)
        self.releases.switch(self.rid, cfg.keep_releases)
        state = service.unit_state(conn, cfg.unit_name)
        return changed or state.get("ActiveState") != "active"

    def restart(self) -> None:
        self.emit("starting")
        self._since = service.host_now(self.conn)
        service.systemctl(self.conn, "reset-failed", self.cfg.unit_name, check=False)
        # Blocks until the old server has stopped and the new one is exec'd (Type=exec); a
        # start that fails here shows up in the unit's state, which wait_ready reads.
        service.systemctl(self.conn, "restart", self.cfg.unit_name, check=False, timeout=300)

    def verify(self, status: str) -> None:
        self.emit("waiting for /health")
        service.wait_ready(self.conn, self.cfg, self.host, self.cfg.unit_name,
                           started_at=getattr(self, "_since", None),
                           note=lambda msg: self.emit("starting", msg))
        self.report.status = status
        self.emit(status)

    def roll_back_after_failure(self, reason: str) -> None:
        self.report.journal = service.journal_tail(self.conn, self.cfg.unit_name, 20,
                                                   since=getattr(self, "_since", None))
        previous = self.report.previous
        if not previous:
            service.systemctl(self.conn, "stop", self.cfg.unit_name, check=False)
            self.report.status = "failed"
            self.report.message = f"{reason}; no earlier release to roll back to (unit stopped)"
            self.emit("failed", reason)
            return
        self.emit("rolling back", previous)
        self.activate_release(previous)
        try:
            service.wait_ready(self.conn, self.cfg, self.host, self.cfg.unit_name,
                               started_at=self._since)
        except service.NotReady as again:
            self.report.status = "failed"
            self.report.message = f"{reason}; rollback to {previous} did not serve either: {again}"
            self.emit("failed", self.report.message)
            return
        self.releases.call("discard", self.rid)
        self.report.status = "rolled_back"
        self.report.message = f"{reason}; rolled back to {previous}, which serves again"
        self.emit("rolled back", previous)

    def activate_release(self, rid: str) -> None:
        """Switch to an existing release and run it with the unit it was deployed with."""
        unit = service.read_root_file(
            self.conn, f"{self.cfg.remote_dir}/releases/{rid}/.ddtree/unit.service")
        if unit is not None and unit != service.read_root_file(self.conn, self.unit_path):
            service.write_root_file(self.conn, self.unit_path, unit)
            service.systemctl(self.conn, "daemon-reload")
        self.releases.switch(rid, self.cfg.keep_releases)
        self.restart()


def _guard(dep: HostDeployment, step: Callable[[], None]) -> bool:
    """Run a step; turn a user-facing error into the host's failed status."""
    try:
        step()
        return True
    except service.NotReady as exc:
        dep.report.message = str(exc)
        dep.report.status = "failed"
        return False
    except DdtreeError as exc:
        dep.report.status = "unreachable" if dep.conn is None else "failed"
        dep.report.message = str(exc)
        dep.emit(dep.report.status, str(exc))
        return False


def _deploy_one(dep: HostDeployment, dry_run: bool) -> HostReport:
    try:
        if not _guard(dep, dep.open):
            return dep.report
        if not _guard(dep, dep.run_preflight) or dep.report.status == "preflight_failed":
            return dep.report
        if dry_run:
            _guard(dep, dep.dry_run)
            return dep.report
        if not _guard(dep, dep.sync):
            return dep.report
        needs_restart = [True]

        def install() -> None:
            needs_restart[0] = dep.install()

        if not _guard(dep, install):
            return dep.report
        if not needs_restart[0]:
            # Same release, same unit, running: only prove it still answers.
            if _guard(dep, lambda: dep.verify("unchanged")):
                return dep.report
            return dep.report
        if not _guard(dep, dep.restart):
            return dep.report
        try:
            dep.verify("deployed")
        except service.NotReady as exc:
            reason = str(exc)
            _guard(dep, lambda: dep.roll_back_after_failure(reason))
        except DdtreeError as exc:
            dep.report.status, dep.report.message = "failed", str(exc)
        return dep.report
    finally:
        dep.close()


# ---------------------------------------------------------------------------- many hosts


def _parallel(hosts: list[HostSpec], work: Callable[[HostSpec], HostReport],
              on_event: EventFn, unit: str) -> list[HostReport]:
    def guarded(host: HostSpec) -> HostReport:
        try:
            return work(host)
        except DdtreeError as exc:
            on_event(host.label, "failed", str(exc))
            return HostReport(host=host.label, unit=unit, status="failed", message=str(exc))

    if len(hosts) == 1:
        return [guarded(hosts[0])]
    with ThreadPoolExecutor(max_workers=min(16, len(hosts))) as pool:
        return list(pool.map(guarded, hosts))


def deploy(cfg: DeployConfig, hosts: list[HostSpec], opts: DeployOptions, *,
           dry_run: bool = False, on_event: EventFn = lambda *_: None) -> list[HostReport]:
    manifest = scan(cfg.source, cfg.include, cfg.exclude)
    if cfg.multinode:
        return _deploy_multinode(cfg, hosts, opts, manifest, dry_run, on_event)
    reports = _parallel(hosts, lambda h: _deploy_one(
        HostDeployment(cfg, h, opts, manifest, on_event), dry_run), on_event, cfg.unit_name)
    if cfg.router and not dry_run:
        reports.append(_install_router(cfg, hosts, reports, opts, on_event))
    return reports


def _install_router(cfg: DeployConfig, hosts: list[HostSpec], reports: list[HostReport],
                    opts: DeployOptions, on_event: EventFn) -> HostReport:
    """Put SGLang's router in front of the replicas that serve, as a unit of its own."""
    router = cfg.router
    unit = service.router_unit_name(cfg)
    spec = next((h for h in hosts if router.host in (h.name, h.host, h.label)), None) \
        or HostSpec.parse(router.host)
    report = HostReport(host=spec.label, unit=unit, status="failed")
    workers = [r.url for r in reports if r.ok and r.url]
    if not workers:
        report.message = "no replica serves: router not installed"
        return report
    if cfg.service_host in ("127.0.0.1", "localhost", "::1") and len(workers) > 1:
        report.message = ("server.host is loopback: a router on one host cannot reach the "
                          "others (set server.host: 0.0.0.0)")
        return report
    on_event(spec.label, "router", ", ".join(workers))
    try:
        with _connect(spec, opts) as conn:
            conn.check_root()
            text = service.render_router_unit(cfg, router, workers, python_of(cfg, opts))
            service.write_root_file(conn, f"{service.UNIT_DIR}/{unit}", text)
            service.systemctl(conn, "daemon-reload")
            service.systemctl(conn, "enable", "--quiet", unit)
            service.systemctl(conn, "restart", unit, timeout=120)
            state = service.unit_state(conn, unit)
            if state.get("ActiveState") != "active":
                report.journal = service.journal_tail(conn, unit, 20)
                report.message = f"router unit is {state.get('ActiveState')}"
                return report
            report.status = "deployed"
            report.url = f"http://{conn.hostname}:{router.port}"
    except DdtreeError as exc:
        report.message = str(exc)
    return report


def _deploy_multinode(cfg: DeployConfig, hosts: list[HostSpec], opts: DeployOptions,
                      manifest: Manifest, dry_run: bool, on_event: EventFn) -> list[HostReport]:
    """One tensor-parallel server over ``nnodes`` hosts: every node gets the same release,
    rank 0 starts first, readiness is checked on rank 0 (the only one serving HTTP)."""
    mn = cfg.multinode
    if len(hosts) != mn.nnodes:
        raise DdtreeError(f"multinode.nnodes is {mn.nnodes} but {len(hosts)} host(s) were given; "
                          "list them in rank order")
    deps = [HostDeployment(cfg, h, opts, manifest, on_event,
                           service.NodeRole(rank, mn.nnodes, mn.dist_init_addr))
            for rank, h in enumerate(hosts)]

    def prepare(dep: HostDeployment) -> bool:
        ok = _guard(dep, dep.open) and _guard(dep, dep.run_preflight) \
            and dep.report.status != "preflight_failed"
        if ok and dry_run:
            return _guard(dep, dep.dry_run)
        return ok and _guard(dep, dep.sync) and _guard(dep, lambda: (dep.install(), None)[1])

    try:
        with ThreadPoolExecutor(max_workers=min(16, len(deps))) as pool:
            prepared = list(pool.map(prepare, deps))
        if dry_run or not all(prepared):
            for dep, ok in zip(deps, prepared, strict=True):
                if ok and not dry_run:
                    dep.report.status = "failed"
                    dep.report.message = "not started: another node failed to prepare"
            return [d.report for d in deps]
        for dep in deps:  # rank 0 first: the others connect to its dist-init address
            if not _guard(dep, dep.restart):
                break
        head = deps[0]
        try:
            head.verify("deployed")
            for dep in deps[1:]:
                dep.report.status = "deployed"
        except service.NotReady as exc:
            reason = str(exc)
            for dep in deps:
                _guard(dep, lambda dep=dep: dep.roll_back_after_failure(reason))
        return [d.report for d in deps]
    finally:
        for dep in deps:
            dep.close()


def rollback(cfg: DeployConfig, hosts: list[HostSpec], opts: DeployOptions, *,
             on_event: EventFn = lambda *_: None) -> list[HostReport]:
    """Switch every host back to the release it ran before, and prove it serves."""

    def one(host: HostSpec) -> HostReport:
        dep = HostDeployment(cfg, host, opts, {}, on_event)
        dep.report.release = None
        try:
            if not _guard(dep, dep.open):
                return dep.report
            previous = dep.releases.previous()
            if previous is None:
                dep.report.status = "failed"
                dep.report.message = "no earlier release on the host to roll back to"
                return dep.report
            dep.report.previous = dep.releases.state()["current"]
            dep.report.release = previous
            if _guard(dep, lambda: dep.activate_release(previous)):
                try:
                    dep.verify("rolled_back_on_request")
                except service.NotReady as exc:
                    dep.report.status = "failed"
                    dep.report.message = f"release {previous} does not serve: {exc}"
                    dep.report.journal = service.journal_tail(dep.conn, cfg.unit_name, 20,
                                                              since=dep._since)
            return dep.report
        finally:
            dep.close()

    return _parallel(hosts, one, on_event, cfg.unit_name)


def status(cfg: DeployConfig, hosts: list[HostSpec], opts: DeployOptions, *,
           on_event: EventFn = lambda *_: None) -> list[HostReport]:
    """Current release, unit state and whether /health answers, per host. Changes nothing."""

    def one(host: HostSpec) -> HostReport:
        dep = HostDeployment(cfg, host, opts, {}, on_event)
        try:
            if not _guard(dep, dep.open):
                return dep.report
            st = dep.releases.state()
            dep.report.release = st["current"]
            dep.report.previous = dep.releases.previous()
            state = service.unit_state(dep.conn, cfg.unit_name)
            active = state.get("ActiveState", "unknown")
            if st["current"] is None:
                dep.report.status = "not_deployed"
            elif active != "active":
                dep.report.status = active
                dep.report.journal = service.journal_tail(dep.conn, cfg.unit_name, 10)
            else:
                try:
                    code, _ = service.http_request(dep.conn, cfg.service_host,
                                                   service.service_port(cfg, dep.host), "GET",
                                                   "/health", timeout=20)
                    dep.report.status = "active" if code == 200 else f"unhealthy ({code})"
                except (OSError, RemoteError) as exc:
                    dep.report.status = "unhealthy"
                    dep.report.message = str(exc)
            dep.emit(dep.report.status)
            return dep.report
        finally:
            dep.close()

    return _parallel(hosts, one, on_event, cfg.unit_name)
