"""`ddtree bench --host`: one test host (OpenSSH + systemd in nspawn) whose service is
switched between the arms through the deploy module. The service is the embedded engine
(configs/deploy.embedded.yaml), run from this suite's virtual environment, bind-mounted
read-only into the host with the Python it was built from (see tests/testhosts.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import require
from tests.testhosts import free_port, host_python_binds, start_host, unavailable_reason

pytestmark = [pytest.mark.nspawn, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]


def test_bench_switches_one_host_between_the_arms(tmp_path):
    require(unavailable_reason() is None, f"no test hosts: {unavailable_reason()}")
    _, binds = host_python_binds(sys.executable)
    host = start_host(tmp_path / "host", binds_ro=binds)
    try:
        out = tmp_path / "run"
        res = subprocess.run(
            [
                sys.executable,
                "-m",
                "ddtree_cli",
                "bench",
                "--host",
                host.target,
                "--config",
                str(REPO / "configs/deploy.embedded.yaml"),
                "--identity",
                str(host.client_key),
                "--known-hosts",
                str(tmp_path / "known_hosts"),
                "--accept-new-host-key",
                "--port",
                str(free_port()),
                "--json",
                "--output",
                str(out),
                "--trials",
                "2",
                "--concurrency",
                "1,2",
                "--num-prompts",
                "5,10",
                "--max-new-tokens",
                "8",
                "--dataset",
                "math",
            ],
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert res.returncode == 0, res.stderr
        summary = json.loads(res.stdout)
        assert summary["target"] == "host" and summary["status"] == "complete"
        # The same host, release and flags on both sides: nothing but the algorithm differs.
        assert summary["confounds"]["differences"] == []
        infos = summary["server_info"]
        assert infos["ddtree"]["speculative_algorithm"] == "DDTREE"
        assert infos["dflash"]["speculative_algorithm"] == "DFLASH"
        switches = summary["switches"]
        assert [s["arm"] for s in switches][:2] == ["ddtree", "dflash"]
        assert all(s["status"] in ("deployed", "unchanged") for s in switches)
        # Both arms measured in every trial at each point, on the one host, each point with
        # its own prompt count (--num-prompts 5,10).
        assert [(p["concurrency"], p["num_prompts"]) for p in summary["sweep"]] == [(1, 5), (2, 10)]
        for point in summary["sweep"]:
            assert {a: m["requests"] for a, m in point["arms"].items()} == {
                "ddtree": 2 * point["num_prompts"],
                "dflash": 2 * point["num_prompts"],
            }
        assert summary["lossless"]["strict"] and summary["lossless"]["compared"] == 2 * (5 + 10)
        assert summary["lossless"]["mismatches"] == []
        active = host.ssh(["systemctl", "is-active", "ddtree-embedded.service"]).stdout
        assert active.decode().strip() == "active"
    finally:
        host.stop()
