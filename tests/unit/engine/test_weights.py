"""Model folders round-trip exactly and refuse damaged or mismatched files with one line."""

from __future__ import annotations

import json

import pytest
import torch

from ddtree_cli.engine.weights import load_pair, random_pair, save_pair
from ddtree_cli.errors import ConfigError
from tests.unit.engine.helpers import TINY_DRAFT, TINY_TARGET, full_forward, tiny_pair


def test_random_init_is_fixed_by_the_seed_and_reported():
    a, b, c = tiny_pair(0), tiny_pair(0), tiny_pair(1)
    assert a.weights_sha256 == b.weights_sha256 != c.weights_sha256
    ident = a.identity()
    assert ident["random_init"] is True
    assert ident["origin"] == "random-init (seed 0)"


def test_save_and_load_round_trip(tmp_path):
    pair = tiny_pair(3)
    save_pair(pair, tmp_path / "m")
    loaded = load_pair(tmp_path / "m")
    assert loaded.weights_sha256 == pair.weights_sha256
    assert loaded.random_init  # a saved random pair is still reported as random
    ids = [1, 2, 3, 4]
    assert torch.equal(full_forward(loaded, ids), full_forward(pair, ids))
    cfg = json.loads((tmp_path / "m/target/config.json").read_text())
    assert cfg["architectures"] == ["Qwen3ForCausalLM"]


def test_tampered_weights_fail_the_hash_check(tmp_path):
    save_pair(tiny_pair(), tmp_path / "m")
    path = tmp_path / "m/draft/model.safetensors"
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(ConfigError, match="sha256"):
        load_pair(tmp_path / "m")


def test_shape_mismatch_names_the_tensor(tmp_path):
    from dataclasses import replace

    save_pair(tiny_pair(), tmp_path / "m")
    bigger = random_pair(replace(TINY_TARGET, intermediate_size=256), TINY_DRAFT)
    save_pair(bigger, tmp_path / "other")
    # Weights of a model with a wider MLP under the original config (hash updated to match).
    (tmp_path / "m/target/model.safetensors").write_bytes(
        (tmp_path / "other/target/model.safetensors").read_bytes()
    )
    manifest = json.loads((tmp_path / "m/ddtree-engine.json").read_text())
    other = json.loads((tmp_path / "other/ddtree-engine.json").read_text())
    manifest["sha256"]["target"] = other["sha256"]["target"]
    (tmp_path / "m/ddtree-engine.json").write_text(json.dumps(manifest))
    with pytest.raises(ConfigError, match=r"mlp\.\w+_proj\.weight has shape"):
        load_pair(tmp_path / "m")


def test_missing_and_broken_files(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_pair(tmp_path / "nope")
    save_pair(tiny_pair(), tmp_path / "m")
    (tmp_path / "m/draft/config.json").write_text('{\n  "hidden_size": ,\n}')
    with pytest.raises(ConfigError, match=r"config.json:2: invalid JSON"):
        load_pair(tmp_path / "m")
    (tmp_path / "m/draft/config.json").write_text(json.dumps({"hidden_size": 64}))
    with pytest.raises(ConfigError, match="missing config fields"):
        load_pair(tmp_path / "m")


def test_mismatched_pair_is_refused(tmp_path):
    from dataclasses import replace

    with pytest.raises(ConfigError, match="target_layer_ids"):
        random_pair(TINY_TARGET, replace(TINY_DRAFT, target_layer_ids=(0, 7)))
