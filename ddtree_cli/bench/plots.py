"""PNG plots of a run (matplotlib, Agg backend: no display needed; the ``plots`` extra)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ddtree_cli.bench.loadgen import PassResult
from ddtree_cli.bench.summary import Summary
from ddtree_cli.extras import PLOTS

try:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
except ImportError:  # a plain install: the run still writes its JSON and Markdown
    plt = None

NAMES = ("throughput.png", "acceptance.png", "latency_cdf.png")


class PlotsSkipped(Exception):
    """matplotlib is missing; the message names the skipped plots and the install line."""


def render_all(summary: Summary, passes: list[PassResult], run_dir: Path) -> list[str]:
    if plt is None:
        raise PlotsSkipped(
            f"matplotlib is not installed, skipped {', '.join(NAMES)}: {PLOTS.install_line()}"
        )
    written = []
    for name, fn in zip(NAMES, (_throughput, _acceptance, _latency_cdf), strict=True):
        fig = fn(summary, passes)
        if fig is None:
            continue
        fig.savefig(run_dir / name, dpi=110, bbox_inches="tight")
        plt.close(fig)
        written.append(name)
    return written


def _arms(summary: Summary) -> list[str]:
    seen: list[str] = []
    for point in summary.sweep:
        for arm in point.arms:
            if arm not in seen:
                seen.append(arm)
    return seen


def _throughput(summary: Summary, passes: list[PassResult]):
    if not summary.sweep:
        return None
    fig, ax = plt.subplots(figsize=(6, 4))
    for arm in _arms(summary):
        xs, ys, lo, hi = [], [], [], []
        for point in summary.sweep:
            m = point.arms.get(arm)
            if not m or m.output_tok_s is None:
                continue
            xs.append(point.concurrency)
            ys.append(m.output_tok_s)
            ci = m.output_tok_s_ci95 or (m.output_tok_s, m.output_tok_s)
            lo.append(m.output_tok_s - ci[0])
            hi.append(ci[1] - m.output_tok_s)
        if xs:
            ax.errorbar(xs, ys, yerr=[lo, hi], marker="o", capsize=4, label=arm)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrency")
    ax.set_ylabel("output tokens/s (mean over trials, 95% CI)")
    ax.set_title("Throughput vs concurrency")
    ax.grid(alpha=0.3)
    ax.legend()
    return fig


def _acceptance(summary: Summary, passes: list[PassResult]):
    by_arm: dict[str, list[float]] = {}
    for p in passes:
        for r in p.records:
            if r["ok"] and r.get("accept_length") is not None:
                by_arm.setdefault(p.arm, []).append(r["accept_length"])
    if not by_arm:
        return None
    fig, ax = plt.subplots(figsize=(6, 4))
    top = max(max(v) for v in by_arm.values())
    bins = np.linspace(1.0, max(top, 1.5), 30)
    for arm, values in by_arm.items():
        ax.hist(values, bins=bins, alpha=0.55, label=f"{arm} (n={len(values)})")
    ax.set_xlabel("acceptance length per request (completion_tokens / spec_verify_ct)")
    ax.set_ylabel("requests")
    ax.set_title("Acceptance length")
    ax.legend()
    return fig


def _latency_cdf(summary: Summary, passes: list[PassResult]):
    series: dict[tuple[str, int], list[float]] = {}
    for p in passes:
        values = [r["e2e_ms"] for r in p.records if r["ok"]]
        series.setdefault((p.arm, p.concurrency), []).extend(values)
    series = {k: v for k, v in series.items() if v}
    if not series:
        return None
    fig, ax = plt.subplots(figsize=(6, 4))
    for (arm, conc), values in sorted(series.items()):
        xs = np.sort(values)
        ys = np.arange(1, xs.size + 1) / xs.size
        ax.step(xs, ys, where="post", label=f"{arm} @ c={conc}")
    ax.set_xlabel("end-to-end latency (ms)")
    ax.set_ylabel("fraction of requests")
    ax.set_title("Latency CDF")
    ax.grid(alpha=0.3)
    ax.legend()
    return fig
