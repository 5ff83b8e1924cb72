"""One host, one service, two arms: the fairest A/B on identical hardware.

Before an arm's pass the service is switched to that arm's algorithm through the deploy
module (the same release and unit as ``ddtree deploy --algo ARM``: restart, wait until
healthy, roll back if it does not come up). Only ``--algo`` differs between the arms, so
the confound guard sees the same host, GPU, versions and flags on both sides.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from ddtree_cli.errors import ConfigError, DdtreeError


@dataclass
class ServiceSwitcher:
    config_path: Path
    host: str
    identity: str | None = None
    known_hosts: str | None = None
    accept_new_host_key: bool = False
    service_port: int | None = None
    active: str | None = None
    url: str | None = None
    switches: list[dict] = field(default_factory=list)

    def __post_init__(self) -> None:
        from ddtree_cli.deploy.config import ALGOS, load_deploy_config
        from ddtree_cli.remote.hostspec import HostSpec

        self._cfg = load_deploy_config(self.config_path)
        self._host = HostSpec.parse(self.host)
        self.algos = ALGOS

    def check_arms(self, arms: list[str]) -> None:
        bad = [a for a in arms if a not in self.algos]
        if bad:
            raise ConfigError(
                f"--host switches the service between {', '.join(self.algos)}; not {', '.join(bad)}"
            )

    def switch(self, arm: str) -> str:
        """Deploy ``arm`` unless it is already active; return the service URL. Blocking."""
        if arm == self.active and self.url:
            return self.url
        from ddtree_cli import deploy as dp

        opts = dp.DeployOptions(
            algo=arm,
            identity=self.identity,
            known_hosts=self.known_hosts,
            accept_new_host_key=self.accept_new_host_key,
            service_port=self.service_port,
        )
        (report,) = dp.deploy(self._cfg, [self._host], opts)
        self.switches.append(
            {
                "arm": arm,
                "status": report.status,
                "release": report.release,
                "seconds": report.seconds,
            }
        )
        if not report.ok or not report.url:
            self.active = None
            raise DdtreeError(
                f"switching {self._host.label} to {arm} failed ({report.status}): {report.message}",
                hint="run `ddtree deploy --status` / `ddtree doctor` on the host",
            )
        self.active, self.url = arm, report.url
        return report.url
