"""The typed summary renders today's exact ``summary.json``: rebuilt from real stored runs
and rendered back, byte for byte, and the report reads the same from the rebuilt object."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ddtree_cli.bench import report
from ddtree_cli.bench.summary import ArmMetrics, Comparison, RunStatus, Summary

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = Path(__file__).resolve().parent / "fixtures"

RUNS = {
    # SGLang 0.5.13 on one H200, DDTREE (budget 64) vs DFLASH with a plain reference server:
    # a real GPU run, recorded in docs/performance.md (see benchmarks/results/README.md).
    "sglang-h200": ROOT / "benchmarks/results/sglang_h200_2026-12-01_trained-budgets/after"
    "/bench-b64-c1/summary.json",
    # `ddtree bench --json --trials 3` on a CPU development machine: the embedded engine's
    # two arms (ddtree, dflash) in float32, strict lossless check (see the fixture's README).
    "embedded-cpu": FIXTURES / "embedded_bench_summary.json",
}


def _render(obj: dict) -> str:
    # How the runner writes summary.json (runner._write_json_atomic).
    return json.dumps(obj, indent=2, default=str) + "\n"


@pytest.mark.parametrize("name", sorted(RUNS))
def test_a_stored_summary_rebuilds_and_renders_back_byte_for_byte(name):
    text = RUNS[name].read_text(encoding="utf-8")
    stored = json.loads(text)
    summary = Summary.from_json(stored)
    assert summary.to_json() == stored
    assert _render(summary.to_json()) == text


@pytest.mark.parametrize("name", sorted(RUNS))
def test_the_rebuilt_summary_is_typed_all_the_way_down(name):
    summary = Summary.from_json(json.loads(RUNS[name].read_text(encoding="utf-8")))
    assert summary.status is RunStatus.COMPLETE
    assert summary.headline_concurrency == summary.sweep[0].concurrency
    for point in summary.sweep:
        assert all(isinstance(m, ArmMetrics) for m in point.arms.values())
        assert isinstance(point.comparison, Comparison)
    ddtree = summary.arms["ddtree"]
    assert ddtree.output_tok_s > 0 and ddtree.ttft_ms.p50 > 0
    assert summary.comparison.output_tok_s.paired_by == "trial"
    assert summary.lossless.compared > 0 and summary.lossless.ok is True
    assert summary.files.report == "report.md"


def test_the_gpu_runs_reference_check_survives_the_round_trip():
    summary = Summary.from_json(json.loads(RUNS["sglang-h200"].read_text(encoding="utf-8")))
    ref = summary.lossless.reference
    assert ref is not None and ref.flagged == [] and set(ref.discordant) == {"ddtree", "dflash"}
    assert not summary.lossless.strict and summary.lossless.mismatches  # bf16 near-tie flips
    text = report.render(summary)
    assert f"{len(summary.lossless.mismatches)} differ" in text
    assert "Neither arm diverges clearly more often" in text
    # The confound guard's rows name the real differing keys of that run.
    keys = [d.key for d in summary.confounds.differences]
    assert "speculative_num_draft_tokens" in keys
    assert "| speculative_num_draft_tokens |" in text
