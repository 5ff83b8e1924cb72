"""What every stage shares: the model sizes, seeds, the device, the learning-rate schedule,
and the model folders (the engine's format: bf16 safetensors, upcast on load)."""

from __future__ import annotations

import copy
import json
import math
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from ddtree_cli.engine.drafter import DFlashDrafter
from ddtree_cli.engine.model_config import DraftConfig, TargetConfig
from ddtree_cli.engine.target import Qwen3Target
from ddtree_cli.engine.tokenizer import MASK_ID, VOCAB_SIZE
from ddtree_cli.engine.weights import MANIFEST, ModelPair, save_pair

SEED = 1234

# Sized so the target's bf16 safetensors stay under 16 MiB and the pair under 25 MB.
SMALL_TARGET = TargetConfig(
    vocab_size=VOCAB_SIZE,
    hidden_size=384,
    intermediate_size=1024,
    num_hidden_layers=5,
    num_attention_heads=6,
    num_key_value_heads=2,
    head_dim=64,
    max_position_embeddings=4096,
)

SMALL_DRAFT = DraftConfig(
    hidden_size=384,
    intermediate_size=1024,
    num_hidden_layers=2,
    num_attention_heads=6,
    num_key_value_heads=2,
    head_dim=64,
    vocab_size=VOCAB_SIZE,
    block_size=16,
    mask_token_id=MASK_ID,
    # Never the target's last layer: SGLang cannot capture its output (the exporter refuses).
    target_layer_ids=(1, 2, 3),
)

# For tests: every stage end to end in seconds on a CPU.
TINY_TARGET = TargetConfig(
    vocab_size=VOCAB_SIZE,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=32,
    max_position_embeddings=1024,
)

TINY_DRAFT = DraftConfig(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=1,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=32,
    vocab_size=VOCAB_SIZE,
    block_size=16,
    mask_token_id=MASK_ID,
    target_layer_ids=(0, 1),
)

CONFIGS = {"small": (SMALL_TARGET, SMALL_DRAFT), "tiny": (TINY_TARGET, TINY_DRAFT)}


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def seed_all(seed: int) -> torch.Generator:
    torch.manual_seed(seed)
    np.random.seed(seed)
    return torch.Generator().manual_seed(seed)


def lr_schedule(frac: float, peak: float, warm: float = 0.03) -> float:
    if frac < warm:
        return peak * frac / warm
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, (frac - warm) / (1 - warm)))))


def device_setup(device: str) -> torch.device:
    dev = torch.device(device)
    if dev.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    return dev


def autocast(dev: torch.device):
    return torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda")


def draft_config_for(cfg: TargetConfig) -> DraftConfig:
    """A drafter config matching ``cfg`` (only to build the target through ``random_pair``)."""
    for t, d in CONFIGS.values():
        if t == cfg:
            return d
    return replace(TINY_DRAFT, hidden_size=cfg.hidden_size, target_layer_ids=(0,))


def save_target(target: Qwen3Target, folder: Path) -> None:
    from safetensors.torch import save_file

    part = folder / "target"
    part.mkdir(parents=True, exist_ok=True)
    (part / "config.json").write_text(json.dumps(target.config.to_hf(), indent=2))
    state = {
        k: v.detach().to("cpu", torch.bfloat16).contiguous() for k, v in target.state_dict().items()
    }
    if target.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file(state, str(part / "model.safetensors"))


def load_target(folder: Path) -> Qwen3Target:
    from safetensors.torch import load_file

    cfg = TargetConfig.from_hf(json.loads((folder / "target/config.json").read_text()), "target")
    target = Qwen3Target(cfg)
    target.load_state_dict(load_file(str(folder / "target/model.safetensors")), strict=False)
    return target


def save_trained_pair(
    target: Qwen3Target, drafter: DFlashDrafter, folder: Path, provenance: dict
) -> None:
    """The engine's model folder, bf16 storage; provenance goes into the manifest."""

    t16 = copy.deepcopy(target).cpu().to(torch.bfloat16)
    d16 = copy.deepcopy(drafter).cpu().to(torch.bfloat16)
    pair = ModelPair(t16, d16, "ddtree-embedded-trained", "", False)
    save_pair(pair, folder)
    manifest = json.loads((folder / MANIFEST).read_text())
    manifest["training"] = provenance
    (folder / MANIFEST).write_text(json.dumps(manifest, indent=2))
