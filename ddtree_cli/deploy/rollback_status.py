"""``ddtree deploy --rollback`` (every host back to the release it ran before, proven to
serve) and ``--status`` (current release, unit state, /health; changes nothing)."""

from __future__ import annotations

from ddtree_cli.deploy import readiness, systemd, units
from ddtree_cli.deploy.config import DeployConfig
from ddtree_cli.deploy.fleet import parallel
from ddtree_cli.deploy.host import DeployOptions, EventFn, HostDeployment, guard
from ddtree_cli.deploy.report import HostReport, HostStatus
from ddtree_cli.errors import RemoteError
from ddtree_cli.remote.hostspec import HostSpec


def rollback(
    cfg: DeployConfig,
    hosts: list[HostSpec],
    opts: DeployOptions,
    *,
    on_event: EventFn = lambda *_: None,
) -> list[HostReport]:
    """Switch every host back to the release it ran before, and prove it serves."""

    def one(host: HostSpec) -> HostReport:
        dep = HostDeployment(cfg, host, opts, {}, on_event)
        dep.report.release = None
        try:
            if not guard(dep, dep.open):
                return dep.report
            previous = dep.releases.previous()
            if previous is None:
                dep.report.status = HostStatus.FAILED
                dep.report.message = "no earlier release on the host to roll back to"
                return dep.report
            dep.report.previous = dep.releases.state()["current"]
            dep.report.release = previous
            if guard(dep, lambda: dep.activate_release(previous)):
                try:
                    dep.verify(HostStatus.ROLLED_BACK_ON_REQUEST)
                except readiness.NotReady as exc:
                    dep.report.status = HostStatus.FAILED
                    dep.report.message = f"release {previous} does not serve: {exc}"
                    dep.report.journal = systemd.journal_tail(
                        dep.conn, cfg.unit_name, 20, since=dep._since
                    )
            return dep.report
        finally:
            dep.close()

    return parallel(hosts, one, on_event, cfg.unit_name)


def status(
    cfg: DeployConfig,
    hosts: list[HostSpec],
    opts: DeployOptions,
    *,
    on_event: EventFn = lambda *_: None,
) -> list[HostReport]:
    """Current release, unit state and whether /health answers, per host. Changes nothing."""

    def one(host: HostSpec) -> HostReport:
        dep = HostDeployment(cfg, host, opts, {}, on_event)
        try:
            if not guard(dep, dep.open):
                return dep.report
            st = dep.releases.state()
            dep.report.release = st["current"]
            dep.report.previous = dep.releases.previous()
            state = systemd.unit_state(dep.conn, cfg.unit_name)
            active = state.get("ActiveState", "unknown")
            if st["current"] is None:
                dep.report.status = HostStatus.NOT_DEPLOYED
            elif active != "active":
                dep.report.status = HostStatus.of_unit(active)
                dep.report.journal = systemd.journal_tail(dep.conn, cfg.unit_name, 10)
            else:
                try:
                    code, _ = readiness.http_request(
                        dep.conn,
                        cfg.service_host,
                        units.service_port(cfg, dep.host),
                        "GET",
                        "/health",
                        timeout=20,
                    )
                    if code == 200:
                        dep.report.status = HostStatus.ACTIVE
                    else:
                        dep.report.status = HostStatus.UNHEALTHY
                        dep.report.message = f"/health answered {code}"
                except (OSError, RemoteError) as exc:
                    dep.report.status = HostStatus.UNHEALTHY
                    dep.report.message = str(exc)
            dep.emit(dep.report.status)
            return dep.report
        finally:
            dep.close()

    return parallel(hosts, one, on_event, cfg.unit_name)
