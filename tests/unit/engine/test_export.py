"""The SGLang exporter: file layout, configs SGLang's DFlash parser needs, bit-exact tensors."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from ddtree_cli.engine.export import export_pair, random_export_pair
from ddtree_cli.engine.weights import _file_sha256
from ddtree_cli.errors import ConfigError


def test_exported_tensors_are_the_engines_weights(tmp_path):
    pair = random_export_pair(block_size=9, seed=1)
    result = export_pair(pair, tmp_path / "o", dtype="float32")
    target = load_file(str(result.target / "model.safetensors"))
    draft = load_file(str(result.draft / "model.safetensors"))
    assert "lm_head.weight" not in target  # tied to the embedding
    assert torch.equal(target["model.embed_tokens.weight"], pair.target.model.embed_tokens.weight)
    assert torch.equal(draft["fc.weight"], pair.drafter.fc.weight)
    assert set(draft) == set(pair.drafter.state_dict())


def test_configs_carry_what_sglang_needs(tmp_path):
    pair = random_export_pair(block_size=33)
    result = export_pair(pair, tmp_path / "o")
    target = json.loads((result.target / "config.json").read_text())
    draft = json.loads((result.draft / "config.json").read_text())
    assert target["architectures"] == ["Qwen3ForCausalLM"]
    assert target["torch_dtype"] == "bfloat16"
    assert draft["architectures"] == ["DFlashDraftModel"]
    assert draft["dflash_config"] == {
        "block_size": 33, "mask_token_id": 257, "target_layer_ids": [1, 2],
        "num_target_layers": 4,
    }  # fmt: skip
    tensors = load_file(str(result.target / "model.safetensors"))
    assert {t.dtype for t in tensors.values()} == {torch.bfloat16}
    manifest = json.loads((result.folder / "export.json").read_text())
    assert manifest["random_init"] and manifest["block_size"] == 33
    for rel, digest in manifest["sha256"].items():
        assert _file_sha256(result.folder / rel) == digest


def test_refuses_a_non_empty_folder_and_leaves_it_alone(tmp_path):
    out = tmp_path / "o"
    out.mkdir()
    (out / "keep").write_text("x")
    with pytest.raises(ConfigError, match="not empty"):
        export_pair(random_export_pair(), out)
    assert [p.name for p in out.iterdir()] == ["keep"]
    assert not (tmp_path / ".o.partial").exists()


def test_command_line_round_trip(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "ddtree_cli.engine.export", "--random", "--block-size", "16",
         "--dtype", "float32", "--out", str(tmp_path / "o")],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout)
    assert summary["block_size"] == 16 and summary["random_init"]
    bad = subprocess.run(
        [sys.executable, "-m", "ddtree_cli.engine.export", "--model", str(tmp_path / "nope"),
         "--out", str(tmp_path / "p")],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert bad.returncode != 0
    assert bad.stderr.startswith("Error: ") and len(bad.stderr.strip().splitlines()) == 1


def test_refuses_a_drafter_fed_by_the_targets_last_layer(tmp_path):
    from ddtree_cli.engine.weights import random_pair

    pair = random_pair()  # the engine's default drafter reads layers (1, 3) of 4
    with pytest.raises(ConfigError, match="last layer"):
        export_pair(pair, tmp_path / "o")
    assert not (tmp_path / "o").exists()
