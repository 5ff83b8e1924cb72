"""A check's outcome: pass / warn / fail / skip, what was seen, and the exact fix."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class Status(str, Enum):
    PASS = "pass"
    WARN = "warn"
    FAIL = "fail"
    SKIP = "skip"  # the check cannot apply here; detail says why


@dataclass(frozen=True)
class Verdict:
    id: str
    status: Status
    detail: str
    fix: str = ""

    @property
    def failed(self) -> bool:
        return self.status is Status.FAIL


def passed(check_id: str, detail: str) -> Verdict:
    return Verdict(check_id, Status.PASS, detail)


def warned(check_id: str, detail: str, fix: str = "") -> Verdict:
    return Verdict(check_id, Status.WARN, detail, fix)


def failed(check_id: str, detail: str, fix: str) -> Verdict:
    return Verdict(check_id, Status.FAIL, detail, fix)


def skipped(check_id: str, reason: str) -> Verdict:
    return Verdict(check_id, Status.SKIP, reason)
