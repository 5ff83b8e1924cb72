"""DDTREE helpers: the budget argument, request validation, the hybrid gate, the top-K
draft head and the tree's verify inputs."""

from __future__ import annotations

import argparse
import json
import logging
from typing import TYPE_CHECKING, Any, Optional, Tuple

if TYPE_CHECKING:
    import torch

    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.server_args import ServerArgs

logger = logging.getLogger(__name__)

# Targets with recurrent (Mamba / linear-attention / short-conv) layers. Their verify scan
# processes the D verify tokens in flat order, i.e. as a chain, so a tree verify computes
# wrong states for every node whose parent is not the previous node.
_HYBRID_MODEL_TYPES = frozenset(
    {
        "bailing_hybrid",
        "falcon_h1",
        "granitemoehybrid",
        "jamba",
        "jet_nemotron",
        "kimi_linear",
        "lfm2",
        "lfm2_moe",
        "mamba",
        "mamba2",
        "nemotron_h",
        "qwen3_5",
        "qwen3_5_moe",
        "qwen3_5_text",
        "qwen3_5_moe_text",
        "qwen3_next",
        "zamba2",
    }
)
_HYBRID_CONFIG_FIELDS = ("hybrid_override_pattern", "linear_attn_config", "layers_block_type")
_RECURRENT_LAYER_TYPES = frozenset({"linear_attention", "mamba", "mamba2", "conv", "gdn"})


class _BudgetError(argparse.ArgumentTypeError, ValueError):
    """What argparse shows in one line and Python code catches as a ValueError."""


def ddtree_budget_arg(value: Any):
    """``--speculative-ddtree-budget``: a whole number (its range is checked by
    ``_handle_ddtree``) or ``"auto"``; anything else is refused in one line (argparse shows
    the message; from Python it is a ValueError)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    text = str(value).strip()
    if text.lower() == "auto":
        return "auto"
    try:
        return int(text)
    except ValueError:
        raise _BudgetError(
            f"--speculative-ddtree-budget must be a number of tree nodes or 'auto', "
            f"got {value!r}"
        ) from None


def ddtree_budget_number(value: Any) -> int:
    """``--speculative-ddtree-budget`` where ``auto`` is not built (the v2 releases):
    ``ddtree_budget_arg`` less ``auto``, each refusal in one line that says what to give."""
    try:
        budget = ddtree_budget_arg(value)
    except _BudgetError:
        raise _BudgetError(
            f"--speculative-ddtree-budget must be a number of tree nodes, got {value!r}"
        ) from None
    if budget == "auto":
        raise _BudgetError(
            "--speculative-ddtree-budget auto runs on SGLang 0.5.13 only for now: give a "
            "number of tree nodes (block size - 1, the default, or more)"
        )
    return budget


def refuse_budget_auto(server_args: "ServerArgs", why: str) -> None:
    """Where ``--speculative-ddtree-budget auto`` is not implemented: one clear error."""
    budget = getattr(server_args, "speculative_ddtree_budget", None)
    if isinstance(budget, str) and budget.strip().lower() == "auto":
        raise ValueError(f"--speculative-ddtree-budget auto is not supported {why}.")


def hybrid_reason_from_config(hf_config: Any) -> Optional[str]:
    """Why ``hf_config`` describes a hybrid (recurrent + attention) model, or None."""
    try:
        from sglang.srt.configs.linear_attn_model_registry import get_linear_attn_config

        registered = get_linear_attn_config(hf_config)
    except Exception:  # the registry is an optimisation of the checks below
        registered = None
    if registered is not None:
        return f"{type(registered[1]).__name__} is a registered linear-attention model"

    configs = [hf_config]
    get_text_config = getattr(hf_config, "get_text_config", None)
    if callable(get_text_config):
        text_config = get_text_config()
        if text_config is not hf_config:
            configs.append(text_config)
    for config in configs:
        model_type = getattr(config, "model_type", None)
        if model_type in _HYBRID_MODEL_TYPES:
            return f"model_type {model_type!r}"
        for name in _HYBRID_CONFIG_FIELDS:
            if getattr(config, name, None):
                return f"config field {name!r}"
        layer_types = getattr(config, "layer_types", None) or ()
        recurrent = sorted({t for t in layer_types if t in _RECURRENT_LAYER_TYPES})
        if recurrent:
            return f"layer_types {recurrent}"
    return None


def ddtree_target_hybrid_reason(server_args: "ServerArgs") -> Optional[str]:
    """Read the target's config and say why it is hybrid, or None.

    If the config cannot be read here, the worker repeats the check on the loaded model.
    """
    from sglang.srt.utils.hf_transformers_utils import get_config

    try:
        hf_config = get_config(
            server_args.model_path,
            trust_remote_code=server_args.trust_remote_code,
            revision=server_args.revision,
            model_override_args=json.loads(server_args.json_model_override_args or "{}"),
        )
    except Exception as e:
        logger.warning(
            "DDTREE could not read the target config to check for a hybrid model (%s); "
            "the worker checks the loaded model instead.",
            e,
        )
        return None
    return hybrid_reason_from_config(hf_config)


def check_ddtree_algorithm(server_args: "ServerArgs", worker: str):
    """The algorithm a DDTREE worker is built for, and the page size it needs: refused with
    a clear error before any model loads. Returns the resolved ``SpeculativeAlgorithm``."""
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    algorithm = SpeculativeAlgorithm.from_string(server_args.speculative_algorithm)
    if not algorithm.is_ddtree():
        raise ValueError(
            f"Unsupported speculative algorithm: {server_args.speculative_algorithm} "
            f"({worker} runs DDTREE only)."
        )
    if int(server_args.page_size or 1) != 1:
        raise ValueError(f"DDTREE requires page_size == 1, got {server_args.page_size}.")
    return algorithm


def refuse_hybrid_target(target_worker: Any, server_args: "ServerArgs") -> None:
    """The worker's own hybrid gate, on the loaded model (``_handle_ddtree`` checks the
    config before; this catches what the config did not say)."""
    hybrid = getattr(target_worker.model_runner, "mambaish_config", None)
    if hybrid is not None and not server_args.speculative_ddtree_allow_hybrid:
        raise ValueError(
            f"DDTREE refuses hybrid target models ({type(hybrid).__name__}); "
            "pass --speculative-ddtree-allow-hybrid to override at your own risk."
        )


def validate_ddtree_request(req: "Req") -> Optional[str]:
    """Reject what DDTREE cannot serve yet, with a message the client sees."""
    if req.return_logprob:
        return "DDTREE speculative decoding does not support return_logprob yet."
    params = req.sampling_params
    if any(
        getattr(params, name, None) is not None
        for name in ("json_schema", "regex", "ebnf", "structural_tag")
    ):
        return (
            "DDTREE speculative decoding does not support grammar-constrained decoding "
            "(json_schema, regex, ebnf, structural_tag) yet."
        )
    return None


def draft_topk_logprobs(
    hidden_states: "torch.Tensor", lm_head: Any, k: int, tp_group: Any, chunk_size: int = 256
) -> Tuple["torch.Tensor", "torch.Tensor"]:
    """Top-K log-probabilities of the target LM head at every drafted position.

    ``hidden_states [bs, L, H]`` -> ``(logprobs, ids)``, both ``[bs, L, K]``, rows sorted
    descending. With tensor parallelism each rank ranks its vocabulary shard and
    all-gathers only ``2K + 1`` numbers per row (top-K logits, ids, log-sum-exp), which
    ``ddtree_tree.merge_shard_topk`` turns into the exact global top-K: the full logits
    are never gathered. Shapes depend only on the batch, so the head is CUDA-graph safe.
    With one rank and no added vocabulary there is nothing to merge: each chunk's logits go
    straight to ``ddtree_tree.topk_logprobs``.
    """
    import torch

    from sglang.srt.speculative import ddtree_tree

    if not hasattr(lm_head, "weight") or not hasattr(lm_head, "shard_indices"):
        raise RuntimeError(
            "DDTREE needs a vocab-parallel target lm_head with `weight` and `shard_indices` "
            "(a quantized lm_head is not supported yet)."
        )
    bs, n_pos, hidden_size = hidden_states.shape
    shard = lm_head.shard_indices
    weight = lm_head.weight
    num_org = int(shard.num_org_elements)
    num_org_padded = int(shard.num_org_elements_padded)
    num_added = int(shard.num_added_elements)
    tp_size = int(tp_group.world_size) if tp_group is not None else 1
    if num_added > 0 and tp_size > 1:
        raise RuntimeError(
            "DDTREE does not support an added vocabulary with tensor parallelism yet."
        )
    vocab_parts = [(weight[:num_org], int(shard.org_vocab_start_index))]
    if num_added > 0:
        vocab_parts.append(
            (
                weight[num_org_padded : num_org_padded + num_added],
                int(shard.added_vocab_start_index),
            )
        )

    rows = hidden_states.reshape(-1, hidden_size)
    if rows.dtype != weight.dtype:
        rows = rows.to(weight.dtype)
    if tp_size == 1 and len(vocab_parts) == 1:
        # One rank, one vocabulary part: the exact top-K straight from the logits. On a GPU
        # ddtree_tree's fused kernels read them once for the top-K and the log-sum-exp (two
        # launches per chunk); the shard merge below would add a dozen small launches per
        # round to a step that runs between two graph replays.
        w, vocab_start = vocab_parts[0]
        lps, idss = zip(
            *(
                ddtree_tree.topk_logprobs(
                    torch.matmul(rows[start : start + chunk_size], w.T).unsqueeze(0), k
                )
                for start in range(0, rows.shape[0], chunk_size)
            )
        )
        # One chunk (bs * (block - 1) <= chunk_size rows) needs no concatenation copy.
        logprobs = lps[0] if len(lps) == 1 else torch.cat(lps, dim=1)
        top_ids = idss[0] if len(idss) == 1 else torch.cat(idss, dim=1)
        if vocab_start:
            top_ids = top_ids + vocab_start
        return logprobs.view(bs, n_pos, -1), top_ids.view(bs, n_pos, -1)
    values, ids, lses = [], [], []
    for start in range(0, rows.shape[0], chunk_size):
        chunk = rows[start : start + chunk_size]
        parts = [
            ddtree_tree.shard_topk(torch.matmul(chunk, w.T).unsqueeze(0), k, vocab_start)
            for w, vocab_start in vocab_parts
        ]
        values.append(torch.cat([p[0] for p in parts], dim=-1).squeeze(0))
        ids.append(torch.cat([p[1] for p in parts], dim=-1).squeeze(0))
        lses.append(torch.logsumexp(torch.stack([p[2] for p in parts]), dim=0).squeeze(0))
    local_values = torch.cat(values).contiguous()  # [rows, k]
    local_ids = torch.cat(ids).contiguous()
    local_lse = torch.cat(lses).contiguous()  # [rows]
    n_rows, kk = local_values.shape

    if tp_size == 1:
        shards = (local_values[None], local_ids[None], local_lse[None])
    else:
        gathered_values = local_values.new_empty((tp_size * n_rows, kk))
        gathered_ids = local_ids.new_empty((tp_size * n_rows, kk))
        gathered_lse = local_lse.new_empty((tp_size * n_rows,))
        tp_group.all_gather_into_tensor(gathered_values, local_values)
        tp_group.all_gather_into_tensor(gathered_ids, local_ids)
        tp_group.all_gather_into_tensor(gathered_lse, local_lse)
        shards = (
            gathered_values.view(tp_size, n_rows, kk),
            gathered_ids.view(tp_size, n_rows, kk),
            gathered_lse.view(tp_size, n_rows),
        )
    logprobs, top_ids = ddtree_tree.merge_shard_topk(*shards, k)
    return logprobs.view(bs, n_pos, -1), top_ids.view(bs, n_pos, -1)


def tree_verify_inputs(
    tree: Any,
    root_tokens: "torch.Tensor",
    prefix_lens: "torch.Tensor",
    prefix_lens_cpu: Optional["torch.Tensor"] = None,
):
    """``ddtree_tree.verify_inputs`` for a round: with ``prefix_lens_cpu`` (the same lengths
    on the host, e.g. the batch's ``seq_lens_cpu``) the tree mask is sized without reading
    ``prefix_lens`` back from the GPU, so the host queues the verify while the draft still
    runs instead of waiting for it. Without them the size costs one host synchronisation.
    The size is ``ddtree_tree.full_mask_numel``'s ``sum(N * (prefix + N))``, written as
    ``N * sum(prefix) + b * N * N``: one host reduction instead of four tensor ops."""
    from sglang.srt.speculative import ddtree_tree

    mask_numel = None
    if prefix_lens_cpu is not None:
        n, b = int(tree.num_slots), int(prefix_lens_cpu.shape[0])
        mask_numel = n * int(prefix_lens_cpu.sum()) + b * n * n
    return ddtree_tree.verify_inputs(tree, root_tokens, prefix_lens, mask_numel=mask_numel)
