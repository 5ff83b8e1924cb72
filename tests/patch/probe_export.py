"""Runs inside the SGLang CPU venv: load an exported checkpoint pair with the real loaders.

argv: SGLANG_ROOT EXPORT_DIR INPUT_IDS_JSON LOGITS_SAFETENSORS [SMALL_LOGITS_SAFETENSORS]
Prints one JSON line:
- target: transformers' ``Qwen3ForCausalLM.from_pretrained`` on EXPORT_DIR/target in float32,
  its logits on the input ids against the engine's (max |diff|, argmax agreement) and, for a
  scaled pair, at the small vocabulary's entries against the small target's;
- draft: SGLang's own ``DFlashDraftModel`` built from EXPORT_DIR/draft/config.json, every
  parameter set to NaN, then ``load_weights`` over the exported tensors: which parameters
  stayed NaN (never loaded), which exported names the loader ignored, and whether each
  loaded value equals the exported tensor(s) it came from.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import torch

sglang_root, export_dir, ids_json, logits_path = sys.argv[1:5]
small_logits_path = sys.argv[5] if len(sys.argv) > 5 else None
sys.path.insert(0, sglang_root)
export = Path(export_dir)
facts: dict = {}

# --- target through transformers -----------------------------------------------------
from safetensors.torch import load_file  # noqa: E402
from transformers import Qwen3ForCausalLM  # noqa: E402

model = Qwen3ForCausalLM.from_pretrained(str(export / "target"), dtype=torch.float32)
model.eval()
ids = torch.tensor([json.loads(ids_json)])
with torch.no_grad():
    hf_logits = model(input_ids=ids).logits[0].float()
ours = load_file(logits_path)["logits"].float()
facts["target"] = {
    "shape": list(hf_logits.shape),
    "max_abs_diff": float((hf_logits - ours).abs().max()),
    "argmax_equal": bool(torch.equal(hf_logits.argmax(-1), ours.argmax(-1))),
    "tied": bool(model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()),
}
if small_logits_path:
    small = load_file(small_logits_path)["logits"].float()
    diff = hf_logits[:, : small.shape[-1]] - small
    facts["target"]["max_abs_diff_real_vs_small"] = float(diff.abs().max())

# --- draft through SGLang's DFlashDraftModel ------------------------------------------
import sglang.srt.server_args as server_args  # noqa: E402
from sglang.srt.distributed import (  # noqa: E402
    init_distributed_environment,
    initialize_model_parallel,
)

# Layers read a few global server args at construction (rotary cache placement).
server_args.set_global_server_args_for_scheduler(SimpleNamespace(rl_on_policy_target=None))
init_distributed_environment(
    backend="gloo", world_size=1, rank=0, local_rank=0,
    distributed_init_method=f"file://{export.parent / 'dist-init'}",
)  # fmt: skip
initialize_model_parallel(1)

from sglang.srt.models.dflash import DFlashDraftModel  # noqa: E402
from sglang.srt.speculative.dflash_utils import parse_dflash_draft_config  # noqa: E402
from transformers import AutoConfig  # noqa: E402

config = AutoConfig.from_pretrained(str(export / "draft"))
parsed = parse_dflash_draft_config(draft_hf_config=config)
draft = DFlashDraftModel(config).to(torch.float32)
with torch.no_grad():
    for p in draft.parameters():
        p.fill_(float("nan"))
tensors = load_file(str(export / "draft" / "model.safetensors"))
params = dict(draft.named_parameters())
stacked = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj",
           "gate_proj": "gate_up_proj", "up_proj": "gate_up_proj"}  # fmt: skip
ignored = []
for name in tensors:
    target_name = name
    for src, dst in stacked.items():
        if f".{src}." in name:
            target_name = name.replace(src, dst)
    if target_name not in params:
        ignored.append(name)
draft.load_weights(iter(tensors.items()))
never_loaded = sorted(n for n, p in params.items() if torch.isnan(p).any())

# Every loaded value must equal its source: fused parameters are the concatenation.
mismatched = []
for name, p in params.items():
    if ".qkv_proj." in name:
        parts = [tensors[name.replace("qkv_proj", s)] for s in ("q_proj", "k_proj", "v_proj")]
        expected = torch.cat(parts, 0)
    elif ".gate_up_proj." in name:
        parts = [tensors[name.replace("gate_up_proj", s)] for s in ("gate_proj", "up_proj")]
        expected = torch.cat(parts, 0)
    else:
        expected = tensors.get(name)
    if expected is None or not torch.equal(p.detach(), expected.float()):
        mismatched.append(name)
facts["draft"] = {
    "params": {n: list(p.shape) for n, p in params.items()},
    "exported": {n: list(t.shape) for n, t in tensors.items()},
    "ignored_by_loader": sorted(ignored),
    "never_loaded": never_loaded,
    "mismatched": sorted(mismatched),
    "block_size": draft.block_size,
    "num_context_features": draft.num_context_features,
    "parsed": {
        "target_layer_ids": parsed.resolve_target_layer_ids(
            target_num_layers=int(parsed.num_target_layers or 0) or 1
        ),
        "mask_token_id": parsed.mask_token_id,
        "num_target_layers": parsed.num_target_layers,
    },
}
print(json.dumps(facts))
