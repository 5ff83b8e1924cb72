"""SGLang 0.5.23's request and response shapes for /generate and /v1/completions.

Pure functions over dicts: parse and validate a request into engine sequences (raising
:class:`BadRequest` with a message the client sees as HTTP 400), and build the response
objects with SGLang's field names.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from ddtree_cli.engine.decoding import RequestState
from ddtree_cli.engine.tokenizer import ByteTokenizer


class BadRequest(ValueError):
    """The request is malformed; the client gets HTTP 400 and this message."""


# Accepted with their neutral value only: anything else would silently change the output.
_NEUTRAL = {
    "top_p": (1.0,),
    "top_k": (-1, 0),
    "min_p": (0.0,),
    "frequency_penalty": (0.0,),
    "presence_penalty": (0.0,),
    "repetition_penalty": (1.0,),
    "n": (1,),
    "stop": (None, "", []),
    "min_new_tokens": (0,),
    "json_schema": (None,),
    "regex": (None,),
    "ebnf": (None,),
    "sampling_seed": (None,),
}
_IGNORED = {"skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim"}


@dataclass(frozen=True)
class Limits:
    vocab_size: int
    context_length: int
    eos_token_id: int


@dataclass
class GenerateItem:
    seq: RequestState
    rid: str | None
    skip_special_tokens: bool = True


def _int(value: Any, name: str, low: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise BadRequest(f"{name} must be an integer, got {value!r}")
    if low is not None and value < low:
        raise BadRequest(f"{name} must be >= {low}, got {value}")
    return value


def _float(value: Any, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise BadRequest(f"{name} must be a number, got {value!r}")
    return float(value)


def parse_sampling(params: Any, limits: Limits) -> tuple[float, int, frozenset[int], bool]:
    """(temperature, max_new_tokens, stop token ids, skip_special_tokens) with SGLang defaults."""
    if params is None:
        params = {}
    if not isinstance(params, dict):
        raise BadRequest("sampling_params must be an object")
    temperature = _float(params.get("temperature", 1.0), "temperature")
    if temperature < 0:
        raise BadRequest(f"temperature must be >= 0, got {temperature}")
    max_new = params.get("max_new_tokens", 128)
    max_new = 128 if max_new is None else _int(max_new, "max_new_tokens", 0)
    stop_ids = params.get("stop_token_ids") or []
    if not isinstance(stop_ids, list):
        raise BadRequest("stop_token_ids must be a list of integers")
    stops = {_int(t, "stop_token_ids[]", 0) for t in stop_ids}
    if any(t >= limits.vocab_size for t in stops):
        raise BadRequest(f"stop_token_ids must be < the vocabulary size {limits.vocab_size}")
    ignore_eos = params.get("ignore_eos", False)
    if not isinstance(ignore_eos, bool):
        raise BadRequest("ignore_eos must be a boolean")
    if not ignore_eos:
        stops.add(limits.eos_token_id)
    for key, value in params.items():
        if key in ("temperature", "max_new_tokens", "stop_token_ids", "ignore_eos"):
            continue
        if key in _IGNORED:
            continue
        if key not in _NEUTRAL:
            raise BadRequest(f"unknown sampling parameter {key!r}")
        if value not in _NEUTRAL[key]:
            raise BadRequest(
                f"sampling parameter {key}={value!r} is not supported by the embedded engine"
            )
    skip = params.get("skip_special_tokens", True)
    return temperature, max_new, frozenset(stops), bool(skip)


def _prompt_ids(value: Any, tokenizer: ByteTokenizer, limits: Limits, name: str) -> list[int]:
    if isinstance(value, str):
        ids = tokenizer.encode(value)
    elif isinstance(value, list) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in value
    ):
        ids = list(value)
        bad = [t for t in ids if not 0 <= t < limits.vocab_size]
        if bad:
            raise BadRequest(f"{name} has token ids outside [0, {limits.vocab_size}): {bad[:5]}")
    else:
        raise BadRequest(f"{name} must be a string or a list of token ids")
    if not ids:
        raise BadRequest(f"{name} is empty")
    return ids


def _check_length(ids: list[int], max_new: int, limits: Limits) -> None:
    if len(ids) + max_new > limits.context_length:
        raise BadRequest(
            f"the input ({len(ids)} tokens) plus max_new_tokens ({max_new}) is longer than "
            f"the context length ({limits.context_length} tokens)"
        )


def parse_generate(body: Any, tokenizer: ByteTokenizer, limits: Limits) -> tuple[list, bool, bool]:
    """/generate → (items, is_batch, stream)."""
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    text, input_ids = body.get("text"), body.get("input_ids")
    if (text is None) == (input_ids is None):
        raise BadRequest("give exactly one of text or input_ids")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise BadRequest("stream must be a boolean")
    for key in ("return_logprob", "return_hidden_states", "lora_path", "image_data"):
        if body.get(key):
            raise BadRequest(f"{key} is not supported by the embedded engine")
    if text is not None:
        is_batch = isinstance(text, list)
        prompts = text if is_batch else [text]
        name = "text"
    else:
        is_batch = (
            isinstance(input_ids, list) and bool(input_ids) and isinstance(input_ids[0], list)
        )
        prompts = input_ids if is_batch else [input_ids]
        name = "input_ids"
    if is_batch and not prompts:
        raise BadRequest(f"{name} is an empty batch")
    if is_batch and stream:
        raise BadRequest("streaming a batch of prompts is not supported; send one per request")
    params = body.get("sampling_params")
    params_list = params if isinstance(params, list) else [params] * len(prompts)
    if len(params_list) != len(prompts):
        raise BadRequest("sampling_params list must have one entry per prompt")
    rids = body.get("rid")
    rid_list = rids if isinstance(rids, list) else [rids] * len(prompts)
    items = []
    for i, (prompt, p) in enumerate(zip(prompts, params_list, strict=True)):
        ids = _prompt_ids(prompt, tokenizer, limits, f"{name}[{i}]" if is_batch else name)
        temperature, max_new, stops, skip = parse_sampling(p, limits)
        _check_length(ids, max_new, limits)
        rid = rid_list[i] if is_batch or rids is not None else None
        if rid is not None and not isinstance(rid, str):
            raise BadRequest("rid must be a string")
        items.append(GenerateItem(RequestState(ids, max_new, temperature, stops), rid, skip))
    return items, is_batch, stream


def parse_completions(
    body: Any, tokenizer: ByteTokenizer, limits: Limits
) -> tuple[GenerateItem, bool, str]:
    """/v1/completions (one prompt) → (item, stream, model name)."""
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise BadRequest("send one prompt per request")
        prompt = prompt[0]
    if prompt is None:
        raise BadRequest("prompt is required")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise BadRequest("stream must be a boolean")
    params = {
        "temperature": body.get("temperature", 1.0),
        "max_new_tokens": body.get("max_tokens", 16),
    }
    for key in (
        "top_p",
        "top_k",
        "min_p",
        "frequency_penalty",
        "presence_penalty",
        "repetition_penalty",
        "n",
        "stop",
        "stop_token_ids",
        "ignore_eos",
    ):
        if body.get(key) is not None:
            params[key] = body[key]
    ids = _prompt_ids(prompt, tokenizer, limits, "prompt")
    temperature, max_new, stops, _ = parse_sampling(params, limits)
    _check_length(ids, max_new, limits)
    model = body.get("model") or "default"
    return GenerateItem(RequestState(ids, max_new, temperature, stops), None), stream, str(model)


@dataclass(frozen=True)
class SpecInfo:
    algorithm: str | None  # "DFLASH" / "DDTREE" / None
    num_draft_tokens: int


def meta_info(rid: str, seq: RequestState, spec: SpecInfo, e2e_latency: float | None) -> dict:
    info: dict[str, Any] = {
        "id": rid,
        "finish_reason": seq.finish_reason,
        "prompt_tokens": len(seq.prompt),
        "completion_tokens": len(seq.output),
        "cached_tokens": 0,
    }
    if seq.finished:
        info["e2e_latency"] = e2e_latency
        if spec.algorithm and seq.verify_ct > 0:
            proposed = seq.verify_ct * (spec.num_draft_tokens - 1)
            info["spec_accept_rate"] = seq.correct_drafts / proposed if proposed else 0.0
            info["spec_accept_length"] = len(seq.output) / seq.verify_ct
            info["spec_num_correct_drafts"] = seq.correct_drafts
            info["spec_num_proposed_drafts"] = proposed
            info["spec_verify_ct"] = seq.verify_ct
            info["spec_correct_drafts_histogram"] = list(seq.correct_drafts_histogram)
    return info


def generate_response(rid, seq, tokenizer, spec, e2e, skip_special_tokens=True) -> dict:
    return {
        "text": tokenizer.decode(seq.output, skip_special_tokens),
        "output_ids": list(seq.output),
        "meta_info": meta_info(rid, seq, spec, e2e),
    }


def completion_finish_reason(seq: RequestState) -> tuple[str | None, int | None]:
    if seq.finish_reason is None:
        return None, None
    if seq.finish_reason["type"] == "stop":
        return "stop", seq.finish_reason.get("matched")
    return "length", None


def completion_response(rid, seq, tokenizer, model: str) -> dict:
    reason, matched = completion_finish_reason(seq)
    return {
        "id": rid,
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {
                "index": 0,
                "text": tokenizer.decode(seq.output),
                "logprobs": None,
                "finish_reason": reason,
                "matched_stop": matched,
            }
        ],
        "usage": {
            "prompt_tokens": len(seq.prompt),
            "completion_tokens": len(seq.output),
            "total_tokens": len(seq.prompt) + len(seq.output),
        },
    }
