"""The Markdown report of a run, rendered from its :class:`~ddtree_cli.bench.summary.Summary`
alone (``Summary.from_json`` rebuilds one from a stored ``summary.json``)."""

from __future__ import annotations

from typing import Any

from ddtree_cli.bench.stats import NO_CLEAR_DIFFERENCE
from ddtree_cli.bench.summary import Comparison, Effect, Percentiles, Summary, SweepPoint

_COMPARED = (
    ("output_tok_s", "output tok/s"),
    ("request_s", "requests/s"),
    ("e2e_ms", "end-to-end latency"),
    ("ttft_ms", "TTFT"),
    ("tpot_ms", "TPOT"),
    ("accept_length", "acceptance length"),
)


def _num(v: Any, digits: int = 2) -> str:
    if v is None:
        return "—"
    if isinstance(v, float):
        return f"{v:,.{digits}f}"
    return str(v)


def _pair(d: Percentiles) -> str:
    if d.empty:
        return "—"
    return f"{_num(d.p50)} / {_num(d.p99)}"


def render(summary: Summary) -> str:
    out: list[str] = []
    cfg = summary.config
    arms = list(summary.urls) or list(summary.arms)
    title = " vs ".join(arms) if arms else summary.algo
    out.append(f"# ddtree bench: {title}\n")
    status = summary.status.value
    if status != "complete":
        out.append(f"> **{status.upper()}**: {summary.reason or ''} — partial results.\n")
    prompts = (
        f"{', '.join(map(str, cfg.num_prompts))} prompts (one count per concurrency)"
        if isinstance(cfg.num_prompts, list)
        else f"{cfg.num_prompts} prompts"
    )
    out.append(
        f"{prompts} from `{cfg.dataset}`, max {cfg.max_new_tokens} new "
        f"tokens, temperature {cfg.temperature}, concurrency {cfg.concurrency}, "
        f"{cfg.trials} interleaved trial(s) per arm (order randomised, seed {cfg.seed}), "
        f"{cfg.warmup} warmup request(s) per pass not counted. "
        f"Target: {summary.target}. Started {summary.started}.\n"
    )
    if cfg.trials < 5:
        out.append(
            f"Note: with {cfg.trials} trials the throughput interval rests on very few "
            "pairs; use `--trials 5` or more before drawing conclusions.\n"
        )
    _verdicts(out, summary)
    _arms_table(out, summary)
    for point in summary.sweep:
        _point(out, point, summary)
    _lossless(out, summary)
    _confounds(out, summary)
    _client(out, summary)
    _plots(out, summary)
    return "\n".join(out) + "\n"


def _verdicts(out: list[str], summary: Summary) -> None:
    rows = []
    several = any(point.comparisons for point in summary.sweep)
    for point in summary.sweep:
        for arm, comp in summary.compared(point).items():
            entry = comp.output_tok_s
            rows.append(
                f"- {f'{arm}, ' if several else ''}concurrency {point.concurrency}: output "
                f"tok/s ratio {_num(entry.ratio, 3)} (95% CI {_ci(entry)}): **{entry.verdict}**"
            )
    if rows:
        out.append("## Verdict\n")
        name = "each arm under test" if several else summary.algo
        out.append(
            f"Ratios are {name} / {summary.baseline}. A ratio whose 95% interval "
            f'contains 1 is reported as "{NO_CLEAR_DIFFERENCE}".\n'
        )
        out.extend(rows)
        out.append("")


def _arms_table(out: list[str], summary: Summary) -> None:
    """Several arms under test, or a timed reference: one row per arm and concurrency, each
    arm over the baseline and, with --time-reference, over plain decoding."""
    several = any(point.comparisons for point in summary.sweep)
    plain = any(point.over_reference for point in summary.sweep)
    if not (several or plain):
        return
    base = summary.baseline
    head = ["arm", "concurrency"]
    if base:
        head += [f"tok/s ratio over {base}", "95% CI", "verdict"]
    if plain:
        head += ["tok/s ratio over plain", "95% CI", "verdict"]
    head += ["accept length", "ITL p50 ms per chunk"]
    out.append("## Arms\n")
    out.append("| " + " | ".join(head) + " |")
    out.append("|" + "---|" * len(head))
    for arm in summary.under_test + ([base] if base else []):
        for point in summary.sweep:
            m = point.arms.get(arm)
            if m is None:
                continue
            cells = [arm, str(point.concurrency)]
            if base:
                cells += _effect_cells(summary.compared(point).get(arm))
            if plain:
                cells += _effect_cells((point.over_reference or {}).get(arm))
            cells += [_num(m.accept_length, 3), _num(m.itl_ms.p50)]
            out.append("| " + " | ".join(cells) + " |")
    out.append("")


def _effect_cells(comp: Comparison | None) -> list[str]:
    if comp is None:
        return ["—", "—", "—"]
    e = comp.output_tok_s
    return [_num(e.ratio, 3), _ci(e), e.verdict]


def _ci(entry: Effect) -> str:
    ci = entry.ci95
    if not ci:
        return "—"
    return f"{_num(ci[0], 3)}–{_num(ci[1], 3)}"


def _point(out: list[str], point: SweepPoint, summary: Summary) -> None:
    out.append(f"## Concurrency {point.concurrency}\n")
    if point.num_prompts is not None:
        out.append(f"{point.num_prompts} prompts per pass.\n")
    out.append(
        "| arm | output tok/s (95% CI) | req/s | accept length | TTFT p50/p99 ms | "
        "TPOT p50/p99 ms | ITL p50/p99 ms per chunk | tokens/chunk | errors | noise |"
    )
    out.append("|---|---|---|---|---|---|---|---|---|---|")
    for arm, m in point.arms.items():
        ci = m.output_tok_s_ci95
        ci_text = f" ({_num(ci[0], 1)}–{_num(ci[1], 1)})" if ci else ""
        noise = m.trial_rel_mad
        noise_text = "—" if noise is None else f"{noise:.1%}" + (" noisy" if m.noisy else "")
        out.append(
            f"| {arm} | {_num(m.output_tok_s, 1)}{ci_text} | {_num(m.request_s, 3)} | "
            f"{_num(m.accept_length, 3)} | {_pair(m.ttft_ms)} | {_pair(m.tpot_ms)} | "
            f"{_pair(m.itl_ms)} | {_num(m.tokens_per_chunk.mean, 2)} | "
            f"{m.errors}/{m.requests} | {noise_text} |"
        )
    out.append("")
    for arm, comp in summary.compared(point).items():
        out.append(f"Comparison, {arm} / {summary.baseline}:\n")
        out.append("| metric | ratio | 95% CI | paired by | n | Wilcoxon p | verdict |")
        out.append("|---|---|---|---|---|---|---|")
        for key, label in _COMPARED:
            e = getattr(comp, key)
            out.append(
                f"| {label} | {_num(e.ratio, 3)} | {_ci(e)} | {e.paired_by} | {e.n} | "
                f"{_num(e.wilcoxon_p, 4)} | {e.verdict} |"
            )
        out.append("")


def _lossless(out: list[str], summary: Summary) -> None:
    check = summary.lossless
    out.append("## Lossless check\n")
    if check.skipped:
        out.append(f"Skipped: {check.skipped}.\n")
        return
    mode = (
        "exact equality demanded (embedded engine, float32)"
        if check.strict
        else "informational between arms (GPU kernels may flip greedy near-ties; see "
        "docs/bench.md); the reference check below decides"
    )
    n_mis = len(check.mismatches)
    out.append(
        f"{check.compared} outputs compared token for token; {n_mis} differ. Mode: {mode}. "
        f"Result: **{'pass' if check.ok else 'FAIL'}**.\n"
    )
    if n_mis:
        out.append(
            "| prompt | concurrency | trial | first differing token | tokens there | lengths |"
        )
        out.append("|---|---|---|---|---|---|")
        for m in check.mismatches[:50]:
            out.append(
                f"| {m.prompt_id} | {m.concurrency} | {m.trial} | {m.position} | "
                f"{m.tokens} | {m.lengths} |"
            )
        if n_mis > 50:
            out.append(f"\n… and {n_mis - 50} more in summary.json.")
        out.append("")
    ref = check.reference
    if ref:
        out.append(f"Against the reference server ({summary.reference}):\n")
        out.append("| arm | prompts compared | diverged | rate |")
        out.append("|---|---|---|---|")
        for arm, r in ref.arms.items():
            rate = "—" if r.rate is None else f"{r.rate:.1%}"
            out.append(f"| {arm} | {r.compared} | {r.diverged} | {rate} |")
        out.append("")
        if ref.p_value is not None:
            flagged = ref.flagged
            out.append(
                f"McNemar exact p = {ref.p_value:.4g} on the prompts where only one arm "
                "diverged. "
                + (
                    f"**Arm '{flagged[0]}' diverges clearly more often: a bug, not noise.**"
                    if flagged
                    else "Neither arm diverges clearly more often than the other."
                )
                + "\n"
            )
        elif ref.p_values is not None or ref.flagged:
            ps = ", ".join(f"{arm} {p:.4g}" for arm, p in (ref.p_values or {}).items())
            out.append(
                "McNemar exact test of each arm under test against the baseline, on the prompts "
                "where only one of the two diverged, Holm-corrected for the number of arms"
                + (f" (p: {ps})" if ps else "")
                + ": "
                + (
                    f"**{', '.join(ref.flagged)} diverge(s) clearly more often: a bug, not noise.**"
                    if ref.flagged
                    else "no arm diverges clearly more often than the baseline."
                )
                + "\n"
            )


def _confounds(out: list[str], summary: Summary) -> None:
    diffs = summary.confounds.differences
    out.append("## Confound guard\n")
    for arm, routed in (summary.replicas or {}).items():
        urls = ", ".join(r.url for r in routed.replicas)
        out.append(
            f"Arm '{arm}' is a router ({routed.router}) over {len(routed.replicas)} "
            f"replica(s), each fingerprinted: {urls}."
            + (
                " They differ among themselves in "
                + ", ".join(f"`{d.key}`" for d in routed.differences)
                + " (run anyway with --allow-mismatch)."
                if routed.differences
                else " They are the same server but for where they run."
            )
            + "\n"
        )
    if not diffs:
        out.append("The arms' `/server_info` fingerprints differ only in the algorithm.\n")
        return
    out.append(
        "The arms differ in more than the algorithm"
        + (" (run anyway with --allow-mismatch)" if summary.confounds.allowed else "")
        + ":\n"
    )
    out.append("| key | " + " | ".join(diffs[0].values) + " |")
    out.append("|---|" + "---|" * len(diffs[0].values))
    for d in diffs:
        out.append(f"| {d.key} | " + " | ".join(f"`{v}`" for v in d.values.values()) + " |")
    out.append("")


def _client(out: list[str], summary: Summary) -> None:
    out.append("## Client\n")
    loads = [c.load for c in summary.client]
    if loads:
        worst_cpu = max(x.cpu_fraction for x in loads)
        worst_lag = max(x.lag_p99_ms for x in loads)
        out.append(
            f"Highest client CPU use in a pass: {worst_cpu:.0%} of one core; worst event-loop "
            f"lag p99: {worst_lag:.2f} ms.\n"
        )
    for w in summary.warnings:
        out.append(f"- Warning: {w}")
    errors = summary.errors
    if any(errors.values()):
        out.append("- Failed requests: " + ", ".join(f"{a}: {n}" for a, n in errors.items()))
    out.append("")


def _plots(out: list[str], summary: Summary) -> None:
    plots = summary.files.plots
    if not plots:
        return
    out.append("## Plots\n")
    for name in plots:
        out.append(f"![{name}]({name})\n")
