"""Many hosts: every host in its own thread (one failing never stops the others), SGLang's
router in front of the replicas, or one tensor-parallel server over several nodes."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from ddtree_cli.deploy import readiness, systemd, units
from ddtree_cli.deploy.config import DeployConfig
from ddtree_cli.deploy.host import (
    DeployOptions,
    EventFn,
    HostDeployment,
    connect_to,
    deploy_one,
    guard,
    python_of,
)
from ddtree_cli.deploy.report import HostReport, HostStatus
from ddtree_cli.deploy.sync import Manifest, scan
from ddtree_cli.errors import DdtreeError
from ddtree_cli.remote.hostspec import HostSpec


def parallel(
    hosts: list[HostSpec], work: Callable[[HostSpec], HostReport], on_event: EventFn, unit: str
) -> list[HostReport]:
    def guarded(host: HostSpec) -> HostReport:
        try:
            return work(host)
        except DdtreeError as exc:
            on_event(host.label, HostStatus.FAILED, str(exc))
            return HostReport(
                host=host.label, unit=unit, status=HostStatus.FAILED, message=str(exc)
            )

    if len(hosts) == 1:
        return [guarded(hosts[0])]
    with ThreadPoolExecutor(max_workers=min(16, len(hosts))) as pool:
        return list(pool.map(guarded, hosts))


def deploy(
    cfg: DeployConfig,
    hosts: list[HostSpec],
    opts: DeployOptions,
    *,
    dry_run: bool = False,
    on_event: EventFn = lambda *_: None,
) -> list[HostReport]:
    manifest = scan(cfg.source, cfg.include, cfg.exclude)
    if cfg.multinode:
        return _deploy_multinode(cfg, hosts, opts, manifest, dry_run, on_event)
    reports = parallel(
        hosts,
        lambda h: deploy_one(HostDeployment(cfg, h, opts, manifest, on_event), dry_run),
        on_event,
        cfg.unit_name,
    )
    if cfg.router and not dry_run:
        reports.append(_install_router(cfg, hosts, reports, opts, on_event))
    return reports


def _install_router(
    cfg: DeployConfig,
    hosts: list[HostSpec],
    reports: list[HostReport],
    opts: DeployOptions,
    on_event: EventFn,
) -> HostReport:
    """Put SGLang's router in front of the replicas that serve, as a unit of its own."""
    router = cfg.router
    unit = units.router_unit_name(cfg)
    spec = next(
        (h for h in hosts if router.host in (h.name, h.host, h.label)), None
    ) or HostSpec.parse(router.host)
    report = HostReport(host=spec.label, unit=unit, status=HostStatus.FAILED)
    workers = [r.url for r in reports if r.ok and r.url]
    if not workers:
        report.message = "no replica serves: router not installed"
        return report
    if cfg.service_host in ("127.0.0.1", "localhost", "::1") and len(workers) > 1:
        report.message = (
            "server.host is loopback: a router on one host cannot reach the "
            "others (set server.host: 0.0.0.0)"
        )
        return report
    on_event(spec.label, "router", ", ".join(workers))
    try:
        with connect_to(spec, opts) as conn:
            conn.check_root()
            text = units.render_router_unit(cfg, router, workers, python_of(cfg, opts))
            systemd.write_root_file(conn, f"{units.UNIT_DIR}/{unit}", text)
            systemd.systemctl(conn, "daemon-reload")
            systemd.systemctl(conn, "enable", "--quiet", unit)
            systemd.systemctl(conn, "restart", unit, timeout=120)
            state = systemd.unit_state(conn, unit)
            if state.get("ActiveState") != "active":
                report.journal = systemd.journal_tail(conn, unit, 20)
                report.message = f"router unit is {state.get('ActiveState')}"
                return report
            report.status = HostStatus.DEPLOYED
            report.url = f"http://{conn.hostname}:{router.port}"
    except DdtreeError as exc:
        report.message = str(exc)
    return report


def _deploy_multinode(
    cfg: DeployConfig,
    hosts: list[HostSpec],
    opts: DeployOptions,
    manifest: Manifest,
    dry_run: bool,
    on_event: EventFn,
) -> list[HostReport]:
    """One tensor-parallel server over ``nnodes`` hosts: every node gets the same release,
    rank 0 starts first, readiness is checked on rank 0 (the only one serving HTTP)."""
    mn = cfg.multinode
    if len(hosts) != mn.nnodes:
        raise DdtreeError(
            f"multinode.nnodes is {mn.nnodes} but {len(hosts)} host(s) were given; "
            "list them in rank order"
        )
    deps = [
        HostDeployment(
            cfg, h, opts, manifest, on_event, units.NodeRole(rank, mn.nnodes, mn.dist_init_addr)
        )
        for rank, h in enumerate(hosts)
    ]

    def prepare(dep: HostDeployment) -> bool:
        ok = (
            guard(dep, dep.open)
            and guard(dep, dep.run_preflight)
            and dep.report.status is not HostStatus.PREFLIGHT_FAILED
        )
        if ok and dry_run:
            return guard(dep, dep.dry_run)
        return ok and guard(dep, dep.sync) and guard(dep, lambda: (dep.install(), None)[1])

    try:
        with ThreadPoolExecutor(max_workers=min(16, len(deps))) as pool:
            prepared = list(pool.map(prepare, deps))
        if dry_run or not all(prepared):
            for dep, ok in zip(deps, prepared, strict=True):
                if ok and not dry_run:
                    dep.report.status = HostStatus.FAILED
                    dep.report.message = "not started: another node failed to prepare"
            return [d.report for d in deps]
        for dep in deps:  # rank 0 first: the others connect to its dist-init address
            if not guard(dep, dep.restart):
                break
        head = deps[0]
        try:
            head.verify(HostStatus.DEPLOYED)
            for dep in deps[1:]:
                dep.report.status = HostStatus.DEPLOYED
        except readiness.NotReady as exc:
            reason = str(exc)
            for dep in deps:
                guard(dep, lambda dep=dep: dep.roll_back_after_failure(reason))
        return [d.report for d in deps]
    finally:
        for dep in deps:
            dep.close()
