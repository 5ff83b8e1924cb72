"""`ddtree bench` through SGLang's real router (sglang-router 0.3.2, its Rust router) in front
of real `ddtree serve` replicas on 127.0.0.1: the confound guard fingerprints every replica."""

from __future__ import annotations

import json
import subprocess

import pytest

from ddtree_cli.bench.servers import ServeProcess, wait_all_ready
from ddtree_cli.bench.summary import Summary
from tests.bench.sglang_router import VERSION, router_python, start_router
from tests.bench.test_bench_e2e import bench
from tests.conftest import require

pytestmark = [pytest.mark.http, pytest.mark.slow]

SMALL = ["--num-prompts", "5", "--max-new-tokens", "8", "--dataset", "math", "--warmup", "0"]


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    """Two DDTREE replicas behind one router, two DFLASH replicas behind another, and a third
    router over one of those DFLASH replicas and a DFLASH replica drafting blocks of 8."""
    try:
        python = router_python()
    except (OSError, RuntimeError, subprocess.CalledProcessError) as exc:
        require(False, f"cannot install sglang-router {VERSION}: {exc}")
    logs = tmp_path_factory.mktemp("fleet")
    replicas = {
        name: ServeProcess(name, algo, logs, extra)
        for name, algo, extra in [
            ("ddtree-1", "ddtree", []),
            ("ddtree-2", "ddtree", []),
            ("dflash-1", "dflash", []),
            ("dflash-2", "dflash", []),
            ("dflash-block8", "dflash", ["--block-size", "8"]),
        ]
    }
    routers = {}
    try:
        for p in replicas.values():
            p.start()
        wait_all_ready(list(replicas.values()), 120)
        url = {name: p.url for name, p in replicas.items()}
        for name, workers in [
            ("ddtree", [url["ddtree-1"], url["ddtree-2"]]),
            ("dflash", [url["dflash-1"], url["dflash-2"]]),
            ("dflash-mixed", [url["dflash-1"], url["dflash-block8"]]),
        ]:
            routers[name] = start_router(python, workers, logs / f"router-{name}.log")
        yield {"replicas": replicas, "url": url, "router": {n: r.url for n, r in routers.items()}}
    finally:
        for r in routers.values():
            r.stop()
        for p in replicas.values():
            p.stop()


def test_bench_through_routers_fingerprints_every_replica(fleet, tmp_path):
    out = tmp_path / "run"
    router, url = fleet["router"], fleet["url"]
    res = bench("--url", f"ddtree={router['ddtree']}", "--url", f"dflash={router['dflash']}",
                "--json", "--output", str(out), "--trials", "1", *SMALL)  # fmt: skip
    assert res.returncode == 0, res.stderr
    summary = json.loads(res.stdout)
    assert summary["urls"] == {"ddtree": router["ddtree"], "dflash": router["dflash"]}
    assert summary["confounds"]["differences"] == []
    for arm in ("ddtree", "dflash"):
        routed = summary["replicas"][arm]
        assert routed["router"] == router[arm]
        # What the router itself answers to /get_server_info: no model, no flags.
        assert routed["router_info"]["router_manager"] is True
        assert routed["router_info"]["workers_count"] == 2
        # Both replicas, in the router's order (not --worker-urls' order).
        assert sorted(r["url"] for r in routed["replicas"]) == sorted(
            [url[f"{arm}-1"], url[f"{arm}-2"]]
        )
        assert {r["server_info"]["port"] for r in routed["replicas"]} == {
            int(url[f"{arm}-{i}"].rsplit(":", 1)[1]) for i in (1, 2)
        }
        assert routed["differences"] == []
        # The arm's server_info is a replica's, so the rest of bench sees the real server.
        assert summary["server_info"][arm]["speculative_algorithm"] == arm.upper()
        assert summary["arms"][arm]["spec_active"] and summary["arms"][arm]["errors"] == 0
    assert summary["lossless"]["strict"] and summary["lossless"]["mismatches"] == []
    assert summary["lossless"]["compared"] == 5
    assert Summary.from_json(summary).to_json() == summary
    assert (
        f"({router['ddtree']}) over 2 replica(s), each fingerprinted"
        in (out / "report.md").read_text()
    )


def test_an_arm_whose_replicas_differ_is_refused_then_a_dead_replica_is_named(fleet, tmp_path):
    out = tmp_path / "run"
    router, url = fleet["router"], fleet["url"]
    args = ["--url", f"ddtree={router['ddtree']}", "--url", f"dflash={router['dflash-mixed']}",
            "--output", str(out), "--trials", "1", *SMALL]  # fmt: skip
    res = bench(*args)
    assert res.returncode == 5, res.stderr
    assert f"the replicas of arm 'dflash' behind the router at {router['dflash-mixed']}" in (
        res.stderr
    )
    shown = res.stderr.split(" differ — ", 1)[1]
    assert "drafter_block_size: " in shown  # by replica URL, in the router's order
    assert f"{url['dflash-1']}=16" in shown and f"{url['dflash-block8']}=8" in shown
    assert res.stdout == "" and not out.exists()

    # Allowed, the arm runs and its replicas' differences are recorded.
    res = bench("--algo", "dflash", "--baseline", "none", "--url", router["dflash-mixed"],
                "--allow-mismatch", "--json", "--output", str(tmp_path / "allowed"),
                "--trials", "1", *SMALL)  # fmt: skip
    assert res.returncode == 0, res.stderr
    recorded = json.loads(res.stdout)["replicas"]["dflash"]["differences"]
    assert {d["key"]: d["values"] for d in recorded}["drafter_block_size"] == {
        url["dflash-1"]: 16,
        url["dflash-block8"]: 8,
    }
    assert "They differ among themselves in" in (tmp_path / "allowed" / "report.md").read_text()

    fleet["replicas"]["dflash-block8"].stop()  # the router still lists it
    res = bench(*args)
    assert res.returncode == 1, res.stderr  # nothing measured: not a failed check
    lines = res.stderr.strip().splitlines()
    assert f"arm 'dflash': replica {url['dflash-block8']} behind the router at " in lines[0]
    assert "is not reachable after" in lines[0]
    assert not out.exists()
