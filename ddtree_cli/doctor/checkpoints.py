"""Whether SGLang can serve a target + DFlash draft checkpoint pair, judged from the facts
collector's ``checkpoints`` section (their config.json files, on the host that serves them).

Used by ``ddtree doctor`` and by ``ddtree deploy``'s preflight.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ddtree_cli.doctor.verdict import Verdict, failed, passed, skipped

if TYPE_CHECKING:
    from ddtree_cli.deploy.config import LaunchConfig


def checkpoint_roles(target: str | None, draft: str | None) -> dict[str, str]:
    """``{role: path}`` of the target and draft checkpoint folders that are given."""
    return {role: path for role, path in (("target", target), ("draft", draft)) if path}


def launch_checkpoints(launch: LaunchConfig) -> dict[str, str]:
    """``{role: path}`` of the checkpoints an SGLang launch will load (none for other kinds)."""
    if launch.kind != "sglang":
        return {}
    return checkpoint_roles(launch.model_path, launch.draft_model_path)


def check_draft_layers(facts: dict) -> Verdict:
    """A DFlash draft must read target layers SGLang can capture.

    SGLang 0.5.x captures target layer k's output as the input of layer k + 1
    (``set_dflash_layers_to_capture`` in models/qwen3.py, qwen2.py, llama.py), so the last
    layer's output is never captured: such a draft loads, the graphs capture, and the first
    request fails with "DFLASH target_hidden feature dim mismatch" (seen on an H200).
    """
    name = "speculative.draft_layers"
    ckpts = facts.get("checkpoints") or {}
    draft = ckpts.get("draft")
    if not draft:
        return skipped(name, "no draft checkpoint (--draft-model-path or the unit's ExecStart)")
    if draft.get("error"):
        return skipped(name, f"draft {draft.get('path')}: {draft['error']}")
    dflash = (draft.get("config") or {}).get("dflash_config")
    if not dflash or not dflash.get("target_layer_ids"):
        return skipped(name, "the draft has no dflash_config.target_layer_ids (not a DFlash draft)")
    ids = [int(i) for i in dflash["target_layer_ids"]]
    target_cfg = (ckpts.get("target") or {}).get("config") or {}
    target_layers = target_cfg.get("num_hidden_layers")
    declared = dflash.get("num_target_layers")
    if target_layers is not None and declared is not None and declared != target_layers:
        return failed(
            name,
            f"the draft was made for a {declared}-layer target; the target has {target_layers}",
            "serve the draft with the target it was trained on",
        )
    layers = target_layers if target_layers is not None else declared
    if declared is None:
        own = (draft.get("config") or {}).get("num_hidden_layers")
        if own is not None and max(ids) >= own:
            return failed(
                name,
                f"dflash_config has no num_target_layers, so SGLang bounds target_layer_ids "
                f"{ids} by the draft's own {own} layers and refuses it",
                f'add "num_target_layers": {layers or "N"} to the draft\'s dflash_config',
            )
    if layers is None:
        return skipped(name, "the target's layer count is unknown (no readable target config)")
    bad = [i for i in ids if not 0 <= i < layers - 1]
    if bad:
        last = [i for i in bad if i == layers - 1]
        why = (
            f"layer {last[0]} is the target's last: SGLang never captures its output, and the "
            "first request fails with 'target_hidden feature dim mismatch'"
            if last
            else f"{bad} are outside the target's layers 0..{layers - 1}"
        )
        return failed(
            name,
            f"the draft reads target layers {ids} of {layers}; {why}",
            f"retrain or re-export the draft with target_layer_ids below {layers - 1}",
        )
    return passed(name, f"the draft reads target layers {ids} of {layers}, all capturable")
