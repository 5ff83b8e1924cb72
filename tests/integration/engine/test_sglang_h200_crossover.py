"""benchmarks/sglang_h200/crossover.py over calls, against real servers on loopback.

The bundle is prepare.py's own (``build_tar`` + ``split``) with a stand-in
``sglang.launch_server`` that becomes the embedded engine with the flags' algorithm and
budget (tests/sglang_h200.py; SGLang needs a GPU). The engine is lossless, so the scaled
pair's outputs (here: the same checkpoint) must equal the small pair's, every bench must find
no mismatch, and each phase's bench must carry its own budgets against the one DFLASH server.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from tests.sglang_h200 import free_base, load_script, standin_bundle, without_own_ports

pytestmark = [pytest.mark.http, pytest.mark.slow]
REPO = Path(__file__).resolve().parents[3]
SCRIPT = REPO / "benchmarks" / "sglang_h200" / "crossover.py"


def _run(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}  # the stand-in's engine imports ddtree_cli
    return subprocess.run([sys.executable, str(SCRIPT), "--state", str(tmp_path / "state"), *args],
                          capture_output=True, text=True, env=env, cwd=tmp_path, timeout=900)  # fmt: skip


def test_prompts_follow_the_concurrency_and_servers_keep_their_slots(tmp_path):
    crossover = load_script("crossover")
    assert [crossover.prompts_at(c, 5, 8) for c in (1, 2, 4, 32)] == [8, 10, 20, 160]
    assert [crossover.warmup_at(c, "c") for c in (1, 16)] == [1, 16]
    assert crossover.warmup_at(16, "2") == 2
    args = crossover.main.__globals__["argparse"].Namespace(
        budgets_a=[64, 15, 32], budgets_b=[128], base=30000, small_base=31000, ckpt="scaled",
        small_ckpt="trained", mem_fraction=0.9, max_bs=32, max_total_tokens=20000,
        no_plain=False,
    )  # fmt: skip
    a = crossover.servers_for(tmp_path, args, args.budgets_a, "0.5.13")
    b = crossover.servers_for(tmp_path, args, args.budgets_b, "0.5.13")
    assert {n: p for n, (p, _) in a.items()} == {
        "plain": 30000, "dflash": 30001, "ddtree-n64": 30002, "ddtree-n15": 30003,
        "ddtree-n32": 30004}  # fmt: skip
    assert {n: p for n, (p, _) in b.items()} == {"plain": 30000, "dflash": 30001,
                                                 "ddtree-n128": 30005}  # fmt: skip
    # --graphs: the same DDTREE servers once more with the round graphs on, after auto's slot.
    g = crossover.servers_for(tmp_path, args, args.budgets_a, "0.5.13", auto=True,
                              graphs=crossover._graph_budgets("15,auto"))  # fmt: skip
    assert {n: p for n, (p, _) in g.items() if n.startswith("ddtree-g")} == {
        "ddtree-g15": 30007, "ddtree-gauto": 30008}  # fmt: skip
    # The eager ones explicitly so (the v1 worker's default is on); plain and DFLASH as is.
    eager = g["ddtree-n15"][1]
    assert eager[:2] == ["env", "SGLANG_DDTREE_ROUND_GRAPHS=0"]
    assert g["dflash"][1][0] != "env" and g["plain"][1][0] != "env"
    run = crossover.main.__globals__["run"]
    assert without_own_ports(g["ddtree-g15"], run) == [
        "env", "SGLANG_DDTREE_ROUND_GRAPHS=1", *without_own_ports((30003, eager[2:]), run)]  # fmt: skip
    for name, (port, cmd) in g.items():  # each its own NCCL port, next to its HTTP port
        assert cmd[cmd.index("--nccl-port") + 1] == str(port + run.NCCL_PORT_OFFSET), name
    assert [crossover.arm_of(n) for n in ("ddtree-n15", "ddtree-nauto", "ddtree-g15",
                                          "ddtree-gauto", "ddtree-g15v", "ddtree-g15m")] == [
        "ddtree-b15", "ddtree-auto", "ddtree-b15-graphs", "ddtree-auto-graphs",
        "ddtree-b15-graphs-verify", "ddtree-b15-graphs-move"]  # fmt: skip
    # 15v: budget 15 once more, with the v2 verify inputs' graphs switched on too.
    v = crossover.servers_for(tmp_path, args, [], "0.5.17",
                              graphs=crossover._graph_budgets("15, 15v"))  # fmt: skip
    assert v["ddtree-g15v"][1][:3] == [
        "env", "SGLANG_DDTREE_ROUND_GRAPHS=1", "SGLANG_DDTREE_VERIFY_GRAPHS=1"]  # fmt: skip
    assert v["ddtree-g15"][1][2] != "SGLANG_DDTREE_VERIFY_GRAPHS=1"
    g15v, g15 = v["ddtree-g15v"], v["ddtree-g15"]
    assert without_own_ports((g15v[0], g15v[1][3:]), run) == without_own_ports(
        (g15[0], g15[1][2:]), run
    )
    # 15m: budget 15 once more, with the v2 accept's KV move of the accepted rows only.
    m = crossover.servers_for(tmp_path, args, [], "0.5.17",
                              graphs=crossover._graph_budgets("15,15m"))  # fmt: skip
    assert m["ddtree-g15m"][1][:3] == [
        "env", "SGLANG_DDTREE_ROUND_GRAPHS=1", "SGLANG_DDTREE_WINDOW_KV_MOVE=1"]  # fmt: skip
    assert "SGLANG_DDTREE_WINDOW_KV_MOVE=1" not in m["ddtree-g15"][1]
    # 15p: budget 15 once more, its tree kernels launched with programmatic dependent launch.
    pdl = crossover.servers_for(tmp_path, args, [], "0.5.17",
                                graphs=crossover._graph_budgets("15,15p"))  # fmt: skip
    assert pdl["ddtree-g15p"][1][:3] == ["env", "SGLANG_DDTREE_ROUND_GRAPHS=1", "DDTREE_PDL=1"]
    assert "DDTREE_PDL=1" not in pdl["ddtree-g15"][1]
    assert crossover.arm_of("ddtree-g15p") == "ddtree-b15-graphs-pdl"
    # 15c: budget 15 once more with no switch at all, the control of a switch's arm.
    ctl = crossover.servers_for(tmp_path, args, [], "0.5.17",
                                graphs=crossover._graph_budgets("15,15c"))  # fmt: skip
    assert ctl["ddtree-g15c"][1][:2] == ["env", "SGLANG_DDTREE_ROUND_GRAPHS=1"]
    assert without_own_ports(ctl["ddtree-g15c"], run) == without_own_ports(ctl["ddtree-g15"], run)
    assert ctl["ddtree-g15c"][0] != ctl["ddtree-g15"][0]
    assert crossover.arm_of("ddtree-g15c") == "ddtree-b15-graphs-control"
    # 15k: budget 15 once more, both KV moves every round, compared.
    chk = crossover.servers_for(tmp_path, args, [], "0.5.17",
                                graphs=crossover._graph_budgets("15,15k"))  # fmt: skip
    assert chk["ddtree-g15k"][1][:3] == [
        "env", "SGLANG_DDTREE_ROUND_GRAPHS=1", "SGLANG_DDTREE_WINDOW_KV_MOVE=check"]  # fmt: skip
    assert crossover.arm_of("ddtree-g15k") == "ddtree-b15-graphs-movecheck"
    assert crossover.STEP_KEYS["speculative_ddtree_kv_move_check"] == "kv-move-check"
    # 15w: budget 15 once more with the KV move off (the pool's own move, the old default).
    pool = crossover.servers_for(tmp_path, args, [], "0.5.17",
                                 graphs=crossover._graph_budgets("15,15w"))  # fmt: skip
    assert pool["ddtree-g15w"][1][:3] == [
        "env", "SGLANG_DDTREE_ROUND_GRAPHS=1", "SGLANG_DDTREE_WINDOW_KV_MOVE=0"]  # fmt: skip
    assert "SGLANG_DDTREE_WINDOW_KV_MOVE=0" not in pool["ddtree-g15"][1]
    assert crossover.arm_of("ddtree-g15w") == "ddtree-b15-graphs-poolmove"
    # autoh: auto once more, its budget policy's hysteresis at 0.02 (auto only).
    h = crossover.servers_for(tmp_path, args, [], "0.5.13",
                              graphs=crossover._graph_budgets("15,auto,autoh"))  # fmt: skip
    assert h["ddtree-gautoh"][1][:3] == [
        "env", "SGLANG_DDTREE_ROUND_GRAPHS=1", "SGLANG_DDTREE_BUDGET_POLICY=hysteresis=0.02"]  # fmt: skip
    assert without_own_ports((h["ddtree-gautoh"][0], h["ddtree-gautoh"][1][3:]), run) == (
        without_own_ports((h["ddtree-gauto"][0], h["ddtree-gauto"][1][2:]), run))  # fmt: skip
    assert not any("BUDGET_POLICY" in x for x in h["ddtree-gauto"][1] + h["ddtree-g15"][1])
    assert crossover.arm_of("ddtree-gautoh") == "ddtree-auto-graphs-h2"
    for bad in ("15x", "autov", "v", "m", "p", "c", "k", "w", "automm", "autoc", "15vm", "15kw",
                "15h", "h", "autohh"):  # fmt: skip
        with pytest.raises(crossover.main.__globals__["argparse"].ArgumentTypeError):
            crossover._graph_budgets(bad)
    # Phase A of graph servers only (--budgets-a= --graphs 15,64,auto): no port shared.
    args.budgets_a, args.budgets_b = [], []
    only = crossover.servers_for(tmp_path, args, [], "0.5.13",
                                 graphs=crossover._graph_budgets("15,64,auto"))  # fmt: skip
    assert {n: p for n, (p, _) in only.items()} == {
        "plain": 30000, "dflash": 30001, "ddtree-g15": 30003, "ddtree-g64": 30004,
        "ddtree-gauto": 30005}  # fmt: skip
    # --no-plain: the same servers but plain, on the same ports.
    args.no_plain = True
    lean = crossover.servers_for(tmp_path, args, [], "0.5.13",
                                 graphs=crossover._graph_budgets("15,64,auto"))  # fmt: skip
    assert {n: p for n, (p, _) in lean.items()} == {
        n: p for n, (p, _) in only.items() if n != "plain"}  # fmt: skip
    args.no_plain = False
    args.budgets_a, args.budgets_b = [64, 15, 32], [128]
    # Phase B's plain and DFLASH are phase A's servers (same commands), so they keep running.
    assert a["plain"] == b["plain"] and a["dflash"] == b["dflash"]
    for _, cmd in (*a.values(), *b.values()):
        flags = " ".join(cmd)
        assert "--mem-fraction-static 0.9" in flags and "--max-total-tokens 20000" in flags
        assert "--sleep-on-idle" in flags  # idle servers leave the cores to the one timed
    # From 0.5.14 a server sizes its KV pool from what is free when it profiles: the map
    # starts each once the one before has its pool; 0.5.13's start at once.
    assert [run.pool_wait(v) for v in ("0.5.13", "0.5.13.post1", "0.5.14", "0.5.17")] == [
        None, None, 300.0, 300.0]  # fmt: skip


def test_profiled_budgets_follow_phase_a():
    """--profile-budgets defaults to 15 and 64, those of them in phase A: a map of graph
    servers only (--budgets-a=) profiles no eager server instead of refusing to start; a
    budget named outside phase A is still refused in one line."""
    parse = load_script("crossover").parse_args
    assert parse([]).profile_budgets == [15, 64]
    assert parse(["--budgets-a", "15,32"]).profile_budgets == [15]
    graphs_only = ["--budgets-a=", "--budgets-b=", "--graphs", "15", "--no-agree"]
    assert parse(graphs_only).profile_budgets == []
    assert parse(["--profile-budgets", "32"]).profile_budgets == [32]
    with pytest.raises(SystemExit):
        parse([*graphs_only, "--profile-budgets", "64"])


def test_the_map_runs_over_calls_and_resumes(tmp_path):
    pieces = standin_bundle(tmp_path, version="0.5.13")
    base, small = free_base(7), free_base(3)
    out = tmp_path / "out"
    flags = ["--out", str(out), "--ckpt", "trained", "--base", str(base), "--small-base",
             str(small), "--budgets-a", "8,4", "--budgets-b", "2", "--concurrency", "1,2",
             "--profile-concurrency", "", "--prompts-floor", "5", "--trials", "3",
             "--max-new", "8", "--agree-prompts", "4", "--agree-new", "8",
             "--client", str(REPO), "--auto", "--graphs", "4,autoh", "--warmup", "c"]  # fmt: skip
    state = tmp_path / "state"
    try:
        proc = _run(tmp_path, "--pieces", str(pieces), "--until", "1", *flags)
        assert proc.returncode == 3, proc.stdout + proc.stderr[-3000:]
        status = json.loads((out / "status.json").read_text())
        assert status["todo"] == ["install"] and not list(state.glob("*.pid"))
        # The map's arguments were recorded by that first call: this one names none of them
        # and runs the same map (with the defaults it would start five servers other than
        # these, on other ports).
        proc = _run(tmp_path, "--out", str(out))
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        status = json.loads((out / "status.json").read_text())
        assert status["status"] == "done", status
        steps = ["scale", "servers-a", "agree", "A-c1", "A-c2", "servers-b", "B-c1", "B-c2"]
        assert set(status["done"]) == {"install", *steps}
        results = tmp_path / "results"
        with tarfile.open(out / "results.tgz") as tar:
            tar.extractall(results, filter="data")
        results = results / "map"
        agree = json.loads((results / "agree.json").read_text())
        assert {a: r["identical"] for a, r in agree["arms"].items()} == {
            "plain": 4, "dflash": 4, "ddtree": 4}  # fmt: skip
        phase_a = {"ddtree-b8", "ddtree-b4", "ddtree-auto", "ddtree-b4-graphs",
                   "ddtree-auto-graphs-h2", "dflash", "reference"}  # fmt: skip
        for step, arms in (("A-c1", phase_a), ("A-c2", phase_a),
                           ("B-c1", {"ddtree-b2", "dflash", "reference"})):  # fmt: skip
            summary = json.loads((results / step / "summary.json").read_text())
            assert summary["lossless"]["mismatches"] == [] and summary["lossless"]["compared"]
            assert set(summary["sweep"][0]["arms"]) == arms, step
        # The budget-auto server's policy state after each phase-A bench, from /server_info:
        # after the c2 bench it has timed rounds in a bucket above 1.
        for step in ("A-c1", "A-c2"):
            policy = json.loads((results / f"{step}.auto-policy.json").read_text())
            assert policy["candidates"] == [15, 32, 64] and policy["rounds"] > 0, policy
            # autoh's own file (the stand-in's embedded engine does not read the variable
            # that sets its policy: it runs the defaults)
            other = json.loads((results / f"{step}.auto-graphs-h2-policy.json").read_text())
            assert other["candidates"] == [15, 32, 64] and other["rounds"] > 0, other
        assert set(policy["buckets"]) >= {"1", "2"}, policy
        # Every DDTREE server's round timing, asked for after each bench (the embedded
        # engine's servers have none: the answer says so instead of failing the map).
        timing = json.loads((results / "A-c1.round-timing.json").read_text())
        assert set(timing) == {"ddtree-n8", "ddtree-n4", "ddtree-nauto", "ddtree-g4",
                               "ddtree-gautoh"}  # fmt: skip
        assert all("no speculative_ddtree_round_timing" in t["error"] for t in timing.values())
        graphs = json.loads((results / "A-c1.round-graphs.json").read_text())
        assert sorted(graphs) == ["ddtree-g4", "ddtree-gautoh"], graphs
        assert "no speculative_ddtree_round_graphs" in graphs["ddtree-g4"]["error"]
        # 5 prompts per request in flight, at least 5 (--prompts-floor); warmed up with as
        # many requests as the bench keeps in flight (--warmup c).
        config = json.loads((results / "A-c2" / "summary.json").read_text())["config"]
        assert config["num_prompts"] == 10 and config["warmup"] == 2, config
        # Phase B stopped phase A's DDTREE servers (budget auto's too) and the small pair's.
        assert sorted(p.stem for p in state.glob("*.pid")) == ["ddtree-n2", "dflash", "plain"]
        # Called again, it redoes nothing.
        proc = _run(tmp_path, *flags)
        assert proc.returncode == 0 and json.loads(proc.stdout.splitlines()[-1])["done"] == sorted(
            {"install", *steps}
        )
        # A call naming another value of a map option is refused in one line, changing nothing.
        before = json.loads((state / "map" / "progress.json").read_text())
        proc = _run(tmp_path, *flags, "--trials", "5")
        status = json.loads((out / "status.json").read_text())
        assert proc.returncode == 2, proc.stdout[-3000:] + proc.stderr[-3000:]
        assert status["status"].startswith("refused: --trials 5 differs from map 'map''s 3 ")
        assert "\n" not in status["status"]
        after = json.loads((state / "map" / "progress.json").read_text())
        assert after["done"] == before["done"] and after["args"] == before["args"]
        assert after["args"]["trials"] == 3 and after["args"]["budgets_a"] == [8, 4]
    finally:
        load_script("run").main(["--state", str(state), "stop", "all"])


def test_a_graph_server_that_fails_its_start_leaves_the_map_going(tmp_path, monkeypatch):
    """A v2 release (servers started one after another): a ``--graphs`` server that exits
    at start-up is recorded and left out; the eager budget is benched against DFLASH. The
    map keeps its progress and results in its own folder (``--map``); with ``--no-plain``
    there is no plain server and no reference in the bench."""
    pieces = standin_bundle(tmp_path, version="0.5.17")
    base = free_base(5)
    out = tmp_path / "out"
    flags = ["--out", str(out), "--ckpt", "trained", "--base", str(base), "--budgets-a", "4",
             "--budgets-b=", "--graphs", "4", "--no-agree", "--concurrency", "1",
             "--profile-concurrency=", "--prompts-floor", "5", "--trials", "2", "--max-new", "8",
             "--client", str(REPO), "--map", "trained-v2", "--no-plain"]  # fmt: skip
    monkeypatch.setenv("STANDIN_ROUND_GRAPHS_FAIL", "1")
    state = tmp_path / "state"
    try:
        proc = _run(tmp_path, "--pieces", str(pieces), *flags)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        status = json.loads((out / "status.json").read_text())
        assert status["status"] == "done", status
        progress = json.loads((state / "trained-v2" / "progress.json").read_text())
        assert "the round graphs' capture failed" in progress["start_failed_ddtree-g4"]
        results = tmp_path / "results"
        with tarfile.open(out / "results.tgz") as tar:
            tar.extractall(results, filter="data")
        summary = json.loads((results / "trained-v2" / "A-c1" / "summary.json").read_text())
        assert set(summary["sweep"][0]["arms"]) == {"ddtree-b4", "dflash"}
        assert summary["reference"] is None and summary["lossless"]["mismatches"] == []
        assert not (state / "plain.pid").exists()
        # Called again, the failed server is not started again, nor does it end the map.
        proc = _run(tmp_path, *flags)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        # Another map on the servers still running: those it would start with the same
        # command line it uses as they are (their start predates it) ...
        pids = {p.stem: p.read_text() for p in state.glob("*.pid")}
        assert set(pids) >= {"dflash", "ddtree-n4"}, pids
        other, at = list(flags), flags.index("--map") + 1
        other[at] = "again"
        proc = _run(tmp_path, *other)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        progress = json.loads((state / "again" / "progress.json").read_text())
        ages = progress["done"]["servers-a"]["after_s"]
        assert ages["dflash"] == ages["ddtree-n4"] == "running before", ages
        assert {n: (state / f"{n}.pid").read_text() for n in ("dflash", "ddtree-n4")} == {
            n: pids[n] for n in ("dflash", "ddtree-n4")}  # fmt: skip
        # ... and one whose servers would run with other flags is refused in one line,
        # starting and stopping nothing.
        other = [*other, "--max-total-tokens", "9000"]
        other[at] = "bigger"
        pids = {p.stem: p.read_text() for p in state.glob("*.pid")}
        proc = _run(tmp_path, *other)
        status = json.loads((out / "status.json").read_text())
        assert proc.returncode == 2, proc.stdout[-3000:] + proc.stderr[-3000:]
        assert status["status"].startswith("refused: dflash is already running with another ")
        assert "\n" not in status["status"]
        assert {p.stem: p.read_text() for p in state.glob("*.pid")} == pids
    finally:
        load_script("run").main(["--state", str(state), "stop", "all"])
