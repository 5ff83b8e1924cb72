"""Model folders: load and save the target/drafter pair with shape and hash checks, or build
the fixed-seed random pair (reported as such wherever the model's identity shows).

Layout of a model folder::

    target/config.json        Qwen3ForCausalLM config
    target/model.safetensors  HF names (model.layers.N.self_attn.q_proj.weight, ...)
    draft/config.json         DFlashDraftModel config with dflash_config
    draft/model.safetensors   SGLang names (fc.weight, hidden_norm.weight, layers.N...., norm.weight)
    ddtree-engine.json        {"format": 1, "origin": ..., "sha256": {"target": ..., "draft": ...}}
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from ddtree_cli.engine.drafter import DFlashDrafter
from ddtree_cli.engine.model_config import DraftConfig, TargetConfig, check_pair
from ddtree_cli.engine.target import Qwen3Target
from ddtree_cli.errors import ConfigError

MANIFEST = "ddtree-engine.json"
DEFAULT_SEED = 0
# The trained pair shipped with the package (see docs/training.md); the default model.
EMBEDDED_DIR = Path(__file__).resolve().parent / "embedded"
EMBEDDED_ORIGIN = "embedded trained pair (Python stdlib, byte-level)"
# ``--model random``: the fixed-seed random pair (losslessness tests, no trained weights).
RANDOM_MODEL = "random"


@dataclass
class ModelPair:
    target: Qwen3Target
    drafter: DFlashDrafter
    origin: str  # "random-init (seed N)" or the folder it was loaded from
    weights_sha256: str
    random_init: bool

    def identity(self) -> dict:
        return {
            "origin": self.origin,
            "random_init": self.random_init,
            "weights_sha256": self.weights_sha256,
            "target_architecture": "Qwen3ForCausalLM",
            "draft_architecture": "DFlashDraftModel",
            "target_params": _count(self.target),
            "draft_params": _count(self.drafter),
            "target_config": self.target.config.to_hf(),
            "draft_config": self.drafter.config.to_hf(),
        }


def _count(module: nn.Module) -> int:
    return sum(p.numel() for p in {id(p): p for p in module.parameters()}.values())


def _state(module: nn.Module) -> dict[str, torch.Tensor]:
    state = module.state_dict()
    if isinstance(module, Qwen3Target) and module.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    return state


def _digest(states: list[dict[str, torch.Tensor]]) -> str:
    h = hashlib.sha256()
    for state in states:
        for name in sorted(state):
            t = state[name].detach().to("cpu", torch.float32).contiguous()
            h.update(name.encode())
            h.update(str(tuple(t.shape)).encode())
            h.update(t.numpy().tobytes())
    return h.hexdigest()


def random_pair(
    target_cfg: TargetConfig | None = None,
    draft_cfg: DraftConfig | None = None,
    seed: int = DEFAULT_SEED,
) -> ModelPair:
    target_cfg = target_cfg or TargetConfig()
    draft_cfg = draft_cfg or DraftConfig()
    check_pair(target_cfg, draft_cfg)
    gen = torch.Generator().manual_seed(seed)
    target = Qwen3Target(target_cfg)
    drafter = DFlashDrafter(draft_cfg, target_cfg.max_position_embeddings)
    for module in (target, drafter):
        _init(module, gen)
    digest = _digest([_state(target), _state(drafter)])
    return ModelPair(target, drafter, f"random-init (seed {seed})", digest, True)


@torch.no_grad()
def _init(module: nn.Module, gen: torch.Generator) -> None:
    for name, p in module.named_parameters():
        if name.endswith("norm.weight"):
            p.fill_(1.0)
        elif "embed_tokens" in name:
            # Tied to the LM head: a wider spread gives peaked, tie-free next-token logits.
            p.normal_(0.0, 0.1, generator=gen)
        else:
            p.normal_(0.0, 1.0 / math.sqrt(p.shape[-1]), generator=gen)


def save_pair(pair: ModelPair, folder: Path) -> None:
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    hashes = {}
    for part, module in (("target", pair.target), ("draft", pair.drafter)):
        (folder / part).mkdir(exist_ok=True)
        (folder / part / "config.json").write_text(json.dumps(module.config.to_hf(), indent=2))
        state = {k: v.detach().to("cpu").contiguous() for k, v in _state(module).items()}
        path = folder / part / "model.safetensors"
        save_file(state, str(path))
        hashes[part] = _file_sha256(path)
    manifest = {
        "format": 1,
        "origin": pair.origin,
        "random_init": pair.random_init,
        "sha256": hashes,
    }
    (folder / MANIFEST).write_text(json.dumps(manifest, indent=2))


def _file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _read_json(path: Path) -> dict:
    if not path.is_file():
        raise ConfigError(
            f"{path}: missing", hint=f"a model folder holds target/, draft/ and {MANIFEST}"
        )
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path}:{exc.lineno}: invalid JSON ({exc.msg})") from None


def load_pair(folder: Path) -> ModelPair:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    folder = Path(folder)
    if not folder.is_dir():
        raise ConfigError(f"model folder {folder} does not exist")
    manifest = _read_json(folder / MANIFEST)
    target_cfg = TargetConfig.from_hf(
        _read_json(folder / "target/config.json"), str(folder / "target/config.json")
    )
    draft_cfg = DraftConfig.from_hf(
        _read_json(folder / "draft/config.json"), str(folder / "draft/config.json")
    )
    check_pair(target_cfg, draft_cfg)
    target = Qwen3Target(target_cfg)
    drafter = DFlashDrafter(draft_cfg, target_cfg.max_position_embeddings)
    expected_hashes = manifest.get("sha256", {})
    for part, module in (("target", target), ("draft", drafter)):
        path = folder / part / "model.safetensors"
        if not path.is_file():
            raise ConfigError(f"{path}: missing")
        actual = _file_sha256(path)
        if expected_hashes.get(part) != actual:
            raise ConfigError(
                f"{path}: sha256 {actual[:12]}… does not match {MANIFEST} "
                f"({str(expected_hashes.get(part))[:12]}…)",
                hint="the file was changed or truncated; re-export the model folder",
            )
        try:
            state = load_file(str(path))
        except (SafetensorError, OSError) as exc:
            raise ConfigError(f"{path}: cannot read safetensors ({exc})") from None
        _check_shapes(module, state, path)
        module.load_state_dict(state, strict=False)
    digest = _digest([_state(target), _state(drafter)])
    random_init = bool(manifest.get("random_init", False))
    origin = str(manifest.get("origin", folder)) if random_init else str(folder)
    return ModelPair(target, drafter, origin, digest, random_init)


def _check_shapes(module: nn.Module, state: dict[str, torch.Tensor], path: Path) -> None:
    expected = {k: tuple(v.shape) for k, v in _state(module).items()}
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        raise ConfigError(
            f"{path}: tensors do not match the config "
            f"(missing {missing[:3]}{'…' if len(missing) > 3 else ''}, "
            f"unexpected {unexpected[:3]}{'…' if len(unexpected) > 3 else ''})"
        )
    for name, shape in expected.items():
        if tuple(state[name].shape) != shape:
            raise ConfigError(
                f"{path}: {name} has shape {tuple(state[name].shape)}, the config needs {shape}"
            )


def is_random_model(model: str | Path | None) -> bool:
    return model is not None and str(model) == RANDOM_MODEL


def load_embedded_pair() -> ModelPair:
    """The shipped trained pair, hash-checked like any model folder."""
    pair = load_pair(EMBEDDED_DIR)
    pair.origin = EMBEDDED_ORIGIN
    return pair


def pair_for(model: str | Path | None, seed: int = DEFAULT_SEED) -> ModelPair:
    """``None``: the embedded trained pair; ``"random"``: the seeded random pair; else a folder."""
    if model is None:
        return load_embedded_pair()
    if is_random_model(model):
        return random_pair(seed=seed)
    return load_pair(Path(model))


def model_label(model: str | Path | None) -> str:
    if model is None:
        return "ddtree-embedded-trained"
    if is_random_model(model):
        return "ddtree-embedded-random"
    return Path(model).name
