"""Running doctor: every rule per host, many hosts in parallel, and the report
(``doctor --json``: ``{"ok", "checks": [{"host", "id", "status", "detail", "fix"}],
"differences", "hosts"}``)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from ddtree_cli.doctor.checkpoints import check_draft_layers
from ddtree_cli.doctor.compatibility import run_abi_checks
from ddtree_cli.doctor.cuda_rules import check_persistence_mode
from ddtree_cli.doctor.fairness import check_fairness, differences
from ddtree_cli.doctor.kernel_rules import check_attention_backend
from ddtree_cli.doctor.process_rules import check_leftover_processes
from ddtree_cli.doctor.service_rules import (
    check_disk,
    check_health,
    check_ports,
    check_unit,
    check_unit_settings,
)
from ddtree_cli.doctor.snapshot_abi import SnapshotABI
from ddtree_cli.doctor.snapshot_rules import check_patch_state
from ddtree_cli.doctor.verdict import Status, Verdict, skipped
from ddtree_cli.errors import DdtreeError


@dataclass(frozen=True)
class DoctorOptions:
    """What the user asked us to look at, besides the host itself."""

    snapshot: SnapshotABI | None = None
    snapshot_path: str | None = None  # local folder, for the patch-state check
    python: str | None = None
    unit: str | None = None
    ports: tuple[int, ...] = ()
    url: str | None = None  # /health checked from where doctor runs
    probes: bool = True
    checkpoints: dict | None = None  # {"target"|"draft": folder} on the host


@dataclass
class DoctorReport:
    checks: list[Verdict] = field(default_factory=list)  # each placed on its host
    differences: list[dict] = field(default_factory=list)
    hosts: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not any(c.status is Status.FAIL for c in self.checks)

    def to_json(self) -> dict:
        return {
            "ok": self.ok,
            "checks": [check.to_json() for check in self.checks],
            "differences": self.differences,
            "hosts": self.hosts,
        }


def diagnose(facts: dict, options: DoctorOptions, health: dict | None = None) -> list[Verdict]:
    """Every verdict for one host's facts, in display order."""
    verdicts = run_abi_checks(facts, options.snapshot)
    verdicts.append(check_persistence_mode(facts))
    verdicts.append(check_unit(facts, options.unit))
    verdicts.append(check_unit_settings(facts, options.unit))
    verdicts.append(check_attention_backend(facts))
    verdicts.append(check_draft_layers(facts))
    verdicts.extend(check_ports(facts, options.unit))
    verdicts.append(check_leftover_processes(facts, options.unit))
    verdicts.append(check_disk(facts))
    if health is not None:
        verdicts.append(check_health(health, "from this machine"))
    elif facts.get("health") and not any(p.get("listening") for p in facts.get("ports") or []):
        verdicts.append(skipped("service.health", "nothing listens on the port to ask /health"))
    else:
        verdicts.append(check_health(facts.get("health"), "from the host"))
    return verdicts


def health_url_on_host(options: DoctorOptions) -> str | None:
    """With --port (and no --url), the host itself GETs its own /health on loopback."""
    if options.url or not options.ports:
        return None
    return f"http://127.0.0.1:{options.ports[0]}/health"


@dataclass
class HostFacts:
    host: str
    facts: dict | None
    error: DdtreeError | None = None


def collect_many(
    hosts: Iterable[str],
    collect: Callable[[str], dict],
    max_workers: int = 8,
) -> list[HostFacts]:
    """Run ``collect(host)`` for every host in parallel; a host's DdtreeError is kept, not
    raised, so one unreachable host does not hide the others' verdicts."""
    hosts = list(hosts)

    def one(host: str) -> HostFacts:
        try:
            return HostFacts(host, collect(host))
        except DdtreeError as exc:
            return HostFacts(host, None, exc)

    with ThreadPoolExecutor(max_workers=max(1, min(max_workers, len(hosts)))) as pool:
        return list(pool.map(one, hosts))


def build_report(
    results: list[HostFacts], options: DoctorOptions, local_health: dict | None = None
) -> DoctorReport:
    report = DoctorReport(hosts=[r.host for r in results])
    if options.snapshot_path:
        verdict = check_patch_state(options.snapshot_path)
        report.checks.append(verdict.on("snapshot"))
    for result in results:
        if result.facts is None:
            error = result.error
            report.checks.append(
                Verdict(
                    "host.reachable",
                    Status.FAIL,
                    str(error),
                    (error.hint if error else "") or "",
                    host=result.host,
                )
            )
            continue
        for verdict in diagnose(result.facts, options, local_health):
            report.checks.append(verdict.on(result.host))
    reached = {r.host: r.facts for r in results if r.facts is not None}
    if len(results) > 1:
        report.differences = differences(reached)
        verdict = check_fairness(report.differences, list(reached))
        report.checks.append(verdict.on("all hosts"))
    return report
