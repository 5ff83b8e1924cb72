"""``ddtree deploy`` end to end against real test hosts (OpenSSH + systemd in nspawn).

The service deployed is the embedded engine (``ddtree serve``, CPU): the host runs it from
the virtual environment this test suite runs in, bind-mounted read-only at
/opt/ddtree/venv together with the Python it was built from (see tests/testhosts.py).
Only the ``ddtree_cli`` package travels with the deploy, as the release on PYTHONPATH.

The tests in this module share one host and run in order: deploy, re-deploy, one change,
failing launch with automatic rollback, --status, --rollback, changed host key.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from tests.conftest import require
from tests.testhosts import free_port, host_python_binds, start_host, unavailable_reason

pytestmark = [pytest.mark.nspawn, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[3]
EMBEDDED = REPO / "configs/deploy.embedded.yaml"
REMOTE_DIR = "/opt/ddtree/embedded"


def ddtree(*args: str, timeout: float = 400) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "ddtree_cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "COLUMNS": "300"},
    )


def generate(url: str, tokens: int = 16) -> dict:
    body = json.dumps(
        {
            "text": "Hello",
            "sampling_params": {"max_new_tokens": tokens, "temperature": 0, "ignore_eos": True},
        }
    ).encode()
    request = urllib.request.Request(
        url + "/generate", data=body, headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.loads(response.read())


class Site:
    """One booted host plus what the tests need to talk to it."""

    def __init__(self, tmp: Path):
        python, binds = host_python_binds(sys.executable)
        self.host = start_host(tmp / "host", binds_ro=binds)
        self.known_hosts = tmp / "known_hosts"
        self.port = free_port()
        self.tmp = tmp
        # A private copy of the source, so that tests can change a file.
        self.source = tmp / "src"
        shutil.copytree(
            REPO / "ddtree_cli",
            self.source / "ddtree_cli",
            ignore=shutil.ignore_patterns("__pycache__"),
        )

    def config(self, name: str = "copy", **launch) -> Path:
        text = EMBEDDED.read_text().replace("path: ..", f"path: {self.source}")
        if launch:
            start = text.index("launch:")
            end = text.index("canary:")
            text = (
                text[:start]
                + "launch:\n"
                + "".join(f"  {k}: {json.dumps(v)}\n" for k, v in launch.items())
                + "\n"
                + text[end:]
            )
        path = self.tmp / f"{name}.yaml"
        path.write_text(text)
        return path

    def deploy(self, *extra: str, config: Path | None = None) -> tuple[int, dict, str]:
        proc = ddtree(
            "deploy",
            "--host",
            self.host.target,
            "--identity",
            str(self.host.client_key),
            "--known-hosts",
            str(self.known_hosts),
            "--accept-new-host-key",
            "--config",
            str(config or self.config()),
            "--port",
            str(self.port),
            "--json",
            *extra,
        )
        assert proc.stdout.strip(), proc.stderr
        return proc.returncode, json.loads(proc.stdout), proc.stderr

    def remote(self, *argv: str) -> str:
        return self.host.ssh(list(argv)).stdout.decode().strip()

    def current(self) -> str:
        return Path(self.remote("readlink", f"{REMOTE_DIR}/current")).name

    def main_pid(self) -> str:
        return self.remote(
            "systemctl", "show", "-p", "MainPID", "--value", "ddtree-embedded.service"
        )


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    require(unavailable_reason() is None, f"no test hosts: {unavailable_reason()}")
    site = Site(tmp_path_factory.mktemp("deploy-e2e"))
    yield site
    site.host.stop()


def test_deploy_embedded_engine_is_active_and_answers_generate(site):
    code, out, err = site.deploy(config=EMBEDDED)
    assert code == 0, err
    (report,) = out["hosts"]
    assert report["status"] == "deployed"
    assert report["url"] == f"http://127.0.0.1:{site.port}"
    assert report["uploaded_files"] > 20 and report["linked_files"] == 0
    assert {row["check"] for row in report["preflight"]} >= {
        "python.version",
        "torch.installed",
        "disk.free",
        "systemd",
        "port.free",
    }
    assert site.remote("systemctl", "is-active", "ddtree-embedded.service") == "active"
    unit = site.remote("cat", "/etc/systemd/system/ddtree-embedded.service")
    assert "Type=exec" in unit and "KillMode=control-group" in unit
    assert "ExecStart=/opt/ddtree/venv/bin/python -m ddtree_cli serve --algo ddtree" in unit
    assert site.current() == report["release"]
    answer = generate(report["url"])
    assert answer["meta_info"]["completion_tokens"] == 16
    assert answer["meta_info"]["spec_verify_ct"] > 0
    # The service runs the synced release, not the package this test imports.
    pid = site.main_pid()
    cwd = site.remote("readlink", f"/proc/{pid}/cwd")
    assert cwd == f"{REMOTE_DIR}/releases/{report['release']}"


def test_redeploy_with_nothing_changed_uploads_nothing(site):
    pid = site.main_pid()
    code, out, err = site.deploy()  # same content from the private copy: same release
    assert code == 0, err
    (report,) = out["hosts"]
    assert report["status"] == "unchanged"
    assert (report["uploaded_files"], report["uploaded_bytes"]) == (0, 0)
    assert site.main_pid() == pid  # not restarted


def test_one_changed_file_uploads_one_file(site):
    before = site.current()
    target = site.source / "ddtree_cli/remote/__init__.py"
    target.write_text(target.read_text() + "# changed by the deploy test\n")
    code, out, err = site.deploy()
    assert code == 0, err
    (report,) = out["hosts"]
    assert report["status"] == "deployed" and report["previous"] == before
    assert report["uploaded_files"] == 1
    assert report["linked_files"] > 20
    assert site.current() == report["release"] != before
    assert (
        site.remote("tail", "-n1", f"{REMOTE_DIR}/current/ddtree_cli/remote/__init__.py")
        == "# changed by the deploy test"
    )
    assert generate(report["url"])["meta_info"]["completion_tokens"] == 16


def test_dry_run_shows_file_and_unit_diff_and_changes_nothing(site):
    before = site.current()
    config = site.config(
        "dryrun",
        kind="embedded",
        algo="dflash",
        args=["--max-running-requests", "4", "--context-length", "512"],
    )
    code, out, err = site.deploy("--dry-run", config=config)
    assert code == 0, err
    (report,) = out["hosts"]
    assert report["status"] == "dry_run"
    assert report["file_diff"] == {"added": [], "changed": [], "removed": []}
    assert (
        "-ExecStart=/opt/ddtree/venv/bin/python -m ddtree_cli serve --algo ddtree"
        in report["unit_diff"]
    )
    assert (
        "+ExecStart=/opt/ddtree/venv/bin/python -m ddtree_cli serve --algo dflash"
        in report["unit_diff"]
    )
    assert site.current() == before


def test_failing_launch_rolls_back_and_old_release_serves(site):
    good = site.current()
    broken = site.config(
        "broken",
        kind="command",
        command=[
            "{python}",
            "-c",
            "import sys; print('boom: weights not found', flush=True); sys.exit(3)",
        ],
    )
    code, out, err = site.deploy(config=broken)
    assert code != 0
    (report,) = out["hosts"]
    assert report["status"] == "rolled_back", report
    assert any("boom: weights not found" in line for line in report["journal"])
    assert site.current() == good
    assert site.remote("systemctl", "is-active", "ddtree-embedded.service") == "active"
    assert generate(report["url"])["meta_info"]["spec_verify_ct"] > 0
    assert "failed" in err and "rolled back" in err


def test_status_and_rollback_commands(site):
    current = site.current()
    code, out, err = site.deploy("--status")
    assert code == 0, err
    (report,) = out["hosts"]
    assert (report["status"], report["release"]) == ("active", current)
    earlier = report["previous"]
    assert earlier is not None  # the first deploy's release
    plain = ddtree(
        "deploy",
        "--host",
        site.host.target,
        "--identity",
        str(site.host.client_key),
        "--known-hosts",
        str(site.known_hosts),
        "--config",
        str(site.config()),
        "--port",
        str(site.port),
        "--status",
    )
    assert plain.returncode == 0, plain.stderr
    assert "active" in plain.stdout and current in plain.stdout and "{" not in plain.stdout
    code, out, err = site.deploy("--rollback")
    assert code == 0, err
    (report,) = out["hosts"]
    assert report["status"] == "rolled_back_on_request"
    assert site.current() == earlier == report["release"]
    assert generate(report["url"])["meta_info"]["completion_tokens"] == 16


def test_preflight_failure_stops_unless_forced(site):
    good = site.current()
    unit_before = site.remote("cat", "/etc/systemd/system/ddtree-embedded.service")
    code, out, err = site.deploy("--remote-python", "/opt/missing/bin/python")
    assert code != 0
    (report,) = out["hosts"]
    assert report["status"] == "preflight_failed"
    failed = {row["check"] for row in report["preflight"] if row["status"] == "fail"}
    assert "python.version" in failed
    assert "preflight failed: python.version" in err
    assert site.current() == good
    assert site.remote("cat", "/etc/systemd/system/ddtree-embedded.service") == unit_before
    # --force goes ahead; the server cannot start, so the deploy rolls back by itself.
    code, out, err = site.deploy("--remote-python", "/opt/missing/bin/python", "--force")
    assert code != 0
    assert out["hosts"][0]["status"] == "rolled_back"
    assert site.current() == good
    assert generate(out["hosts"][0]["url"])["meta_info"]["completion_tokens"] == 16


def test_non_root_login_with_passwordless_sudo(site):
    target = site.host.add_sudo_user("deployer")
    config = site.config("sudo")
    text = (
        config.read_text()
        .replace("name: ddtree-embedded", "name: ddtree-sudo")
        .replace("dir: /opt/ddtree/embedded", "dir: /opt/ddtree/sudo")
    )
    config.write_text(text)
    port = free_port()
    proc = ddtree(
        "deploy",
        "--host",
        target,
        "--identity",
        str(site.host.client_key),
        "--known-hosts",
        str(site.known_hosts),
        "--config",
        str(config),
        "--port",
        str(port),
        "--json",
    )
    assert proc.returncode == 0, proc.stderr
    (report,) = json.loads(proc.stdout)["hosts"]
    assert report["status"] == "deployed" and report["host"] == target
    assert site.remote("systemctl", "is-active", "ddtree-sudo.service") == "active"
    assert site.remote("stat", "-c", "%U", "/etc/systemd/system/ddtree-sudo.service") == "root"
    assert generate(report["url"])["meta_info"]["completion_tokens"] == 16
    site.remote("systemctl", "disable", "--now", "ddtree-sudo.service")


def test_changed_host_key_is_refused(site):
    site.host.regenerate_host_keys()
    before = site.known_hosts.read_text()
    code, out, err = site.deploy("--status")
    assert code == 4 and out["hosts"][0]["status"] == "unreachable"
    assert f"{site.known_hosts}:1 holds a different key" in err
    assert site.known_hosts.read_text() == before


def test_two_hosts_in_parallel_and_one_unreachable(site, tmp_path):
    other = start_host(tmp_path / "b", binds_ro=host_python_binds(sys.executable)[1])
    try:
        known = tmp_path / "known_hosts"
        port_b, dead = free_port(), free_port()
        inventory = tmp_path / "hosts.yaml"
        inventory.write_text(
            "hosts:\n"
            f"  a: {{address: 127.0.0.1, port: {site.host.ssh_port}, user: root, "
            f"identity: {site.host.client_key}, service_port: {site.port}}}\n"
            f"  b: {{address: 127.0.0.1, port: {other.ssh_port}, user: root, "
            f"identity: {other.client_key}, service_port: {port_b}}}\n"
            f"  c: {{address: 127.0.0.1, port: {dead}, user: root, identity: {other.client_key}}}\n"
        )
        proc = ddtree(
            "deploy",
            "--inventory",
            str(inventory),
            "--config",
            str(EMBEDDED),
            "--known-hosts",
            str(known),
            "--accept-new-host-key",
            "--json",
        )
        assert proc.returncode == 4, proc.stderr
        reports = {r["host"]: r for r in json.loads(proc.stdout)["hosts"]}
        assert reports["a"]["status"] in ("deployed", "unchanged")  # a already runs it
        assert reports["b"]["status"] == "deployed"
        assert reports["c"]["status"] == "unreachable"
        assert "connection refused" in reports["c"]["message"]
        for name in ("a", "b"):
            assert generate(reports[name]["url"])["meta_info"]["completion_tokens"] == 16
    finally:
        other.stop()
