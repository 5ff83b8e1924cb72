"""Several arms under test in one `ddtree bench`: a DDTREE budget sweep against one DFLASH
baseline, against real `ddtree serve` processes on 127.0.0.1 (the embedded engine, trained
pair, float32 on CPU)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from ddtree_cli.bench.report import render
from ddtree_cli.bench.servers import ServeProcess, wait_all_ready
from ddtree_cli.bench.summary import Summary

pytestmark = [pytest.mark.http, pytest.mark.slow]

TINY = ["--max-new-tokens", "8", "--dataset", "math", "--warmup", "0"]


def bench(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ddtree_cli", "bench", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """DDTREE at budgets 8 and 15, DFLASH with the pair's block, DFLASH with block 8 (a
    different drafter width: a confound), and plain AR as the reference."""
    logs = tmp_path_factory.mktemp("servers")
    # By default the embedded engine's context length is what its positions leave after one
    # verify, so it shrinks as the budget grows; the guard rightly counts that as a difference,
    # so every server gets the same context length, as SGLang servers of one model have.
    same = ["--context-length", "1024"]
    procs = [
        ServeProcess("ddtree-b8", "ddtree", logs, ["--budget", "8", *same]),
        ServeProcess("ddtree-b15", "ddtree", logs, ["--budget", "15", *same]),
        ServeProcess("dflash", "dflash", logs, same),
        ServeProcess("dflash-block8", "dflash", logs, ["--block-size", "8", *same]),
        ServeProcess("ar", "ar", logs, same),
    ]
    for p in procs:
        p.start()
    try:
        wait_all_ready(procs, 240)
        yield {p.arm: p.url for p in procs}
    finally:
        for p in procs:
            p.stop()


def _sweep_args(servers: dict[str, str], dflash: str) -> list[str]:
    return [
        "--url",
        f"ddtree-b8={servers['ddtree-b8']}",
        "--url",
        f"ddtree-b15={servers['ddtree-b15']}",
        "--url",
        f"dflash={servers[dflash]}",
        "--reference",
        servers["ar"],
    ]


def test_one_command_compares_every_budget_with_the_baseline(servers, tmp_path):
    out = tmp_path / "run"
    res = bench(
        *_sweep_args(servers, "dflash"),
        "--time-reference",
        "--concurrency",
        "1,2",
        "--trials",
        "2",
        "--json",
        "--output",
        str(out),
        "--num-prompts",
        "10",
        *TINY,
    )
    assert res.returncode == 0, res.stderr
    summary = json.loads(res.stdout)
    assert summary["status"] == "complete"
    assert summary["baseline"] == "dflash"
    assert summary["confounds"]["differences"] == []
    # Budgets are DDTREE's own settings: the guard lets them differ, nothing else.
    budgets = {a: summary["server_info"][a]["speculative_ddtree_budget"] for a in summary["urls"]}
    assert budgets == {"ddtree-b8": 8, "ddtree-b15": 15, "dflash": None}
    for point in summary["sweep"]:
        assert set(point["arms"]) == {"ddtree-b8", "ddtree-b15", "dflash", "reference"}
        assert set(point["comparisons"]) == {"ddtree-b8", "ddtree-b15"}
        assert point["comparison"] == point["comparisons"]["ddtree-b8"]
        assert set(point["over_reference"]) == {"ddtree-b8", "ddtree-b15", "dflash"}
        for comps in (point["comparisons"], point["over_reference"]):
            for comp in comps.values():
                e = comp["output_tok_s"]
                assert e["n"] == 2 and e["ci95"][0] <= e["ratio"] <= e["ci95"][1]
        for arm in ("ddtree-b8", "ddtree-b15", "dflash", "reference"):
            assert len(point["arms"][arm]["trials"]) == 2
    assert summary["comparisons"] == summary["sweep"][0]["comparisons"]
    # Float32 on CPU: every arm equals the baseline and the plain reference token for token.
    check = summary["lossless"]
    assert check["strict"] and check["ok"] and check["mismatches"] == []
    assert check["compared"] == 2 * 2 * 2 * 10  # arms x concurrencies x trials x prompts
    assert {a: r["diverged"] for a, r in check["reference"]["arms"].items()} == {
        "ddtree-b8": 0,
        "ddtree-b15": 0,
        "dflash": 0,
    }
    # Every timed pass, every arm, is in the records (plus the one untimed reference pass).
    records = [json.loads(x) for x in (out / "requests.jsonl").read_text().splitlines()]
    timed = [r for r in records if r["trial"] > 0]
    assert len(timed) == 4 * 2 * 2 * 10
    report = (out / "report.md").read_text()
    assert "## Arms\n" in report and "tok/s ratio over plain" in report
    for arm in ("ddtree-b8", "ddtree-b15"):
        for c in (1, 2):
            assert any(row.startswith(f"| {arm} | {c} | ") for row in report.splitlines())
    assert "Comparison, ddtree-b15 / dflash" in report
    # The new keys rebuild too: the typed summary gives the same JSON and the same report back.
    rebuilt = Summary.from_json(json.loads((out / "summary.json").read_text()))
    assert rebuilt.to_json() == json.loads((out / "summary.json").read_text())
    assert rebuilt.under_test == ["ddtree-b8", "ddtree-b15"]
    assert render(rebuilt) == report


def test_a_dflash_baseline_with_another_block_is_refused(servers, tmp_path):
    out = tmp_path / "run"
    res = bench(
        *_sweep_args(servers, "dflash-block8"), "--output", str(out), "--num-prompts", "5", *TINY
    )
    assert res.returncode == 5, res.stderr
    assert "differ in more than the algorithm" in res.stderr
    assert "drafter_block_size" in res.stderr
    assert res.stdout == ""
    assert not out.exists()


def test_an_arm_that_is_neither_algo_nor_baseline_is_refused(servers, tmp_path):
    res = bench(
        "--url",
        f"ddtree-b8={servers['ddtree-b8']}",
        "--url",
        f"eagle={servers['dflash']}",
        "--output",
        str(tmp_path / "run"),
        "--num-prompts",
        "5",
        *TINY,
    )
    assert res.returncode != 0
    assert "eagle" in res.stderr and "ddtree-SUFFIX" in res.stderr
    assert not (tmp_path / "run").exists()


def test_an_arm_under_test_that_diverges_from_the_reference_is_flagged(servers, tmp_path):
    """An arm under test with other (random, seed 1) weights: the reference check flags it,
    and only it, from its own McNemar test against the baseline."""
    logs = tmp_path / "logs"
    other = ServeProcess(
        "ddtree-other", "ddtree", logs, ["--model", "random", "--seed", "1", "--budget", "8"]
    )
    other.start()
    try:
        wait_all_ready([other], 120)
        res = bench(
            "--url",
            f"ddtree-b8={servers['ddtree-b8']}",
            "--url",
            f"ddtree-other={other.url}",
            "--url",
            f"dflash={servers['dflash']}",
            "--reference",
            servers["ar"],
            "--allow-mismatch",
            "--json",
            "--trials",
            "1",
            "--num-prompts",
            "8",
            "--output",
            str(tmp_path / "run"),
            *TINY,
        )
    finally:
        other.stop()
    assert res.returncode == 5, res.stderr
    assert "lossless check failed" in res.stderr
    ref = json.loads(res.stdout)["lossless"]["reference"]
    assert {a: r["diverged"] for a, r in ref["arms"].items()} == {
        "ddtree-b8": 0,
        "ddtree-other": 8,
        "dflash": 0,
    }
    assert ref["flagged"] == ["ddtree-other"]
    assert "ddtree-other diverge(s) clearly more often" in (tmp_path / "run/report.md").read_text()


def test_a_timed_reference_with_another_model_is_refused(servers, tmp_path):
    """The speed-up over plain decoding needs the arms' model on the plain server."""
    other = ServeProcess(
        "ar-other", "ar", tmp_path / "logs", ["--model", "random", "--context-length", "1024"]
    )
    other.start()
    try:
        wait_all_ready([other], 120)
        args = _sweep_args(servers, "dflash")
        args[args.index("--reference") + 1] = other.url
        out = tmp_path / "run"
        res = bench(*args, "--time-reference", "--output", str(out), "--num-prompts", "5", *TINY)
    finally:
        other.stop()
    assert res.returncode == 5, res.stderr
    assert "the timed reference differs from the arms in more than speculation" in res.stderr
    assert "--allow-mismatch" in res.stderr
    assert res.stdout == ""
    assert not out.exists()


def test_each_sweep_point_runs_its_own_prompt_count(servers, tmp_path):
    """--num-prompts as a list, one count per --concurrency point: each point runs its own
    number of prompts (the first N of one seeded list), and the lossless and reference checks
    cover every point."""
    out = tmp_path / "run"
    res = bench(
        "--url",
        f"ddtree-b8={servers['ddtree-b8']}",
        "--url",
        f"dflash={servers['dflash']}",
        "--reference",
        servers["ar"],
        "--concurrency",
        "1,2",
        "--num-prompts",
        "5,10",
        "--trials",
        "2",
        "--json",
        "--output",
        str(out),
        *TINY,
    )
    assert res.returncode == 0, res.stderr
    summary = json.loads(res.stdout)
    assert summary["status"] == "complete"
    assert summary["config"]["num_prompts"] == [5, 10]
    assert [(p["concurrency"], p["num_prompts"]) for p in summary["sweep"]] == [(1, 5), (2, 10)]
    for point in summary["sweep"]:
        for arm in ("ddtree-b8", "dflash"):
            assert point["arms"][arm]["requests"] == 2 * point["num_prompts"]
    records = [json.loads(x) for x in (out / "requests.jsonl").read_text().splitlines()]
    timed = [r for r in records if r["trial"] > 0]
    per_pass: dict[tuple, list[str]] = {}
    for r in timed:
        per_pass.setdefault((r["arm"], r["concurrency"], r["trial"]), []).append(r["prompt_id"])
    assert set(per_pass) == {
        (arm, c, t) for arm in ("ddtree-b8", "dflash") for c in (1, 2) for t in (1, 2)
    }
    for (_, c, _), ids in per_pass.items():
        assert len(ids) == len(set(ids)) == {1: 5, 2: 10}[c]
    # Concurrency 1 runs the first 5 of the 10 prompts concurrency 2 runs (index: the
    # prompt's place in the pass's list).
    at_c2 = {r["index"]: r["prompt_id"] for r in timed if r["concurrency"] == 2}
    assert {r["prompt_id"] for r in timed if r["concurrency"] == 1} == {at_c2[i] for i in range(5)}
    # The reference ran the largest count once; every point's outputs were checked.
    assert len([r for r in records if r["arm"] == "reference"]) == 10
    check = summary["lossless"]
    assert check["strict"] and check["ok"] and check["compared"] == 2 * (5 + 10)
    assert {a: (r["compared"], r["diverged"]) for a, r in check["reference"]["arms"].items()} == {
        "ddtree-b8": (10, 0),
        "dflash": (10, 0),
    }
    report = (out / "report.md").read_text()
    assert "5, 10 prompts (one count per concurrency) from `math`" in report
    assert "## Concurrency 1\n\n5 prompts per pass.\n" in report
    assert "## Concurrency 2\n\n10 prompts per pass.\n" in report
    rebuilt = Summary.from_json(json.loads((out / "summary.json").read_text()))
    assert rebuilt.to_json() == json.loads((out / "summary.json").read_text())
    assert render(rebuilt) == report


@pytest.mark.parametrize(
    ("counts", "message"),
    [
        ("5", "--num-prompts 5 is below 5 x the concurrency 2 (= 10)"),
        ("5,9", "9 prompts at concurrency 2 is below 5 x the concurrency 2 (= 10)"),
        ("5,10,20", "--num-prompts 5,10,20 has 3 values but --concurrency 1,2 has 2 values"),
        ("5,x", "--num-prompts 5,x: expected an integer, or one per concurrency"),
    ],
)
def test_prompt_counts_that_do_not_fit_the_sweep_are_refused(servers, tmp_path, counts, message):
    out = tmp_path / "run"
    res = bench(
        "--url",
        f"ddtree-b8={servers['ddtree-b8']}",
        "--url",
        f"dflash={servers['dflash']}",
        "--concurrency",
        "1,2",
        "--num-prompts",
        counts,
        "--output",
        str(out),
        *TINY,
    )
    assert res.returncode == 2, res.stderr
    assert message in res.stderr and "Traceback" not in res.stderr
    assert res.stdout == ""
    assert not out.exists()
