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

With ``--scale qwen3-8b`` the pair is first embedded in Qwen3-8B's shape and the published
Qwen3-8B DFlash drafter's, with the same function (``scaled.py``, docs/scaled-pair.md); the
tensors are built on the GPU when there is one and the target is written in 4 GB shards with
``model.safetensors.index.json``, as a real Qwen3-8B is.

Command line::

    python -m ddtree_cli.engine.export --random --out DIR [--block-size 16] [--dtype bfloat16]
    python -m ddtree_cli.engine.export --model ENGINE_FOLDER --out DIR
    python -m ddtree_cli.engine.export --scale qwen3-8b DIR [--model ENGINE_FOLDER] [--device cuda]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import sys
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from ddtree_cli.engine.model_config import DraftConfig, TargetConfig
from ddtree_cli.engine.scaled import CONSTRUCTIONS, SCALES, Scale, scale_pair
from ddtree_cli.engine.weights import (
    DEFAULT_SEED,
    ModelPair,
    _file_sha256,
    _state,
    load_embedded_pair,
    load_pair,
    random_pair,
)
from ddtree_cli.errors import ConfigError, DdtreeError

MANIFEST = "export.json"
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
# Shards of the scaled pair's checkpoints (a real Qwen3-8B ships five of about 4 GB).
SHARD_BYTES = 4 << 30


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
    check_sglang_capturable(pair.target.config, pair.drafter.config)
    parts = [
        ("target", target_config(pair.target.config, dtype), _state(pair.target).items()),
        ("draft", draft_config(pair.drafter.config, pair.target.config, dtype),
         _state(pair.drafter).items()),
    ]  # fmt: skip
    return write_export(out, parts, _manifest(pair), dtype, pair.drafter.config.block_size)


def export_scaled(
    pair: ModelPair,
    scale: Scale,
    out: Path,
    dtype: str = "bfloat16",
    device: str | torch.device = "cpu",
    seed: int = DEFAULT_SEED,
    shard_bytes: int = SHARD_BYTES,
    construction: str = "dense",
) -> ExportResult:
    """Write the scaled pair of ``pair`` (see ``scaled.py``) under ``out``, as export_pair does;
    tensors are built on ``device`` one at a time and written in shards of ``shard_bytes``."""
    _check_out(out, dtype)
    scaled = scale_pair(pair, scale, device=device, seed=seed, construction=construction)
    check_sglang_capturable(scaled.target_config, scaled.draft_config)
    target_cfg = {**target_config(scaled.target_config, dtype), **dict(scale.target_hf_extra)}
    parts = [
        ("target", target_cfg, scaled.target_tensors()),
        ("draft", draft_config(scaled.draft_config, scaled.target_config, dtype),
         scaled.draft_tensors()),
    ]  # fmt: skip
    manifest = {**_manifest(pair), "scaled": scaled.facts()}
    return write_export(out, parts, manifest, dtype, pair.drafter.config.block_size, shard_bytes)


def _manifest(pair: ModelPair) -> dict:
    return {
        "format": 1,
        "origin": pair.origin,
        "random_init": pair.random_init,
        "weights_sha256": pair.weights_sha256,
    }


def _check_out(out: Path, dtype: str) -> None:
    if dtype not in DTYPES:
        raise ConfigError(f"unknown dtype {dtype!r}", hint=f"one of {', '.join(DTYPES)}")
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise ConfigError(f"{out} exists and is not empty", hint="choose a new folder")


Part = tuple[str, dict, Iterable[tuple[str, torch.Tensor]]]


def write_export(
    out: Path,
    parts: list[Part],
    manifest: dict,
    dtype: str,
    block_size: int,
    shard_bytes: int | None = None,
) -> ExportResult:
    """Write each part's config.json and tensors (one ``model.safetensors``, or shards with
    ``model.safetensors.index.json`` past ``shard_bytes``) and the manifest, through a
    staging folder renamed into place at the end."""
    _check_out(out, dtype)
    out = Path(out)
    staging = out.with_name(f".{out.name}.partial")
    shutil.rmtree(staging, ignore_errors=True)
    hashes: dict[str, str] = {}
    try:
        for part, config, tensors in parts:
            folder = staging / part
            folder.mkdir(parents=True)
            (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
            names = ["config.json", *save_tensors(tensors, folder, DTYPES[dtype], shard_bytes)]
            # hashlib releases the GIL on large reads: shards hash in parallel.
            with ThreadPoolExecutor(max_workers=8) as pool:
                digests = pool.map(_file_sha256, [folder / name for name in names])
                hashes.update({f"{part}/{n}": h for n, h in zip(names, digests, strict=True)})
        data = {**manifest, "dtype": dtype, "block_size": block_size, "sha256": hashes}
        (staging / MANIFEST).write_text(json.dumps(data, indent=2) + "\n")
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
        block_size=block_size,
        origin=str(manifest["origin"]),
        random_init=bool(manifest["random_init"]),
        sha256=hashes,
    )


def save_tensors(
    tensors: Iterable[tuple[str, torch.Tensor]],
    folder: Path,
    dtype: torch.dtype,
    shard_bytes: int | None = None,
) -> list[str]:
    """Cast (on the tensors' device), move to the host and save, one shard in memory at a
    time; returns the file names written."""
    from safetensors.torch import save_file

    shard: dict[str, torch.Tensor] = {}
    sizes: list[dict[str, int]] = []  # per shard written: tensor name -> bytes

    def flush() -> None:
        save_file(shard, str(folder / f"part-{len(sizes):05d}.safetensors"),
                  metadata={"format": "pt"})  # fmt: skip
        sizes.append({n: t.numel() * t.element_size() for n, t in shard.items()})
        shard.clear()

    held = 0
    for name, tensor in tensors:
        t = tensor.detach().to(dtype).to("cpu").contiguous()
        nbytes = t.numel() * t.element_size()
        if shard_bytes is not None and shard and held + nbytes > shard_bytes:
            flush()
            held = 0
        shard[name] = t
        held += nbytes
    flush()
    if len(sizes) == 1:
        (folder / "part-00000.safetensors").rename(folder / "model.safetensors")
        return ["model.safetensors"]
    final = [f"model-{i + 1:05d}-of-{len(sizes):05d}.safetensors" for i in range(len(sizes))]
    weight_map: dict[str, str] = {}
    for i, (new, names) in enumerate(zip(final, sizes, strict=True)):
        (folder / f"part-{i:05d}.safetensors").rename(folder / new)
        weight_map.update(dict.fromkeys(names, new))
    total = sum(sum(names.values()) for names in sizes)
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return [*final, "model.safetensors.index.json"]


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
    src = p.add_mutually_exclusive_group()
    src.add_argument("--model", type=Path, help="an engine model folder (target/, draft/)")
    src.add_argument("--random", action="store_true", help="the fixed-seed random pair")
    p.add_argument("--scale", choices=sorted(SCALES),
                   help="embed the pair (default: the shipped trained pair) in this model's "
                   "shape, same function (docs/scaled-pair.md)")  # fmt: skip
    p.add_argument("--construction", choices=CONSTRUCTIONS, default="dense",
                   help="with --scale: dense (default) or the first, sparse construction")  # fmt: skip
    p.add_argument("out_dir", nargs="?", type=Path, metavar="OUT", help="same as --out")
    p.add_argument("--out", type=Path)
    p.add_argument("--block-size", type=int, default=16, help="with --random only")
    p.add_argument("--seed", type=int, default=DEFAULT_SEED,
                   help="the random pair's seed; with --scale also the fill of unused weights")  # fmt: skip
    p.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    p.add_argument("--device", help="where --scale builds tensors (default: cuda if available)")
    args = p.parse_args(argv)
    out = args.out or args.out_dir
    if out is None or (args.out and args.out_dir):
        p.error("give the output folder once, as OUT or --out")
    if not (args.model or args.random or args.scale):
        p.error("one of --model, --random or --scale is required")
    try:
        _check_out(out, args.dtype)
        if args.model:
            pair = load_pair(args.model)
        elif args.random:
            pair = random_export_pair(args.block_size, args.seed)
        else:
            pair = load_embedded_pair()
        if args.scale:
            device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
            result = export_scaled(pair, SCALES[args.scale], out, args.dtype, device, args.seed,
                                   construction=args.construction)  # fmt: skip
        else:
            result = export_pair(pair, out, args.dtype)
    except DdtreeError as exc:
        print(f"Error: {exc.message}", file=sys.stderr)
        return int(exc.exit_code)
    print(json.dumps({**dataclasses.asdict(result), "folder": str(result.folder),
                      "target": str(result.target), "draft": str(result.draft)}))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
