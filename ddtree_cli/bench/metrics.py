"""Per-request metrics from what the client saw and what the server's ``meta_info`` said.

Token counts come from the server (``meta_info.completion_tokens``), never from
retokenizing text. Under speculative decoding one chunk carries several tokens, so ITL is
kept per chunk together with the tokens in that chunk; TPOT is per token.
"""

from __future__ import annotations

from typing import Any

from ddtree_cli.bench.client import StreamResult


def request_record(
    result: StreamResult,
    *,
    arm: str,
    concurrency: int,
    trial: int,
    prompt_id: str,
    index: int,
    pass_start: float,
) -> dict[str, Any]:
    """One JSONL line: identifiers, timings in ms, token counts, acceptance, output ids."""
    rec: dict[str, Any] = {
        "arm": arm,
        "concurrency": concurrency,
        "trial": trial,
        "prompt_id": prompt_id,
        "index": index,
        "ok": result.ok,
        "error": result.error,
        "start_s": round(result.start - pass_start, 6),
        "e2e_ms": round((result.end - result.start) * 1000.0, 4),
    }
    if not result.ok:
        return rec
    meta = (result.final or {}).get("meta_info") or {}
    counts = result.chunk_counts
    times = result.chunk_times
    completion = int(meta.get("completion_tokens") or (counts[-1] if counts else 0))
    ttft = (times[0] - result.start) * 1000.0 if times else None
    decode_ms = (times[-1] - times[0]) * 1000.0 if len(times) > 1 else 0.0
    rec.update(
        ttft_ms=round(ttft, 4) if ttft is not None else None,
        # Time per output token after the first, over the streamed span.
        tpot_ms=round(decode_ms / (completion - counts[0]), 4)
        if counts and completion > counts[0] and len(times) > 1
        else None,
        itl_ms=[round((b - a) * 1000.0, 4) for a, b in zip(times, times[1:], strict=False)],
        chunk_tokens=[b - a for a, b in zip([0, *counts], counts, strict=False)],
        completion_tokens=completion,
        prompt_tokens=meta.get("prompt_tokens"),
        finish_reason=_finish(meta.get("finish_reason")),
    )
    verify = meta.get("spec_verify_ct")
    if isinstance(verify, (int, float)) and verify > 0:
        rec["spec_verify_ct"] = int(verify)
        rec["accept_length"] = round(completion / verify, 6)
    else:
        rec["spec_verify_ct"] = None
        rec["accept_length"] = None
    rec["output_ids"] = result.output_ids
    return rec


def _finish(reason: Any) -> str | None:
    if isinstance(reason, dict):
        return str(reason.get("type"))
    return None if reason is None else str(reason)
