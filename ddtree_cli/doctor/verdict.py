"""A check's outcome: pass / warn / fail / skip, what was seen, and the exact fix.

The one verdict type of ``doctor`` (its ``checks``) and of ``deploy``'s preflight (its
``preflight`` rows): a rule returns a :class:`Verdict`, a report places it on a host.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from enum import Enum


class Status(str, Enum):
    """A verdict's outcome; the values are the JSON strings of ``status``."""

    PASS = "pass"
    WARN = "warn"
    FAIL = "fail"
    SKIP = "skip"  # the check cannot apply here; detail says why

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)


@dataclass(frozen=True)
class Verdict:
    id: str
    status: Status
    detail: str
    fix: str = ""
    host: str | None = None  # set when a report places the verdict on a host

    @property
    def failed(self) -> bool:
        return self.status is Status.FAIL

    def on(self, host: str) -> Verdict:
        """This verdict, about ``host``."""
        return replace(self, host=host)

    def to_json(self) -> dict:
        """A ``doctor --json`` check: ``{"host", "id", "status", "detail", "fix"}``."""
        return {
            "host": self.host,
            "id": self.id,
            "status": self.status.value,
            "detail": self.detail,
            "fix": self.fix,
        }

    def to_preflight_json(self) -> dict:
        """A ``deploy --json`` preflight row: ``{"check", "status", "detail", "fix"}``."""
        return {"check": self.id, "status": self.status.value, "detail": self.detail,
                "fix": self.fix}  # fmt: skip


def passed(check_id: str, detail: str) -> Verdict:
    return Verdict(check_id, Status.PASS, detail)


def warned(check_id: str, detail: str, fix: str = "") -> Verdict:
    return Verdict(check_id, Status.WARN, detail, fix)


def failed(check_id: str, detail: str, fix: str) -> Verdict:
    return Verdict(check_id, Status.FAIL, detail, fix)


def skipped(check_id: str, reason: str) -> Verdict:
    return Verdict(check_id, Status.SKIP, reason)
