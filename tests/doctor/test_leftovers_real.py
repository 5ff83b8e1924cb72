"""gpu.leftovers on real processes: a launcher command line and a child retitled sglang::.

The launcher is a real ``python -m sglang.launch_server`` (or ``sglang serve``) process whose
``sglang`` package is a stand-in that only starts the child: SGLang itself cannot run here.
The child does to /proc what SGLang's ``setproctitle("sglang::scheduler_TP0")`` does on
Linux: its argv[0] (cmdline) and its comm (prctl PR_SET_NAME, cut at 15 characters) both
read sglang::... Then the launcher is killed and the child becomes a real leftover.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ddtree_cli.doctor.process_rules import check_leftover_processes
from ddtree_cli.doctor.service_rules import check_ports
from ddtree_cli.doctor.verdict import Status
from ddtree_cli.remote import facts as host_facts

CHILD = r"""
import ctypes, time
ctypes.CDLL(None).prctl(15, b"sglang::scheduler_TP0", 0, 0, 0)  # PR_SET_NAME
time.sleep(300)
"""

LAUNCHER = r"""
import subprocess, sys, time
child = subprocess.Popen(["sglang::scheduler_TP0", "-c", CHILD], executable=sys.executable)
open(sys.argv[-1], "w").write(str(child.pid))
time.sleep(300)
"""


def _package(root: Path, pid_file: Path) -> None:
    (root / "sglang").mkdir()
    (root / "sglang" / "__init__.py").write_text("")
    code = f"CHILD = {CHILD!r}\n" + LAUNCHER
    (root / "sglang" / "launch_server.py").write_text(code)
    (root / "bin").mkdir()
    script = root / "bin" / "sglang"  # what the `sglang` console script runs: `sglang serve`
    script.write_text(f"#!{sys.executable}\n" + code)
    script.chmod(0o755)


def _wait(predicate, what: str, timeout: float = 20.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def _facts_for(pid: int) -> dict:
    """Real collected facts, narrowed to this test's process (others may run on the host)."""
    found = [p for p in host_facts.process_facts() if p["pid"] == pid]
    assert len(found) == 1, host_facts.process_facts()
    return {"processes": found, "systemd": {"properties": {}}, "nvidia_smi": {}}


@pytest.fixture(params=["launch_server", "sglang_serve"])
def server(request, tmp_path):
    pid_file = tmp_path / "child.pid"
    _package(tmp_path, pid_file)
    if request.param == "launch_server":
        argv = [sys.executable, "-m", "sglang.launch_server", "--port", "30077", str(pid_file)]
    else:
        argv = [sys.executable, str(tmp_path / "bin" / "sglang"), "serve", str(pid_file)]
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    launcher = subprocess.Popen(argv, env=env, cwd=tmp_path, start_new_session=True)
    child = int(_wait(lambda: pid_file.exists() and pid_file.read_text(), "the child's pid"))
    _wait(lambda: Path(f"/proc/{child}/comm").read_text().startswith("sglang::"), "the title")
    yield launcher, child
    for pid in (launcher.pid, child):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    launcher.wait(10)


def test_a_live_hand_started_server_is_reported_with_its_launcher_and_never_killed(server):
    launcher, child = server
    facts = _facts_for(child)
    (process,) = facts["processes"]
    assert process["name"] == "sglang::scheduler_TP0"
    assert process["ppid"] == launcher.pid
    assert process["parent_is_launcher"] is True
    verdict = check_leftover_processes(facts, None)
    assert verdict.status is Status.PASS, verdict
    assert f"launcher pid {launcher.pid}" in verdict.detail
    assert "kill" not in verdict.detail + verdict.fix


def test_beside_a_running_unit_it_is_a_warning_naming_the_launcher_not_a_kill(server):
    launcher, child = server
    facts = _facts_for(child)
    facts["systemd"]["properties"] = {"ActiveState": "active"}  # --unit sglang is running
    verdict = check_leftover_processes(facts, "sglang")
    assert verdict.status is Status.WARN
    assert "outside sglang.service" in verdict.detail
    assert f"launcher pid {launcher.pid}" in verdict.detail
    assert "kill" not in verdict.fix


def test_once_the_launcher_is_killed_the_child_is_a_leftover_to_kill(server):
    launcher, child = server
    os.kill(launcher.pid, signal.SIGKILL)  # the child is left running, as SIGKILL leaves it
    launcher.wait(10)
    _wait(lambda: host_facts._ppid(child) != launcher.pid, "the child to be re-parented")
    facts = _facts_for(child)
    (process,) = facts["processes"]
    assert process["parent_is_launcher"] is False
    verdict = check_leftover_processes(facts, None)
    assert verdict.status is Status.FAIL
    assert f"pid {child} sglang::scheduler_TP0: its launcher is gone" in verdict.detail
    assert verdict.fix.startswith(f"kill {child} ")


LISTENER = r"""
import socket, sys, time
sock = socket.create_server(("127.0.0.1", 0))
open(sys.argv[-1], "w").write(str(sock.getsockname()[1]))
time.sleep(300)
"""


def test_a_port_held_by_a_live_sglang_server_is_named_not_killed(tmp_path):
    (tmp_path / "sglang").mkdir()
    (tmp_path / "sglang" / "__init__.py").write_text("")
    (tmp_path / "sglang" / "launch_server.py").write_text(LISTENER)
    port_file = tmp_path / "port"
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    server = subprocess.Popen([sys.executable, "-m", "sglang.launch_server", str(port_file)],
                              env=env, cwd=tmp_path)  # fmt: skip
    try:
        port = int(_wait(lambda: port_file.exists() and port_file.read_text(), "the port"))
        facts = {"ports": host_facts.port_facts([port]), "systemd": {"properties": {}}}
        assert facts["ports"][0]["pids"] == [server.pid]
        (held,) = check_ports(facts, "sglang")
        assert held.status is Status.FAIL  # the unit cannot bind it ...
        assert "held by a live SGLang server outside sglang" in held.detail
        assert "kill" not in held.fix  # ... but the server is someone's, not a leftover
        (free,) = check_ports(facts, None)
        assert free.status is Status.PASS and f"pid {server.pid}" in free.detail
    finally:
        server.kill()
        server.wait(10)
