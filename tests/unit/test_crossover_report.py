"""benchmarks/crossover_report.py on the real crossover run it reports (H200, patched SGLang
0.5.13, the scaled pair; benchmarks/results/sglang_h200_2026-12-02_crossover/): every arm
under test of every bench becomes one cell holding that bench's own figures, in the
multi-arm form (phase A) and the two-arm form (phase B) alike."""

from __future__ import annotations

import gzip
import json
import shutil
from pathlib import Path

import pytest

from tests.sglang_h200 import BENCHMARKS, load_script

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "benchmarks" / "results" / "sglang_h200_2026-12-02_crossover"
AUTO_RESULTS = REPO / "benchmarks" / "results" / "sglang_h200_2026-12-02_crossover_auto"


def _report():
    return load_script("crossover_report", BENCHMARKS)


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
    # The same bench stored as the results folders keep it (requests.jsonl.gz): same rows.
    stored = tmp_path / "stored" / "A-c8"
    stored.mkdir(parents=True)
    (stored / "requests.jsonl.gz").write_bytes(
        gzip.compress((WINDOW_MOVE / "A-c8" / "requests.jsonl").read_bytes())
    )
    assert report.agreement(tmp_path / "stored") == [r for r in rows if r["bench"] == "A-c8"]
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
    servers += [f"ddtree-gauto{letter}" for letter in crossover.AUTO_SWITCHES]
    for server in servers:
        arm = crossover.arm_of(server)
        match = report.ARM.match(arm)
        assert match is not None and match.group(3) in report.SUFFIXES, (server, arm)
    # and the report names no suffix crossover cannot produce
    produced = {"-graphs"} | {"-graphs" + s[1] for s in crossover.SWITCHES.values()}
    assert set(report.SUFFIXES) - {None} == produced
    # and the auto-only switches are the ones the report puts beside the plain graph arms
    auto_only = {"-graphs" + crossover.SWITCHES[k][1] for k in crossover.AUTO_SWITCHES}
    assert set(report.AUTO_ONLY) == auto_only and set(report.AUTO_ONLY.values()) == {"-graphs"}


SPLIT = REPO / "benchmarks" / "results" / "sglang_h200_2026-12-04_map_split"
MAP_0513 = REPO / "benchmarks" / "results" / "sglang_h100_2026-12-07_map_0513"
ROUND_GRAPHS = REPO / "benchmarks" / "results" / "sglang_h200_2026-12-03_round_graphs"


def _trials(point: dict, arm: str) -> dict:
    return {t["trial"]: t["output_tok_s"] for t in point["arms"][arm]["trials"]}


def test_trials_are_paired_as_the_bench_paired_them():
    """``compare_trials`` (what the report uses for ``auto`` against a fixed budget), given
    an arm under test and DFLASH from a stored summary, gives the comparison the bench itself
    wrote, for every arm of every stored bench: the pairing, bootstrap, seed and verdict are
    the bench's. (summary.json keeps each trial's tok/s to 4 decimals, so the sixth decimal of
    a ratio may move.)"""
    from ddtree_cli.bench.analysis import compare_trials

    compared = 0
    for summary_file in sorted((REPO / "benchmarks" / "results").glob("**/summary.json")):
        summary = json.loads(summary_file.read_text())
        seed = summary["config"]["seed"]
        for point in summary.get("sweep", []):
            for arm, stored in (point.get("comparisons") or {}).items():
                effect = compare_trials(_trials(point, arm), _trials(point, "dflash"),
                                        name_a=arm, seed=seed)  # fmt: skip
                tok = stored["output_tok_s"]
                assert effect.ratio == pytest.approx(tok["ratio"], abs=2e-6), summary_file
                assert list(effect.ci95) == pytest.approx(tok["ci95"], abs=2e-6), summary_file
                assert (effect.n, effect.verdict) == (tok["n"], tok["verdict"]), summary_file
                compared += 1
    assert compared > 100


def test_auto_is_put_against_the_best_fixed_budget_with_its_suffix():
    """On the H200's split map (auto, budget 15 and budget 64, all with round graphs, at 1, 2
    and 32): one row per bench, against the fixed budget with the highest tok/s in that bench,
    the other fixed budget listed after it; each ratio is auto's mean tok/s over theirs."""
    report = _report()
    rows = report.against_fixed(SPLIT)
    assert [(r["bench"], r["auto"]) for r in rows] == [
        ("A-c1", "auto graphs"), ("A-c2", "auto graphs"), ("A-c32", "auto graphs")
    ]  # fmt: skip
    for r in rows:
        (point,) = json.loads((SPLIT / r["bench"] / "summary.json").read_text())["sweep"]
        fixed = {f"{b} graphs": f"ddtree-b{b}-graphs" for b in (15, 64)}
        best = max(fixed, key=lambda f: point["arms"][fixed[f]]["output_tok_s"])
        assert r["best"] == best and [o["budget"] for o in r["others"]] == sorted(
            set(fixed) - {best}
        )
        for budget, ratio in [(best, r["ratio"])] + [
            (o["budget"], o["ratio"]) for o in r["others"]
        ]:
            auto, other = _trials(point, "ddtree-auto-graphs"), _trials(point, fixed[budget])
            expect = sum(auto.values()) / sum(other.values())
            assert ratio == pytest.approx(expect, abs=2e-6)
        assert r["ci95"][0] <= r["ratio"] <= r["ci95"][1] and r["n"] == 10
        assert r["within"] == (r["ratio"] >= 0.97)
    # The best fixed budget moves with the load: budget 64 at 1, budget 15 at 32.
    assert [r["best"] for r in rows][::2] == ["64 graphs", "15 graphs"]
    table = report.against_fixed_table(rows).splitlines()
    assert len(table) == 2 + len(rows) and table[2].startswith(
        "| auto graphs | A-c1 | 1 | 64 graphs |"
    )


def test_auto_is_not_put_against_a_budget_of_other_round_machinery():
    """The H200's round-graphs run had budget 15 eager and with graphs beside auto with graphs:
    auto is compared with budget 15 with graphs only."""
    rows = _report().against_fixed(ROUND_GRAPHS)
    assert {(r["bench"], r["best"]) for r in rows} == {("A-c1", "15 graphs"), ("A-c8", "15 graphs")}
    assert all(r["others"] == [] for r in rows)


def test_within_three_percent_and_a_lost_trial(tmp_path):
    """A copy of the H100 map's bench at 32 with auto's trials set to 0.98 and 0.96 of budget
    15's: within 3 % then not; with one trial of budget 15 lost (no tok/s), four pairs."""
    report = _report()
    source = json.loads((MAP_0513 / "A-c32" / "summary.json").read_text())

    def rows_with(scale: float, lose: int | None = None) -> dict:
        summary = json.loads(json.dumps(source))
        (point,) = summary["sweep"]
        b15 = point["arms"]["ddtree-b15-graphs"]["trials"]
        for mine, theirs in zip(point["arms"]["ddtree-auto-graphs"]["trials"], b15, strict=True):
            mine["output_tok_s"] = theirs["output_tok_s"] * scale
        if lose is not None:
            b15[lose]["output_tok_s"] = None
        (tmp_path / "A-c32").mkdir(exist_ok=True)
        (tmp_path / "A-c32" / "summary.json").write_text(json.dumps(summary))
        (row,) = report.against_fixed(tmp_path)
        return row

    near, far = rows_with(0.98), rows_with(0.96)
    assert near["ratio"] == pytest.approx(0.98) and near["within"]
    assert far["ratio"] == pytest.approx(0.96) and not far["within"]
    assert far["verdict"].endswith("slower") and far["ci95"][1] < 1
    assert rows_with(0.98, lose=2)["n"] == 4
    # Budget 15 measured in no trial (its tok/s none): auto against it is "not measured".
    summary = json.loads(json.dumps(source))
    (point,) = summary["sweep"]
    point["arms"]["ddtree-b15-graphs"]["output_tok_s"] = None
    for trial in point["arms"]["ddtree-b15-graphs"]["trials"]:
        trial["output_tok_s"] = None
    (tmp_path / "A-c32" / "summary.json").write_text(json.dumps(summary))
    (row,) = report.against_fixed(tmp_path)
    assert (row["ratio"], row["n"], row["within"]) == (None, 0, False)
    assert "| 15 graphs | not measured | – | – |" in report.against_fixed_table([row])


def test_the_auto_table_is_printed_only_where_auto_ran(capsys):
    report = _report()
    assert report.main([str(MAP_0513)]) == 0
    out = capsys.readouterr().out
    against, _, texts = out.partition("on the prompts both wrote the same text")
    assert against.count("| auto graphs | A-c") == 6  # auto's table names each row's bench
    assert "against the fixed budgets beside it" in against
    assert texts.count("| auto graphs | A-c1 |") == 1  # the same texts: at concurrency 1
    assert report.main([str(RESULTS)]) == 0
    assert "against the fixed budgets" not in capsys.readouterr().out


POLICY = REPO / "benchmarks" / "results" / "sglang_h100_2026-12-07_policy"


def test_auto_rows_say_the_budget_in_use_and_its_changes_at_the_benchs_bucket(tmp_path):
    """The H100 run of the block - 1 rule: read by hand from each bench's
    A-cN.auto-graphs-policy.json, bucket 2 ran 32 and bucket 4 went between 15 and 32 13
    times after its first choice (rounds 2803-3361); the other buckets kept their first."""
    report = _report()
    rows = {r["bench"]: r for r in report.against_fixed(POLICY)}
    got = {b: (r["policy"]["bucket"], r["policy"]["budget"], r["policy"]["changes"])
           for b, r in rows.items()}  # fmt: skip
    assert got == {
        "A-c1": (1, 15, 0), "A-c2": (2, 32, 0), "A-c4": (4, 15, 13),
        "A-c8": (8, 15, 0), "A-c16": (16, 15, 0), "A-c32": (32, 15, 0),
    }  # fmt: skip
    assert not any(r["policy"]["partial"] for r in rows.values())
    table = report.against_fixed_table(list(rows.values()))
    assert (
        "| A-c4 | 4 | 15 graphs | 0.994 (0.97–1.03), 10 trials | yes | – | 15 (13 changes) |"
        in table
    )
    # Batch 3 shares bucket 4; a state that dropped changes says "at least"; no state: "–".
    policy = json.loads((POLICY / "A-c4.auto-graphs-policy.json").read_text())
    assert report.policy_at(POLICY, "A-c4", "-graphs", 3)["changes"] == 13
    policy["budget_changes"] += 40
    shutil.copytree(POLICY / "A-c4", tmp_path / "A-c4")
    (tmp_path / "A-c4.auto-graphs-policy.json").write_text(json.dumps(policy))
    (row,) = report.against_fixed(tmp_path)
    assert row["policy"]["partial"] and "| 15 (≥ 13 changes) |" in report.against_fixed_table([row])
    (tmp_path / "A-c4.auto-graphs-policy.json").unlink()
    (row,) = report.against_fixed(tmp_path)
    assert row["policy"] is None and report.against_fixed_table([row]).endswith("| – | – |")
    assert report.policy_at(POLICY, "A-c4", None, 4) is None  # no eager auto in that run


def test_auto_against_fixed_on_the_prompts_both_wrote_the_same_text_for(tmp_path):
    """A real bench at concurrency 1 (H100, patched SGLang 0.5.13, the 8B-cost pair,
    benchmarks/results/sglang_h100_2026-12-07_b32_set2/A-c1): the auto server wrote another
    text for one prompt from its first token on (the prefill's), which took 23 verify rounds
    where budget 32's took 12. On the other prompts the ratio is computed from the requests
    themselves; one request changed moves its prompt to the differing ones."""
    report = _report()
    folder = REPO / "benchmarks" / "results" / "sglang_h100_2026-12-07_b32_set2"
    (row,) = report.same_text(folder)
    assert (row["auto"], row["fixed"]) == ("auto graphs", "32 graphs")
    assert [d["prompt"] for d in row["differ"]] == ["p0004", "p0006"]
    assert (row["same"], row["of"]) == (6, 8)
    p4 = row["differ"][0]["rounds"]
    assert p4[0] > 1.8 * p4[1]
    requests = [json.loads(x) for x in gzip.decompress(
        (folder / "A-c1" / "requests.jsonl.gz").read_bytes()).decode().splitlines()]  # fmt: skip

    def tok_s(arm):
        reqs = [r for r in requests if r["arm"] == arm and r["prompt_id"] not in ("p0004", "p0006")]
        return sum(r["completion_tokens"] for r in reqs) / sum(r["e2e_ms"] for r in reqs)

    assert row["ratio"] == pytest.approx(tok_s("ddtree-auto-graphs") / tok_s("ddtree-b32-graphs"))
    copy = tmp_path / "A-c1"
    copy.mkdir()
    for r in requests:
        if (r["arm"], r["prompt_id"], r["trial"]) == ("ddtree-b32-graphs", "p0001", 3):
            r["output_ids"] = r["output_ids"][:-1] + [r["output_ids"][-1] + 1]
    (copy / "requests.jsonl").write_text("".join(json.dumps(r) + "\n" for r in requests))
    (changed,) = report.same_text(tmp_path)
    assert [d["prompt"] for d in changed["differ"]] == ["p0001", "p0004", "p0006"]
    line = report.same_text_table([row]).splitlines()[2]
    assert line.startswith("| auto graphs | A-c1 | 32 graphs | ") and "| 6 of 8 |" in line


def test_an_auto_arm_with_a_policy_switch_is_put_against_the_fixed_budgets_it_varies(tmp_path):
    """``crossover.py --graphs 32,auto,autoh``'s ``ddtree-auto-graphs-h2`` (auto with another
    policy setting) has no fixed budget of its own suffix: it is put against the fixed
    budgets with round graphs, as ``auto graphs`` is, and its policy file is its own. On the
    thirtieth run's bench at 1 (benchmarks/results/sglang_h100_2026-12-07_b32/A-c1) with the
    auto arm renamed so: the same comparison as the auto arm's."""
    folder = REPO / "benchmarks" / "results" / "sglang_h100_2026-12-07_b32"
    report = _report()
    (before,) = [r for r in report.against_fixed(folder) if r["bench"] == "A-c1"]
    bench = tmp_path / "A-c1"
    bench.mkdir()
    text = (folder / "A-c1" / "summary.json").read_text()
    (bench / "summary.json").write_text(
        text.replace('"ddtree-auto-graphs"', '"ddtree-auto-graphs-h2"')
    )
    policy = (folder / "A-c1.auto-graphs-policy.json").read_text()
    (tmp_path / "A-c1.auto-graphs-h2-policy.json").write_text(policy)
    (after,) = report.against_fixed(tmp_path)
    assert after["auto"] == "auto graphs+hysteresis 0.02" and after["best"] == "32 graphs"
    assert (after["ratio"], after["ci95"], after["policy"]) == (
        before["ratio"], before["ci95"], before["policy"])  # fmt: skip
