"""Model configurations, and their HF-style ``config.json`` (Qwen3 target, DFlash drafter).

The JSON written here is what SGLang reads: the target as ``Qwen3ForCausalLM``, the drafter
as ``DFlashDraftModel`` with a ``dflash_config`` block, so a folder saved by this engine
exports 1:1.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any

from ddtree_cli.errors import ConfigError


@dataclass(frozen=True)
class TargetConfig:
    vocab_size: int = 260
    hidden_size: int = 256
    intermediate_size: int = 768
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 64
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = True

    def to_hf(self) -> dict[str, Any]:
        return {
            "architectures": ["Qwen3ForCausalLM"],
            "model_type": "qwen3",
            "attention_bias": False,
            "hidden_act": "silu",
            "torch_dtype": "float32",
            **asdict(self),
        }

    @classmethod
    def from_hf(cls, data: dict[str, Any], source: str) -> TargetConfig:
        if data.get("model_type") not in (None, "qwen3"):
            raise ConfigError(f"{source}: model_type {data.get('model_type')!r} is not qwen3")
        return _from_dict(cls, data, source)


@dataclass(frozen=True)
class DraftConfig:
    hidden_size: int = 256
    intermediate_size: int = 768
    num_hidden_layers: int = 1
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 64
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    vocab_size: int = 260
    block_size: int = 16
    mask_token_id: int = 257
    target_layer_ids: tuple[int, ...] = field(default=(1, 3))

    def to_hf(self) -> dict[str, Any]:
        data = asdict(self)
        dflash = {
            "block_size": data.pop("block_size"),
            "mask_token_id": data.pop("mask_token_id"),
            "target_layer_ids": list(data.pop("target_layer_ids")),
        }
        return {
            "architectures": ["DFlashDraftModel"],
            "model_type": "qwen3",
            "attention_bias": False,
            "hidden_act": "silu",
            "torch_dtype": "float32",
            "dflash_config": dflash,
            **data,
        }

    @classmethod
    def from_hf(cls, data: dict[str, Any], source: str) -> DraftConfig:
        flat = {k: v for k, v in data.items() if k != "dflash_config"}
        flat.update(data.get("dflash_config") or {})
        if "target_layer_ids" in flat:
            flat["target_layer_ids"] = tuple(int(i) for i in flat["target_layer_ids"])
        return _from_dict(cls, flat, source)


def _from_dict(cls: type, data: dict[str, Any], source: str):
    known = {f.name for f in fields(cls)}
    missing = [
        f.name for f in fields(cls) if f.name not in data and f.name != "tie_word_embeddings"
    ]
    if missing:
        raise ConfigError(f"{source}: missing config fields {', '.join(missing)}")
    try:
        return cls(**{k: v for k, v in data.items() if k in known})
    except TypeError as exc:
        raise ConfigError(f"{source}: {exc}") from None


def check_pair(target: TargetConfig, draft: DraftConfig) -> None:
    """The drafter reads the target's hidden features and uses its embedding and LM head."""
    if draft.hidden_size != target.hidden_size:
        raise ConfigError(
            f"drafter hidden_size {draft.hidden_size} != target hidden_size {target.hidden_size}"
        )
    if draft.vocab_size != target.vocab_size:
        raise ConfigError(f"drafter vocab {draft.vocab_size} != target vocab {target.vocab_size}")
    bad = [i for i in draft.target_layer_ids if not 0 <= i < target.num_hidden_layers]
    if bad:
        raise ConfigError(
            f"drafter target_layer_ids {bad} outside the target's {target.num_hidden_layers} layers"
        )
    if not 0 <= draft.mask_token_id < target.vocab_size:
        raise ConfigError(f"mask_token_id {draft.mask_token_id} outside the vocabulary")
    if draft.block_size < 2:
        raise ConfigError(f"block_size {draft.block_size} must be at least 2")


# A target of ~110M parameters for the GPU benchmark (the per-round overhead of the tree
# only matters next to a verify pass that costs something).
BENCH_TARGET = TargetConfig(
    hidden_size=1024,
    intermediate_size=3072,
    num_hidden_layers=8,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=64,
)
BENCH_DRAFT = DraftConfig(
    hidden_size=1024,
    intermediate_size=3072,
    num_hidden_layers=1,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=64,
    target_layer_ids=(1, 4, 7),
)
