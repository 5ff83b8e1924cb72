"""The exported checkpoints load in the real libraries SGLang 0.5.13 uses (CPU venv).

Target: transformers' ``Qwen3ForCausalLM`` (the venv pins 0.5.13's transformers) must give
the engine's float32 logits. Draft: SGLang 0.5.13's own ``DFlashDraftModel`` is built from
the exported config and loads every parameter from the exported tensors, with none ignored.
The same for the scaled pair (``--scale``, at a reduced scale: hidden 512, 8 layers, the full
vocabulary; its target sharded with an index, as the Qwen3-8B-shaped one is).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from safetensors.torch import save_file

from ddtree_cli.engine.drafter import DFlashDrafter
from ddtree_cli.engine.export import export_pair, export_scaled, random_export_pair
from ddtree_cli.engine.scaled import reduced_scale, scale_pair
from ddtree_cli.engine.target import Qwen3Target
from ddtree_cli.engine.weights import ModelPair, load_embedded_pair
from tests.patch.sglang_venv import venv_python
from tests.unit.engine.helpers import full_forward

pytestmark = [pytest.mark.sglang_import, pytest.mark.slow]
PROBE = Path(__file__).with_name("probe_export.py")
IDS = [5, 17, 200, 33, 33, 91, 4, 250, 128, 7, 64, 1, 99, 180, 2, 42, 259, 0, 11]


def _probe(pristine_root, work, pair, export, small: ModelPair | None = None) -> dict:
    python = venv_python("0.5.13")
    result = export(work / "ckpt")
    save_file({"logits": full_forward(pair, IDS).contiguous()}, str(work / "logits.safetensors"))
    extra = []
    if small is not None:
        save_file(
            {"logits": full_forward(small, IDS).contiguous()}, str(work / "small.safetensors")
        )
        extra = [str(work / "small.safetensors")]
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("PYTHON")},
        "SGLANG_USE_CPU_ENGINE": "1",  # SGLang's own CPU layer paths (no vllm/sgl_kernel ops)
        "CUDA_VISIBLE_DEVICES": "",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
    }
    proc = subprocess.run(
        # -B: the pristine snapshot is shared with other tests and must stay byte-identical.
        [str(python), "-B", str(PROBE), str(pristine_root("0.5.13")), str(result.folder),
         json.dumps(IDS), str(work / "logits.safetensors"), *extra],
        capture_output=True, text=True, env=env, timeout=600, cwd=work,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def probed(pristine_root, tmp_path_factory):
    pair = random_export_pair(block_size=16, seed=3)
    work = tmp_path_factory.mktemp("export")
    facts = _probe(pristine_root, work, pair, lambda out: export_pair(pair, out, dtype="float32"))
    return pair, facts


@pytest.fixture(scope="module")
def probed_scaled(pristine_root, tmp_path_factory):
    """The trained pair scaled; the reference logits are the engine's on the scaled tensors
    (tests/unit/engine/test_scaled.py checks those against the small pair's)."""
    small = load_embedded_pair()
    scaled = scale_pair(small, reduced_scale())
    target = Qwen3Target(scaled.target_config)
    target.load_state_dict(dict(scaled.target_tensors()))
    drafter = DFlashDrafter(scaled.draft_config, scaled.target_config.max_position_embeddings)
    big = ModelPair(target.eval(), drafter, "scaled", "-", False)
    work = tmp_path_factory.mktemp("export-scaled")

    def export(out):
        return export_scaled(small, reduced_scale(), out, dtype="float32", shard_bytes=256 << 20)

    return big, _probe(pristine_root, work, big, export, small)


def test_target_loads_in_transformers_with_the_engines_logits(probed):
    pair, facts = probed
    target = facts["target"]
    assert target["shape"] == [len(IDS), pair.target.config.vocab_size]
    assert target["tied"]
    assert target["argmax_equal"]
    assert target["max_abs_diff"] < 1e-4, target


def test_draft_tensors_are_exactly_what_dflash_draft_model_declares(probed):
    pair, facts = probed
    draft = facts["draft"]
    assert draft["ignored_by_loader"] == []
    assert draft["never_loaded"] == []
    assert draft["mismatched"] == []
    cfg = pair.drafter.config
    assert draft["block_size"] == cfg.block_size
    assert draft["num_context_features"] == len(cfg.target_layer_ids)
    assert draft["parsed"] == {
        "target_layer_ids": list(cfg.target_layer_ids),
        "mask_token_id": cfg.mask_token_id,
        "num_target_layers": pair.target.config.num_hidden_layers,
    }
    h = cfg.hidden_size
    assert draft["params"]["fc.weight"] == [h, len(cfg.target_layer_ids) * h]
    assert "layers.0.self_attn.qkv_proj.weight" in draft["params"]


def test_scaled_target_loads_sharded_in_transformers_with_the_small_targets_logits(probed_scaled):
    _, facts = probed_scaled
    target = facts["target"]
    assert target["shape"] == [len(IDS), 151936]
    assert not target["tied"]
    assert target["argmax_equal"]
    assert target["max_abs_diff_real_vs_small"] < 1e-4, target
    # Extra entries sit hundreds of nats down, where float32 steps are ~1e-4 apart.
    assert target["max_abs_diff"] < 1e-3, target


def test_scaled_draft_loads_in_dflash_draft_model(probed_scaled):
    _, facts = probed_scaled
    draft = facts["draft"]
    assert draft["ignored_by_loader"] == draft["never_loaded"] == draft["mismatched"] == []
    assert draft["num_context_features"] == 4
    assert draft["parsed"]["target_layer_ids"] == [1, 3, 5, 6]
    assert draft["parsed"]["num_target_layers"] == 8
    assert draft["params"]["fc.weight"] == [512, 4 * 512]
