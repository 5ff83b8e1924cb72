"""`ddtree doctor --host` against a real test host: Debian 12, systemd and OpenSSH in
systemd-nspawn on loopback (tests/testhosts.py). Facts are collected over real SSH by the
real CLI; the host has no NVIDIA driver and no torch, like a fresh cloud VM.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from tests.conftest import require
from tests.testhosts import free_port, host_python_binds, start_host, unavailable_reason

pytestmark = [pytest.mark.nspawn, pytest.mark.slow]

CRASH_LINE = (
    "ImportError: /opt/venv/lib/python3.11/site-packages/sgl_kernel/common_ops.abi3.so: "
    "undefined symbol: _ZN3c104cuda9SetDeviceEa"
)


def run_doctor(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ddtree_cli", "doctor", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.fixture(scope="module")
def host(tmp_path_factory):
    require(unavailable_reason() is None, f"no test hosts: {unavailable_reason()}")
    # This test venv (CPU torch) mounted read-only at /opt/ddtree/venv: a serving venv
    # whose torch the host's facts script must find and import for real.
    _, binds = host_python_binds(sys.executable)
    booted = start_host(tmp_path_factory.mktemp("doctor-host"), binds_ro=binds)
    try:
        # A unit that dies at start with the import error users report (sglang#8373).
        unit = textwrap.dedent(f"""\
            [Service]
            Type=exec
            ExecStart=/bin/sh -c 'echo "ServerArgs(api_key=s3cretvalue)" >&2; echo "{CRASH_LINE}" >&2; exit 3' sh --attention-backend fa3
            KillMode=process
            LimitNOFILE=1024
            """)
        booted.ssh(["sh", "-c", "cat > /etc/systemd/system/crashy.service"], input=unit.encode())
        booted.ssh(["systemctl", "daemon-reload"])
        booted.ssh(["systemctl", "start", "crashy.service"], check=False)
        yield booted
    finally:
        booted.stop()


@pytest.fixture(scope="module")
def trusted(host, tmp_path_factory):
    known = tmp_path_factory.mktemp("known") / "known_hosts"
    known.write_text(host.known_hosts_line)
    return ["--host", host.target, "--identity", str(host.client_key), "--known-hosts", str(known)]


def checks_by_id(stdout: str) -> dict[str, dict]:
    report = json.loads(stdout)
    return {c["id"]: c for c in report["checks"]}


def test_facts_are_collected_over_ssh_and_a_host_without_driver_fails_clearly(trusted):
    result = run_doctor(*trusted, "--json")
    assert result.returncode == 5, result.stderr
    report = json.loads(result.stdout)
    assert report["ok"] is False
    checks = {c["id"]: c for c in report["checks"]}
    assert {c["host"] for c in report["checks"]} == {trusted[1]}
    # The host's own interpreter (Debian 12: Python 3.11) answered.
    assert checks["python.version"]["status"] == "pass"
    assert checks["python.version"]["detail"].startswith("Python 3.11")
    assert checks["gpu.driver"]["status"] == "fail"
    assert checks["gpu.driver"]["detail"] == "no NVIDIA driver (nvidia-smi not found)"
    assert "install the NVIDIA driver" in checks["gpu.driver"]["fix"]
    assert checks["torch.installed"]["status"] == "fail"
    assert checks["torch.installed"]["detail"] == "torch is not installed"
    assert checks["gpu.arch"]["status"] == "skip"
    assert checks["disk.free"]["status"] in ("pass", "warn", "fail")


def test_serving_venv_torch_is_imported_on_the_host(trusted):
    venv_python, _ = host_python_binds(sys.executable)
    result = run_doctor(*trusted, "--python", venv_python, "--json")
    assert result.returncode == 5, result.stderr
    checks = checks_by_id(result.stdout)
    assert checks["torch.installed"]["status"] == "pass"
    assert checks["torch.installed"]["detail"].startswith("torch 2.")
    assert checks["torch.cuda_build"]["status"] == "fail"  # the CPU wheel
    assert (
        f"{venv_python} -m pip install --force-reinstall 'torch=="
        in (checks["torch.cuda_build"]["fix"])
    )
    assert checks["python.version"]["detail"].startswith(
        f"Python {sys.version_info[0]}.{sys.version_info[1]}"
    )


def test_a_crashed_unit_shows_its_journal_lines(trusted):
    result = run_doctor(*trusted, "--unit", "crashy", "--json")
    assert result.returncode == 5, result.stderr
    unit = checks_by_id(result.stdout)["service.unit"]
    assert unit["status"] == "fail"
    assert "crashy failed: result exit-code, exit status 3" in unit["detail"]
    assert "undefined symbol: _ZN3c104cuda9SetDeviceEa" in unit["detail"]
    assert "journalctl -u crashy.service" in unit["fix"]
    # The server's logged settings are shown with the credential masked, never in clear.
    assert "ServerArgs(api_key=***)" in unit["detail"]
    assert "s3cretvalue" not in result.stdout
    settings = checks_by_id(result.stdout)["service.settings"]
    assert settings["status"] == "warn"
    assert "KillMode=process leaves sglang:: children running" in settings["detail"]
    assert "LimitNOFILE=1024" in settings["detail"]
    assert "KillMode=control-group" in settings["fix"] and "LimitNOFILE=65535" in settings["fix"]
    # ExecStart was read (the flag is there); with no GPU the backend cannot be judged.
    backend = checks_by_id(result.stdout)["sglang.attention_backend"]
    assert backend["status"] == "skip"
    assert backend["detail"] == "no GPU compute capability known"


def test_port_held_by_another_process_and_leftover_sglang_processes(host, trusted):
    port = free_port()
    host.ssh(
        [
            "systemd-run",
            "--unit",
            "holder",
            "python3",
            "-m",
            "http.server",
            str(port),
            "--bind",
            "127.0.0.1",
        ]
    )
    # A scheduler child that outlived its server: setproctitle-style name, own cgroup.
    host.ssh(
        [
            "systemd-run",
            "--unit",
            "stray",
            "python3",
            "-c",
            "open('/proc/self/comm', 'w').write('sglang::sched'); import time; time.sleep(600)",
        ]
    )
    try:
        host.ssh(
            [
                "sh",
                "-c",
                f"for i in $(seq 50); do python3 -c 'import socket; "
                f'socket.create_connection(("127.0.0.1", {port}))\' && exit 0; sleep 0.1; '
                "done; exit 1",
            ]
        )
        result = run_doctor(*trusted, "--unit", "crashy", "--port", str(port), "--json")
        assert result.returncode == 5, result.stderr
        checks = checks_by_id(result.stdout)
        held = checks[f"service.port.{port}"]
        assert held["status"] == "fail"
        assert "http.server" in held["detail"] and "not by crashy" in held["detail"]
        assert held["fix"].startswith("stop it (kill ")
        leftovers = checks["gpu.leftovers"]
        assert leftovers["status"] == "fail"
        assert "sglang::sched" in leftovers["detail"]
        # The host asked its own port for /health: a real HTTP answer, not ours.
        assert checks["service.health"]["status"] == "fail"
        assert "-> 404" in checks["service.health"]["detail"]
    finally:
        host.ssh(["systemctl", "stop", "holder", "stray"], check=False)


def test_table_output_names_host_check_status_detail_fix(trusted):
    result = run_doctor(*trusted, "--unit", "crashy")
    assert result.returncode == 5
    for word in ("host", "check", "status", "detail", "fix", "gpu.driver", "service.unit"):
        assert word in result.stdout
    assert result.stderr == ""


def test_unreachable_host_is_one_line_error():
    port = free_port()  # nothing listens there
    result = run_doctor("--host", f"root@127.0.0.1:{port}", "--json", timeout=60)
    assert result.returncode == 4
    assert result.stdout == ""
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert 1 <= len(lines) <= 2  # the error, and perhaps its hint
    assert f"127.0.0.1:{port}" in lines[0]
    assert "Traceback" not in result.stderr


def test_unknown_host_key_is_refused_in_one_line(host, tmp_path):
    empty = tmp_path / "known_hosts"
    empty.write_text("")
    result = run_doctor(
        "--host",
        host.target,
        "--identity",
        str(host.client_key),
        "--known-hosts",
        str(empty),
        "--json",
        timeout=60,
    )
    assert result.returncode == 4
    assert result.stdout == ""
    assert "Traceback" not in result.stderr
    assert "host key" in result.stderr.lower()
    assert empty.read_text() == ""  # nothing trusted behind the user's back


def test_changed_host_key_is_refused_even_with_accept_new(host, tmp_path):
    known = tmp_path / "known_hosts"
    # A key the host does not have: another host's ed25519 key under this host's name.
    other = tmp_path / "other"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(other)], check=True)
    kind, key = (tmp_path / "other.pub").read_text().split()[:2]
    known.write_text(f"[127.0.0.1]:{host.ssh_port} {kind} {key}\n")
    result = run_doctor(
        "--host",
        host.target,
        "--identity",
        str(host.client_key),
        "--known-hosts",
        str(known),
        "--accept-new-host-key",
        "--json",
        timeout=60,
    )
    assert result.returncode == 4
    assert "Traceback" not in result.stderr
    assert "changed" in result.stderr.lower()


def test_one_unreachable_host_among_several_still_reports_the_others(trusted):
    port = free_port()
    result = run_doctor(*trusted, "--host", f"root@127.0.0.1:{port}", "--json")
    assert result.returncode == 5
    report = json.loads(result.stdout)
    by_host = {}
    for check in report["checks"]:
        by_host.setdefault(check["host"], []).append(check)
    dead = by_host[f"root@127.0.0.1:{port}"]
    assert [c["id"] for c in dead] == ["host.reachable"]
    assert dead[0]["status"] == "fail"
    assert any(c["id"] == "gpu.driver" for c in by_host[trusted[1]])


def test_two_names_for_one_host_have_no_differences(host, trusted):
    # Same machine under two labels: the difference table must be empty and say so.
    other = f"127.0.0.1:{host.ssh_port}"
    result = run_doctor(*trusted, "--host", other, "--no-probes", "--json")
    report = json.loads(result.stdout)
    assert report["hosts"] == [trusted[1], other]
    assert report["differences"] == []
    fairness = [c for c in report["checks"] if c["id"] == "ab.fairness"]
    assert fairness == [
        {
            "host": "all hosts",
            "id": "ab.fairness",
            "status": "pass",
            "detail": "2 hosts share GPU, driver, torch and kernels",
            "fix": "",
        }
    ]


def test_inventory_group_labels_hosts_by_name_and_uses_their_keys(host, trusted, tmp_path):
    inventory = tmp_path / "hosts.yaml"
    inventory.write_text(
        textwrap.dedent(f"""\
        hosts:
          box:
            address: 127.0.0.1
            port: {host.ssh_port}
            user: root
            identity: {host.client_key}
          elsewhere: 127.0.0.1:{free_port()}
        groups:
          ab: [box]
        """)
    )
    known = trusted[trusted.index("--known-hosts") + 1]
    result = run_doctor(
        "--inventory",
        str(inventory),
        "--group",
        "ab",
        "--known-hosts",
        known,
        "--no-probes",
        "--json",
    )
    report = json.loads(result.stdout)
    assert report["hosts"] == ["box"]
    assert {c["host"] for c in report["checks"]} == {"box"}
    assert any(c["id"] == "gpu.driver" and c["status"] == "fail" for c in report["checks"])


def test_broken_inventory_is_a_one_line_error_with_its_line(tmp_path):
    inventory = tmp_path / "hosts.yaml"
    inventory.write_text("hosts:\n  box: {address: [unclosed\n")
    result = run_doctor("--inventory", str(inventory), "--json", timeout=60)
    assert result.returncode == 3
    assert result.stdout == ""
    assert "hosts.yaml:" in " ".join(result.stderr.split())
    assert "Traceback" not in result.stderr


def test_collect_remote_returns_the_hosts_facts(host, trusted):
    # The API `deploy`'s preflight uses: facts over one of our SSH connections.
    from ddtree_cli.remote import facts as host_facts
    from ddtree_cli.remote.ssh import connect

    known = trusted[trusted.index("--known-hosts") + 1]
    with connect(host.target, identity=host.client_key, known_hosts=known) as connection:
        facts = host_facts.collect_remote(connection, unit="crashy", ports=[host.ssh_port])
    assert facts["hostname"] == "testhost"
    assert facts["systemd"]["present"] is True
    props = facts["systemd"]["properties"]
    assert (props["ActiveState"], props["Result"], props["ExecMainStatus"]) == (
        "failed",
        "exit-code",
        "3",
    )
    assert (props["KillMode"], props["LimitNOFILE"]) == ("process", "1024")
    assert facts["systemd"]["server_args"] == {"--attention-backend": "fa3"}
    assert any("_ZN3c104cuda9SetDeviceEa" in line for line in facts["systemd"]["journal"])
    (ssh_port,) = facts["ports"]
    assert ssh_port["listening"] is True
    assert any("sshd" in cmd for cmd in ssh_port["processes"])
    assert facts["nvidia_smi"]["present"] is False
    assert facts["torch"]["installed"] is False  # Debian's python3 has no torch


def test_collect_remote_without_that_python_is_one_line(host, trusted):
    from ddtree_cli.errors import RemoteError
    from ddtree_cli.remote import facts as host_facts
    from ddtree_cli.remote.ssh import connect

    known = trusted[trusted.index("--known-hosts") + 1]
    with (
        connect(host.target, identity=host.client_key, known_hosts=known) as connection,
        pytest.raises(RemoteError) as err,
    ):
        host_facts.collect_remote(connection, remote_python="python2.7")
    assert str(err.value).endswith("no python2.7 to collect facts with")
    assert err.value.hint == "install python3 (>= 3.8) on the host"


def test_accept_new_host_key_records_it_and_proceeds(host, tmp_path):
    known = tmp_path / "known_hosts"
    known.write_text("")
    result = run_doctor(
        "--host",
        host.target,
        "--identity",
        str(host.client_key),
        "--known-hosts",
        str(known),
        "--accept-new-host-key",
        "--no-probes",
        "--json",
        timeout=120,
    )
    assert result.returncode == 5  # no driver on the host; the connection itself worked
    assert json.loads(result.stdout)["hosts"] == [host.target]
    recorded = known.read_text().split()
    assert recorded[:2] == [f"[127.0.0.1]:{host.ssh_port}", "ssh-ed25519"]
