"""From per-request records to per-arm metrics and the A/B comparison (summary.json).

Throughput is compared per trial: trial t of both arms ran back to back (ABAB…, order
randomised), so they form a pair, and the ratio's interval comes from resampling those
pairs. Latency and acceptance are compared per prompt: each prompt's median over trials
in one arm against the same in the other, with a paired bootstrap interval of the ratio
and a Wilcoxon signed-rank test; a difference is claimed only when both agree.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable
from typing import Any

import numpy as np

from ddtree_cli.bench.loadgen import PassResult
from ddtree_cli.bench.stats import (
    NO_CLEAR_DIFFERENCE,
    bootstrap_mean_ci,
    bootstrap_ratio_ci,
    percentiles,
    relative_mad,
    verdict,
    wilcoxon_signed_rank,
)
from ddtree_cli.bench.summary import ArmMetrics, Comparison, Effect, Percentiles, TrialThroughput

NOISY_REL_MAD = 0.05
WILCOXON_ALPHA = 0.05
MIN_PAIRS = 3
# (metric, better when higher?) compared per prompt.
PER_PROMPT_METRICS = (
    ("e2e_ms", False),
    ("ttft_ms", False),
    ("tpot_ms", False),
    ("accept_length", True),
)


def _ok(records: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in records if r["ok"]]


def arm_metrics(passes: list[PassResult]) -> ArmMetrics:
    """Metrics of one arm at one concurrency, over its trials."""
    records = [r for p in passes for r in p.records]
    ok = _ok(records)
    trials = []
    for p in sorted(passes, key=lambda p: p.trial):
        tp = p.throughput()
        trials.append(
            TrialThroughput(
                trial=p.trial,
                output_tok_s=_round(tp["output_tok_s"]),
                request_s=_round(tp["request_s"]),
                wall_s=_round(p.wall_s),
                requests=len(p.records),
                errors=p.errors,
                stopped=p.stopped,
            )
        )
    tok_s = [t.output_tok_s for t in trials if t.output_tok_s is not None]
    req_s = [t.request_s for t in trials if t.request_s is not None]
    with_spec = [r for r in ok if r.get("spec_verify_ct")]
    pooled_accept = (
        sum(r["completion_tokens"] for r in with_spec) / sum(r["spec_verify_ct"] for r in with_spec)
        if with_spec
        else None
    )
    rel_mad = relative_mad(tok_s)
    ci = bootstrap_mean_ci(tok_s)
    return ArmMetrics(
        output_tok_s=_round(float(np.mean(tok_s))) if tok_s else None,
        output_tok_s_ci95=(_round(ci[0]), _round(ci[1])) if ci else None,
        request_s=_round(float(np.mean(req_s))) if req_s else None,
        accept_length=_round(pooled_accept),
        accept_length_per_request=_pct([r["accept_length"] for r in with_spec]),
        ttft_ms=_pct([r["ttft_ms"] for r in ok if r.get("ttft_ms") is not None]),
        tpot_ms=_pct([r["tpot_ms"] for r in ok if r.get("tpot_ms") is not None]),
        e2e_ms=_pct([r["e2e_ms"] for r in ok]),
        itl_ms=_pct([x for r in ok for x in r.get("itl_ms") or ()]),
        tokens_per_chunk=_pct([x for r in ok for x in r.get("chunk_tokens") or ()]),
        completion_tokens=sum(r["completion_tokens"] for r in ok),
        requests=len(records),
        errors=len(records) - len(ok),
        spec_active=bool(with_spec),
        trials=trials,
        trial_rel_mad=_round(rel_mad),
        noisy=bool(rel_mad is not None and rel_mad > NOISY_REL_MAD),
    )


def compare(
    passes_a: list[PassResult], passes_b: list[PassResult], *, name_a: str, seed: int = 0
) -> Comparison:
    """Arm A (under test) against arm B (baseline), ratios A/B."""
    out: dict[str, Effect] = {}
    by_trial_a = {p.trial: p.throughput() for p in passes_a}
    by_trial_b = {p.trial: p.throughput() for p in passes_b}
    trials = sorted(
        t
        for t in by_trial_a.keys() & by_trial_b.keys()
        if all(math.isfinite(d[t]["output_tok_s"]) for d in (by_trial_a, by_trial_b))
    )
    for metric in ("output_tok_s", "request_s"):
        out[metric] = compare_trials(
            {t: by_trial_a[t][metric] for t in trials},
            {t: by_trial_b[t][metric] for t in trials},
            name_a=name_a,
            seed=seed,
        )
    recs_a = _ok(r for p in passes_a for r in p.records)
    recs_b = _ok(r for p in passes_b for r in p.records)
    for metric, higher in PER_PROMPT_METRICS:
        a_by, b_by = _per_prompt(recs_a, metric), _per_prompt(recs_b, metric)
        prompts = sorted(a_by.keys() & b_by.keys())
        a = [a_by[p] for p in prompts]
        b = [b_by[p] for p in prompts]
        entry = _ratio_entry(
            a,
            b,
            paired_by="prompt",
            higher_is_better=higher,
            seed=seed,
            better=f"{name_a} {'higher' if higher else 'lower'} (better)",
            worse=f"{name_a} {'lower' if higher else 'higher'} (worse)",
        )
        if prompts:
            w = wilcoxon_signed_rank(a, b)
            entry.wilcoxon_p = _round(w.p_value, 6)
            entry.wilcoxon_method = w.method
            # A percentile bootstrap over few prompts is too narrow; a per-prompt claim
            # needs the paired test to agree before it is called a difference.
            if entry.verdict != NO_CLEAR_DIFFERENCE and w.p_value >= WILCOXON_ALPHA:
                entry.verdict = NO_CLEAR_DIFFERENCE
                entry.note = "the interval excludes 1 but the Wilcoxon test does not reject"
        out[metric] = entry
    return Comparison(**out)


def compare_trials(
    a: dict[int, float | None], b: dict[int, float | None], *, name_a: str, seed: int = 0
) -> Effect:
    """A throughput of arm A against arm B (``trial -> value`` of each arm), paired by trial
    over the trials both finished: what ``compare`` gives each arm against the baseline, and
    what two arms under test get from a finished bench's summary.json."""
    trials = sorted(
        t
        for t in a.keys() & b.keys()
        if all(d[t] is not None and math.isfinite(d[t]) for d in (a, b))
    )
    return _ratio_entry(
        [a[t] for t in trials],
        [b[t] for t in trials],
        paired_by="trial",
        higher_is_better=True,
        seed=seed,
        better=f"{name_a} faster",
        worse=f"{name_a} slower",
    )


def _per_prompt(records: list[dict[str, Any]], metric: str) -> dict[str, float]:
    values: dict[str, list[float]] = defaultdict(list)
    for r in records:
        v = r.get(metric)
        if v is not None and math.isfinite(v):
            values[r["prompt_id"]].append(v)
    return {p: float(np.median(v)) for p, v in values.items()}


def _ratio_entry(
    a: list[float],
    b: list[float],
    *,
    paired_by: str,
    higher_is_better: bool,
    seed: int,
    better: str,
    worse: str,
) -> Effect:
    if not a or not b:
        return Effect(ratio=None, ci95=None, n=0, paired_by=paired_by, verdict="not measured")
    ci = bootstrap_ratio_ci(a, b, paired=True, seed=seed)
    entry = Effect(
        ratio=_round(ci.ratio, 6),
        ci95=(_round(ci.ci95[0], 6), _round(ci.ci95[1], 6)),
        n=ci.n,
        paired_by=paired_by,
        verdict=verdict(ci, higher_is_better=higher_is_better, better=better, worse=worse),
    )
    if ci.n < MIN_PAIRS and entry.verdict != NO_CLEAR_DIFFERENCE:
        # Resampling one or two pairs cannot give a 95% interval worth the name.
        entry.verdict = NO_CLEAR_DIFFERENCE
        entry.note = f"fewer than {MIN_PAIRS} pairs ({paired_by}s)"
    return entry


def _pct(values: list[float]) -> Percentiles:
    return Percentiles(**{k: _round(v) for k, v in percentiles(values, (50, 90, 99)).items()})


def _round(v: float | None, digits: int = 4) -> float | None:
    if v is None or not math.isfinite(v):
        return None
    return round(float(v), digits)
