"""Host statuses: one enum whose values are the JSON strings docs/deploy.md lists."""

from __future__ import annotations

import json
import re
from pathlib import Path

from ddtree_cli.deploy.report import HostReport, HostStatus

DOCS = Path(__file__).resolve().parents[3] / "docs" / "deploy.md"


def _documented() -> set[str]:
    text = DOCS.read_text()
    paragraph = text[text.index("Statuses:") :].split("\n\n", 1)[0]
    return set(re.findall(r"`([a-z_]+)`", paragraph)) - {"message"}


def test_every_status_is_documented_and_every_documented_one_exists():
    internal = {HostStatus.PENDING.value}  # before the first step; never in a report
    assert _documented() == {s.value for s in HostStatus} - internal


def test_a_report_serialises_its_status_as_the_plain_string():
    report = HostReport(host="gpu1", unit="ddtree.service", status=HostStatus.PREFLIGHT_FAILED)
    out = report.to_json()
    assert out["status"] == "preflight_failed" and type(out["status"]) is str
    assert json.loads(json.dumps(out))["status"] == "preflight_failed"
    assert f"{report.status}" == str(report.status) == "preflight_failed"
    assert not report.ok


def test_success_statuses_and_unit_states():
    assert {s.value for s in HostStatus if s.ok} == {
        "deployed", "unchanged", "dry_run", "active", "rolled_back_on_request",
    }  # fmt: skip
    assert HostStatus.of_unit("inactive") is HostStatus.INACTIVE
    assert HostStatus.of_unit("failed") is HostStatus.FAILED
    assert HostStatus.of_unit("something-new") is HostStatus.UNKNOWN


def test_preflight_rows_are_doctor_verdicts_with_deploys_field_names():
    from ddtree_cli.doctor.verdict import Status, failed, passed

    rows = [passed("systemd", "systemd is running"),
            failed("port.free", "port 30000 is taken by nc", "stop that process")]  # fmt: skip
    report = HostReport(host="gpu1", unit="ddtree.service", status=HostStatus.PREFLIGHT_FAILED,
                        preflight=rows)  # fmt: skip
    out = json.loads(json.dumps(report.to_json()))
    assert out["preflight"] == [
        {"check": "systemd", "status": "pass", "detail": "systemd is running", "fix": ""},
        {"check": "port.free", "status": "fail", "detail": "port 30000 is taken by nc",
         "fix": "stop that process"},
    ]  # fmt: skip
    assert rows[1].failed and rows[1].status is Status.FAIL and f"{rows[1].status}" == "fail"
    # doctor places the same verdict on a host for its own contract
    assert rows[1].on("gpu1").to_json() == {
        "host": "gpu1", "id": "port.free", "status": "fail",
        "detail": "port 30000 is taken by nc", "fix": "stop that process",
    }  # fmt: skip
