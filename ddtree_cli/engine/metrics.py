"""GET /metrics: Prometheus text exposition with SGLang's ``sglang:`` metric names."""

from __future__ import annotations

from typing import Any

from ddtree_cli.engine.scheduler import BUCKETS, Histogram


def _labels(app: Any) -> str:
    return f'model_name="{app.served_model_name}",engine_type="unified",tp_rank="0",pp_rank="0"'


def render_metrics(app: Any) -> str:
    stats = app.scheduler.stats
    spec = app.spec()
    labels = _labels(app)
    lines: list[str] = []

    def metric(name: str, kind: str, help_: str, value: float) -> None:
        lines.append(f"# HELP sglang:{name} {help_}")
        lines.append(f"# TYPE sglang:{name} {kind}")
        lines.append(f"sglang:{name}{{{labels}}} {value}")

    def histogram(name: str, help_: str, h: Histogram) -> None:
        lines.append(f"# HELP sglang:{name} {help_}")
        lines.append(f"# TYPE sglang:{name} histogram")
        for bound, count in zip(BUCKETS, h.counts, strict=True):
            lines.append(f'sglang:{name}_bucket{{{labels},le="{bound}"}} {count}')
        lines.append(f'sglang:{name}_bucket{{{labels},le="+Inf"}} {h.n}')
        lines.append(f"sglang:{name}_sum{{{labels}}} {h.total}")
        lines.append(f"sglang:{name}_count{{{labels}}} {h.n}")

    metric(
        "prompt_tokens_total", "counter", "Number of prefill tokens processed.", stats.prompt_tokens
    )
    metric(
        "generation_tokens_total",
        "counter",
        "Number of generation tokens processed.",
        stats.generation_tokens,
    )
    metric("num_requests_total", "counter", "Number of requests processed.", stats.num_requests)
    metric(
        "num_aborted_requests_total", "counter", "Number of requests aborted.", stats.num_aborted
    )
    metric(
        "num_running_reqs", "gauge", "The number of running requests.", app.scheduler.num_running
    )
    metric(
        "num_queue_reqs",
        "gauge",
        "The number of requests in the waiting queue.",
        app.scheduler.num_waiting,
    )
    metric(
        "gen_throughput",
        "gauge",
        "The generation throughput (token/s).",
        app.scheduler.last_throughput,
    )
    # Lifetime averages (SGLang reports these per logging interval).
    accept_len = stats.avg_spec_accept_length
    drafts_per_round = max(spec.num_draft_tokens - 1, 0)
    proposed = stats.spec_verify_calls * drafts_per_round
    metric(
        "spec_accept_length",
        "gauge",
        "The average acceptance length of speculative decoding.",
        accept_len,
    )
    metric(
        "spec_accept_rate",
        "gauge",
        "The average acceptance rate of speculative decoding.",
        stats.spec_correct_drafts / proposed if proposed else 0.0,
    )
    metric(
        "spec_num_draft_tokens", "gauge", "Draft tokens per verify round.", spec.num_draft_tokens
    )
    metric(
        "spec_verify_calls_total",
        "counter",
        "Speculative verify rounds, per request.",
        stats.spec_verify_calls,
    )
    policy = app.engine.policy if app.engine is not None else None
    if policy is not None:
        name = "spec_ddtree_budget"
        lines.append(f"# HELP sglang:{name} DDTree budget in use per batch bucket (--budget auto).")
        lines.append(f"# TYPE sglang:{name} gauge")
        for bucket, state in policy.snapshot()["buckets"].items():
            if state["budget"] is not None:
                lines.append(f'sglang:{name}{{{labels},batch_bucket="{bucket}"}} {state["budget"]}')
    histogram(
        "time_to_first_token_seconds", "Histogram of time to first token in seconds.", stats.ttft
    )
    histogram(
        "e2e_request_latency_seconds",
        "Histogram of End-to-end request latency in seconds",
        stats.e2e,
    )
    return "\n".join(lines) + "\n"
