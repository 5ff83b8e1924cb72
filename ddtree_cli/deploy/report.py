"""What a deploy, rollback or status run reports per host: a status from a fixed set, and
the facts behind it (the ``hosts`` entries of ``ddtree deploy --json``)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from enum import Enum

from ddtree_cli.doctor.verdict import Verdict


class HostStatus(str, Enum):
    """A host's outcome; the values are the JSON strings of ``hosts[].status``."""

    PENDING = "pending"
    # success
    DEPLOYED = "deployed"
    UNCHANGED = "unchanged"  # same release and unit, already serving: not restarted
    DRY_RUN = "dry_run"
    ACTIVE = "active"  # --status: the unit runs and /health answers 200
    ROLLED_BACK_ON_REQUEST = "rolled_back_on_request"
    # failure
    PREFLIGHT_FAILED = "preflight_failed"
    ROLLED_BACK = "rolled_back"  # the new release did not serve; the previous one does again
    FAILED = "failed"
    UNREACHABLE = "unreachable"
    # --status only: nothing deployed, or the unit's systemd ActiveState when it is not active
    NOT_DEPLOYED = "not_deployed"
    UNHEALTHY = "unhealthy"  # the unit is active but /health does not answer 200
    INACTIVE = "inactive"
    ACTIVATING = "activating"
    DEACTIVATING = "deactivating"
    RELOADING = "reloading"
    MAINTENANCE = "maintenance"
    UNKNOWN = "unknown"

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)

    @property
    def ok(self) -> bool:
        return self in OK_STATUSES

    @classmethod
    def of_unit(cls, active_state: str) -> HostStatus:
        """The status for a unit that is not active, from its systemd ``ActiveState``."""
        try:
            return cls(active_state)
        except ValueError:
            return cls.UNKNOWN


OK_STATUSES = frozenset({
    HostStatus.DEPLOYED, HostStatus.UNCHANGED, HostStatus.ROLLED_BACK_ON_REQUEST,
    HostStatus.DRY_RUN, HostStatus.ACTIVE,
})  # fmt: skip


@dataclass
class HostReport:
    host: str
    unit: str
    status: HostStatus
    release: str | None = None
    url: str | None = None
    message: str = ""
    previous: str | None = None
    uploaded_files: int = 0
    uploaded_bytes: int = 0
    linked_files: int = 0
    preflight: list[Verdict] = field(default_factory=list)  # doctor's rules and deploy's own
    journal: list[str] = field(default_factory=list)
    file_diff: dict | None = None
    unit_diff: str | None = None
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return self.status.ok

    def to_json(self) -> dict:
        out = asdict(self)
        out["status"] = self.status.value
        out["preflight"] = [verdict.to_preflight_json() for verdict in self.preflight]
        return out
