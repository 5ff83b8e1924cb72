"""benchmarks/crossover_report.py on the real crossover run it reports (H200, patched SGLang
0.5.13, the scaled pair; benchmarks/results/sglang_h200_2026-12-02_crossover/): every arm
under test of every bench becomes one cell holding that bench's own figures, in the
multi-arm form (phase A) and the two-arm form (phase B) alike."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "benchmarks" / "results" / "sglang_h200_2026-12-02_crossover"
AUTO_RESULTS = REPO / "benchmarks" / "results" / "sglang_h200_2026-12-02_crossover_auto"


def _report():
    spec = importlib.util.spec_from_file_location(
        "crossover_report", REPO / "benchmarks" / "crossover_report.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_arm_of_every_bench_is_one_cell_with_the_benchs_own_figures():
    rows = _report().cells(RESULTS)
    assert {(c["budget"], c["concurrency"]) for c in rows} == {
        (b, c) for b in (15, 32, 64, 128) for c in (1, 8, 16, 32)
    }
    for cell in rows:
        summary = json.loads((RESULTS / cell["bench"] / "summary.json").read_text())
        (point,) = summary["sweep"]
        arm = f"ddtree-b{cell['budget']}"
        comparison = (point.get("comparisons") or {arm: point["comparison"]})[arm]
        assert cell["ratio"] == comparison["output_tok_s"]["ratio"]
        assert cell["ci95"] == comparison["output_tok_s"]["ci95"]
        assert cell["accept"] == point["arms"][arm]["accept_length"]
        # Plain was timed in phase A only (crossover.py --no-reference-b for phase B).
        assert (cell["over_plain"] is None) == ("reference" not in point["arms"])
    assert json.loads((RESULTS / "cells.json").read_text()) == rows


def test_an_auto_arm_is_a_row_after_the_numbered_budgets(tmp_path):
    """``crossover.py --auto`` adds an arm ``ddtree-auto``: the real phase-A bench at
    concurrency 8 of the H200 auto run (budgets 64 and 15 and auto against DFLASH) gives a
    row per budget, the numbers first and auto last, each with the bench's own ratio."""
    report = _report()
    source = AUTO_RESULTS / "A-c8"
    shutil.copytree(source, tmp_path / "A-c8")
    rows = report.cells(tmp_path)
    assert [c["budget"] for c in rows] == [15, 64, "auto"]
    (point,) = json.loads((source / "summary.json").read_text())["sweep"]
    assert rows[-1]["ratio"] == point["comparisons"]["ddtree-auto"]["output_tok_s"]["ratio"]
    assert "| auto | 8 |" in report.table(rows)
    pytest.importorskip("matplotlib")
    report.heat_map(rows, tmp_path / "map.png", "auto")
    assert (tmp_path / "map.png").stat().st_size > 0


def test_graph_arms_are_rows_after_the_arms_without():
    """``crossover.py --graphs 15,auto,64v,15m,15p,15c,15k,15w`` adds ``ddtree-b15-graphs``,
    ``ddtree-auto-graphs``, ``ddtree-b64-graphs-verify``, ``ddtree-b15-graphs-move``,
    ``ddtree-b15-graphs-pdl``, ``ddtree-b15-graphs-control``, ``ddtree-b15-graphs-movecheck``
    and ``ddtree-b15-graphs-poolmove``: each its own row, after every arm without graphs, the
    verify-input graphs' after those, then the window KV move's, the PDL launches', the
    control's, the checked move's, the pool move's last."""
    report = _report()
    arms = ["ddtree-b15-graphs-poolmove", "ddtree-b15-graphs-movecheck",
            "ddtree-b15-graphs-control", "ddtree-b15-graphs-pdl", "ddtree-b15-graphs-move",
            "ddtree-auto-graphs", "ddtree-b64-graphs-verify", "ddtree-b64", "ddtree-b15-graphs",
            "ddtree-auto", "ddtree-b15"]  # fmt: skip
    budgets = [report.arm_budget(a) for a in arms]
    assert budgets == ["15 graphs+pool move", "15 graphs+move check", "15 graphs (control)",
                       "15 graphs+pdl", "15 graphs+move", "auto graphs", "64 graphs+verify", 64,
                       "15 graphs", "auto", 15]  # fmt: skip
    assert sorted(budgets, key=report.budget_order) == [
        15, 64, "auto", "15 graphs", "auto graphs", "64 graphs+verify", "15 graphs+move",
        "15 graphs+pdl", "15 graphs (control)", "15 graphs+move check", "15 graphs+pool move",
    ]  # fmt: skip
    assert not report.ARM.match("ddtree-graphs") and not report.ARM.match("ddtree-b15-graph")
    assert not report.ARM.match("ddtree-b15-verify")


def test_the_table_marks_ratios_whose_ci_excludes_one(tmp_path):
    report = _report()
    rows = report.cells(RESULTS)
    lines = report.table(rows).splitlines()[2:]
    assert len(lines) == len(rows)
    for line, cell in zip(lines, rows, strict=True):
        lo, hi = cell["ci95"]
        assert ("**" in line) == (lo > 1 or hi < 1), line


def test_no_bench_folder_is_one_line_and_exit_1(tmp_path, capsys):
    assert _report().main([str(tmp_path)]) == 1
    assert capsys.readouterr().err.count("\n") == 1


def test_the_heat_map_is_written(tmp_path):
    pytest.importorskip("matplotlib")
    out = tmp_path / "map.png"
    report = _report()
    assert report.main([str(RESULTS), "--png", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


WINDOW_MOVE = REPO / "benchmarks" / "results" / "sglang_h100_2026-12-06_window_move"


def test_outputs_are_compared_token_for_token_per_prompt_and_trial(tmp_path):
    """The agreement table on a real run (H100, patched SGLang 0.5.17, the 8B-cost pair: two
    DDTREE servers and DFLASH at 8 and 32): for every two arms, the requests of one prompt
    and trial with equal outputs; for every arm, its prompts equal over all trials. Checked
    against the requests themselves, then on a copy with one token changed."""
    report = _report()
    rows = report.agreement(WINDOW_MOVE)
    assert {r["bench"] for r in rows} == {"A-c8", "A-c32"}
    requests = [json.loads(x) for x in (WINDOW_MOVE / "A-c8" / "requests.jsonl").read_text()
                .splitlines()]  # fmt: skip
    by = {(r["arm"], r["prompt_id"], r["trial"]): r["output_ids"] for r in requests}
    a, b = "ddtree-b15-graphs", "ddtree-b15-graphs-move"
    pair = next(r for r in rows if r["bench"] == "A-c8" and r["arms"] == [a, b])
    keys = [(p, t) for (arm, p, t) in by if arm == a]
    assert pair["of"] == len(keys) == 200
    assert pair["same"] == sum(by[(a, *k)] == by[(b, *k)] for k in keys) < pair["of"]
    own = next(r for r in rows if r["bench"] == "A-c8" and r["arms"] == [a])
    assert (own["same"], own["of"], own["unit"]) == (40, 40, "prompts")
    # One token of one request of arm a changed: that prompt is no longer stable in a, and
    # one request fewer agrees with b.
    copy = tmp_path / "run" / "A-c8"
    copy.mkdir(parents=True)
    k = next(k for k in keys if by[(a, *k)] == by[(b, *k)])
    lines = []
    for r in requests:
        if (r["arm"], r["prompt_id"], r["trial"]) == (a, *k):
            r["output_ids"] = [r["output_ids"][0] + 1, *r["output_ids"][1:]]
        lines.append(json.dumps(r))
    (copy / "requests.jsonl").write_text("\n".join(lines) + "\n")
    changed = report.agreement(tmp_path / "run")
    assert next(r for r in changed if r["arms"] == [a, b])["same"] == pair["same"] - 1
    assert next(r for r in changed if r["arms"] == [a])["same"] == 39
    table = report.agreement_table(rows).splitlines()
    assert (
        len(table) == 2 + len(rows)
        and f"| A-c8 | {a} = {b} | {pair['same']} | 200 requests |" in table
    )


def test_every_arm_crossover_can_start_is_one_the_report_names():
    """The report keeps its own table of arm suffixes (it reads finished results without
    importing the GPU-side script): every server ``crossover.py`` can start, with or without
    graphs and with each of its ``SWITCHES``, maps to an arm the report parses and labels."""
    from tests.sglang_h200 import load_script

    crossover, report = load_script("crossover"), _report()
    servers = [f"ddtree-{kind}{budget}" for kind in "ng" for budget in ("15", "auto")]
    servers += [f"ddtree-g15{letter}" for letter in crossover.SWITCHES]
    for server in servers:
        arm = crossover.arm_of(server)
        match = report.ARM.match(arm)
        assert match is not None and match.group(3) in report.SUFFIXES, (server, arm)
    # and the report names no suffix crossover cannot produce
    produced = {"-graphs"} | {"-graphs" + s[1] for s in crossover.SWITCHES.values()}
    assert set(report.SUFFIXES) - {None} == produced
