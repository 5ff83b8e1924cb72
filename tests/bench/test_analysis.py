"""Per-arm metrics, the A/B comparison and the report, from passes with known values."""

from __future__ import annotations

from ddtree_cli.bench import analysis, report
from ddtree_cli.bench.fingerprint import Difference
from ddtree_cli.bench.loadgen import PassResult
from ddtree_cli.bench.lossless import LosslessResult, Mismatch
from ddtree_cli.bench.stats import NO_CLEAR_DIFFERENCE
from ddtree_cli.bench.summary import Confounds, Files, RunConfig, RunStatus, Summary, SweepPoint


def _pass(arm, trial, wall, tokens, e2e, accept=None, n=8):
    p = PassResult(arm, 1, trial, wall_s=wall)
    for i in range(n):
        p.records.append(
            {
                "arm": arm,
                "concurrency": 1,
                "trial": trial,
                "prompt_id": f"p{i}",
                "ok": True,
                "completion_tokens": tokens,
                "e2e_ms": e2e[i] if isinstance(e2e, list) else e2e,
                "ttft_ms": 10.0,
                "tpot_ms": 2.0 + i / 100,
                "itl_ms": [2.0, 4.0],
                "chunk_tokens": [1, 2, 1],
                "spec_verify_ct": 4 if accept else None,
                "accept_length": accept,
                "output_ids": [1] * tokens,
            }
        )
    return p


def test_arm_metrics_pool_acceptance_and_average_trials():
    passes = [_pass("a", 1, 2.0, 16, 100.0, accept=4.0), _pass("a", 2, 4.0, 16, 100.0, 4.0)]
    m = analysis.arm_metrics(passes)
    # 8 x 16 tokens in 2 s and in 4 s: 64 and 32 tok/s.
    assert m.output_tok_s == 48.0
    assert [t.output_tok_s for t in m.trials] == [64.0, 32.0]
    assert m.accept_length == 4.0
    assert m.tokens_per_chunk.mean == round(4 / 3, 4)
    assert m.errors == 0 and m.requests == 16


def test_a_clear_speedup_is_reported_and_a_noisy_one_is_not():
    faster = [_pass("x", t, 1.0, 16, [50.0 + i for i in range(8)], 5.0) for t in (1, 2, 3, 4, 5)]
    slower = [_pass("y", t, 2.0, 16, [100.0 + i for i in range(8)], 2.5) for t in (1, 2, 3, 4, 5)]
    comp = analysis.compare(faster, slower, name_a="x")
    assert comp.output_tok_s.ratio == 2.0
    assert comp.output_tok_s.verdict == "x faster"
    assert comp.e2e_ms.verdict == "x lower (better)"
    assert comp.e2e_ms.wilcoxon_p < 0.05
    assert comp.accept_length.verdict == "x higher (better)"

    # Trial walls 1,3 vs 3,1: tok/s ratios 3 and 1/3, an interval straddling 1.
    mixed_a = [_pass("x", 1, 1.0, 16, 50.0), _pass("x", 2, 3.0, 16, 50.0)]
    mixed_b = [_pass("y", 1, 3.0, 16, 50.0), _pass("y", 2, 1.0, 16, 50.0)]
    comp = analysis.compare(mixed_a, mixed_b, name_a="x")
    assert comp.output_tok_s.verdict == NO_CLEAR_DIFFERENCE


def test_report_renders_verdicts_mismatches_and_confounds():
    a = [_pass("ddtree", 1, 1.0, 16, 50.0, 4.0)]
    b = [_pass("dflash", 1, 1.0, 16, 50.0, 3.0)]
    point = SweepPoint(
        concurrency=1,
        arms={"ddtree": analysis.arm_metrics(a), "dflash": analysis.arm_metrics(b)},
        comparison=analysis.compare(a, b, name_a="ddtree"),
    )
    mismatch = Mismatch("p3", 1, 1, 5, {"ddtree": 1, "dflash": 2}, {"ddtree": 16, "dflash": 16})
    summary = Summary(
        tool="ddtree test", status=RunStatus.STOPPED, reason="server died", started="now",
        finished="later", algo="ddtree", baseline="dflash", target="url", host=None,
        switches=None, urls={"ddtree": "u1", "dflash": "u2"}, reference=None,
        config=RunConfig(dataset="code", num_prompts=8, max_new_tokens=16, temperature=0.0,
                         concurrency=[1], request_rate=None, trials=1, warmup=1, seed=0,
                         timeout_s=300.0, max_error_rate=0.2),
        sweep=[point],
        lossless=LosslessResult(("ddtree", "dflash"), strict=True, compared=8,
                                mismatches=[mismatch]),
        confounds=Confounds([Difference("random_seed", {"ddtree": 0, "dflash": 1})], True),
        server_info={}, client=[], warnings=["w1"], errors={"ddtree": 0, "dflash": 0},
        files=Files(plots=["throughput.png"]), run_dir="runs/x",
    )  # fmt: skip
    text = report.render(summary)
    assert "**STOPPED**: server died" in text
    assert "| p3 | 1 | 1 | 5 |" in text
    assert "| random_seed | `0` | `1` |" in text
    assert "Result: **FAIL**" in text
    assert "![throughput.png](throughput.png)" in text
    assert "use `--trials 5` or more" in text


def test_two_trials_never_give_a_throughput_verdict():
    fast = [_pass("x", t, 1.0, 16, 50.0) for t in (1, 2)]
    slow = [_pass("y", t, 2.0, 16, 50.0) for t in (1, 2)]
    entry = analysis.compare(fast, slow, name_a="x").output_tok_s
    assert entry.ratio == 2.0 and entry.ci95 == (2.0, 2.0)
    assert entry.verdict == NO_CLEAR_DIFFERENCE and "fewer than 3" in entry.note
