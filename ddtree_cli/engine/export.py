"""Export the embedded engine's model pair as SGLang checkpoints.

Writes two folders SGLang's loaders read directly::

    OUT/target/config.json, model.safetensors   Qwen3ForCausalLM (HF names; LM head tied)
    OUT/draft/config.json,  model.safetensors   DFlashDraftModel (fc, hidden_norm, layers, norm)
    OUT/export.json                             origin, dtype, block size, sha256 of each file

The draft config gains what SGLang's DFlash config parser needs beyond the engine's own
folder: ``dflash_config.num_target_layers`` (without it SGLang bounds ``target_layer_ids``
by the draft's own layer count and refuses the checkpoint) and ``max_position_embeddings``.
``dflash_config.mask_token_id`` is kept, so a server started with ``--skip-tokenizer-init``
needs no tokenizer to find the mask token.

Command line::

    python -m ddtree_cli.engine.export --random --out DIR [--block-size 16] [--dtype bfloat16]
    python -m ddtree_cli.engine.export --model ENGINE_FOLDER --out DIR
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from ddtree_cli.engine.model_config import DraftConfig, TargetConfig
from ddtree_cli.engine.weights import (
    DEFAULT_SEED,
    ModelPair,
    _file_sha256,
    _state,
    load_pair,
    random_pair,
)
from ddtree_cli.errors import ConfigError, DdtreeError

MANIFEST = "export.json"
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@dataclass(frozen=True)
class ExportResult:
    folder: Path
    target: Path
    draft: Path
    dtype: str
    block_size: int
    origin: str
    random_init: bool
    sha256: dict[str, str]


def target_config(cfg: TargetConfig, dtype: str) -> dict:
    return {**cfg.to_hf(), "torch_dtype": dtype}


def draft_config(draft: DraftConfig, target: TargetConfig, dtype: str) -> dict:
    data = draft.to_hf()
    data["torch_dtype"] = dtype
    data["max_position_embeddings"] = target.max_position_embeddings
    data["num_target_layers"] = target.num_hidden_layers
    data["dflash_config"]["num_target_layers"] = target.num_hidden_layers
    return data


def check_sglang_capturable(target: TargetConfig, draft: DraftConfig) -> None:
    """SGLang captures a DFlash feature "before layer k + 1" inside the decoder loop
    (``Qwen2Model.forward``, ``layers_to_capture``), so the last layer's output is never
    captured: the server then feeds the drafter too few features and its first request fails
    with "DFLASH target_hidden feature dim mismatch" (seen on an H200 with 0.5.13)."""
    last = target.num_hidden_layers - 1
    if last in draft.target_layer_ids:
        raise ConfigError(
            f"drafter target_layer_ids {list(draft.target_layer_ids)} include the target's last "
            f"layer ({last}), whose output SGLang cannot capture",
            hint="use feature layers below the last one (retrain the drafter)",
        )


def export_pair(pair: ModelPair, out: Path, dtype: str = "bfloat16") -> ExportResult:
    """Write ``pair`` under ``out`` (created; must not hold a previous export's files).

    Files are staged in a sibling folder and renamed into place, so a failure leaves no
    half-written checkpoint behind.
    """
    from safetensors.torch import save_file

    check_sglang_capturable(pair.target.config, pair.drafter.config)
    if dtype not in DTYPES:
        raise ConfigError(f"unknown dtype {dtype!r}", hint=f"one of {', '.join(DTYPES)}")
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise ConfigError(f"{out} exists and is not empty", hint="choose a new folder")
    staging = out.with_name(f".{out.name}.partial")
    shutil.rmtree(staging, ignore_errors=True)
    configs = {
        "target": target_config(pair.target.config, dtype),
        "draft": draft_config(pair.drafter.config, pair.target.config, dtype),
    }
    hashes: dict[str, str] = {}
    try:
        for part, module in (("target", pair.target), ("draft", pair.drafter)):
            folder = staging / part
            folder.mkdir(parents=True)
            (folder / "config.json").write_text(json.dumps(configs[part], indent=2) + "\n")
            state = {
                k: v.detach().to("cpu", DTYPES[dtype]).contiguous()
                for k, v in _state(module).items()
            }
            save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
            for name in ("config.json", "model.safetensors"):
                hashes[f"{part}/{name}"] = _file_sha256(folder / name)
        manifest = {
            "format": 1,
            "origin": pair.origin,
            "random_init": pair.random_init,
            "weights_sha256": pair.weights_sha256,
            "dtype": dtype,
            "block_size": pair.drafter.config.block_size,
            "sha256": hashes,
        }
        (staging / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
        if out.exists():
            out.rmdir()
        staging.rename(out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return ExportResult(
        folder=out,
        target=out / "target",
        draft=out / "draft",
        dtype=dtype,
        block_size=pair.drafter.config.block_size,
        origin=pair.origin,
        random_init=pair.random_init,
        sha256=hashes,
    )


def random_export_pair(block_size: int = 16, seed: int = DEFAULT_SEED) -> ModelPair:
    """The engine's fixed-seed random pair with the drafter's block size set to ``block_size``."""
    # (1, 2), not the engine's default (1, 3): SGLang cannot capture the last layer's output.
    draft = dataclasses.replace(DraftConfig(), block_size=block_size, target_layer_ids=(1, 2))
    return random_pair(TargetConfig(), draft, seed=seed)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m ddtree_cli.engine.export",
        description="Export an engine model pair as SGLang Qwen3 + DFlash checkpoints.",
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", type=Path, help="an engine model folder (target/, draft/)")
    src.add_argument("--random", action="store_true", help="the fixed-seed random pair")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--block-size", type=int, default=16, help="with --random only")
    p.add_argument("--seed", type=int, default=DEFAULT_SEED, help="with --random only")
    p.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    args = p.parse_args(argv)
    try:
        pair = (
            load_pair(args.model) if args.model else random_export_pair(args.block_size, args.seed)
        )
        result = export_pair(pair, args.out, args.dtype)
    except DdtreeError as exc:
        print(f"Error: {exc.message}", file=sys.stderr)
        return int(exc.exit_code)
    print(json.dumps({**dataclasses.asdict(result), "folder": str(result.folder),
                      "target": str(result.target), "draft": str(result.draft)}))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
