"""The scaled pair keeps the trained pair's function in a bigger shape (float32, CPU).

The big shape is a reduced one (hidden 512, 8 target layers, 3 drafter layers, Qwen3-8B's
head size and full vocabulary), built by the same code as Qwen3-8B's; the models are the
engine's own Qwen3Target and DFlashDrafter.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from ddtree_cli.engine.decoding import Engine, generate
from ddtree_cli.engine.export import export_scaled
from ddtree_cli.engine.scaled import (
    MARGIN,
    QWEN3_8B,
    AttnShape,
    dim_map,
    head_map,
    place_layers,
    reduced_scale,
    residual_layout,
    scale_pair,
)
from ddtree_cli.engine.target import Qwen3Target
from ddtree_cli.engine.tokenizer import ByteTokenizer
from ddtree_cli.engine.weights import ModelPair, _file_sha256, load_embedded_pair
from ddtree_cli.errors import ConfigError
from tests.unit.engine.helpers import full_forward

pytestmark = pytest.mark.slow
SCALE = reduced_scale()
# Python source the way the pair was trained on it (bytes), and a line it never saw.
TEXT = 'def scaled(pair, shape):\n    """Embed the pair."""\n    for name in sorted(shape):\n'


@pytest.fixture(scope="module")
def pairs() -> tuple[ModelPair, ModelPair]:
    small = load_embedded_pair()
    return small, scale_pair(small, SCALE, seed=5).model_pair()


def test_logits_equal_the_small_targets_at_every_real_token(pairs):
    small, big = pairs
    ids = ByteTokenizer().encode(TEXT)
    want = full_forward(small, ids)
    got = full_forward(big, ids)
    real = small.target.config.vocab_size
    assert got.shape == (len(ids), 151936)
    assert (got[:, :real] - want).abs().max() < 1e-4
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    # Extra entries: the reference token's logit less a margin, far below the winner.
    assert (got[:, real:].max(-1).values < want.max(-1).values - MARGIN).all()
    assert torch.allclose(torch.logsumexp(got, -1), torch.logsumexp(want, -1), atol=1e-4)


def test_feature_layers_carry_the_small_features(pairs):
    small, big = pairs
    ids = torch.tensor([ByteTokenizer().encode(TEXT)])
    n = ids.shape[1]
    pos = torch.arange(n).unsqueeze(0)
    mask = (pos.unsqueeze(-1) >= pos.unsqueeze(-2)).unsqueeze(1)
    outs = {}
    with torch.no_grad():
        for name, pair in (("small", small), ("big", big)):
            cache = pair.target.new_cache(1, n, "cpu", torch.float32)
            layers = pair.drafter.config.target_layer_ids
            outs[name] = pair.target(ids, pos, cache, pos, mask, layers)[1]
    d, big_d = small.target.config.hidden_size, big.target.config.hidden_size
    res = residual_layout(d, big_d, 1e-6)
    basis = scale_pair(small, SCALE, seed=5).basis
    for j in range(len(small.drafter.config.target_layer_ids)):
        slot = outs["big"][0, :, j * big_d : (j + 1) * big_d]
        want = outs["small"][0, :, j * d : (j + 1) * d]
        # The slot is s * Q f + a * e_c, up to float32 rounding (1.2e-6 of the largest
        # feature seen) of residuals that reach a few hundred.
        image = basis.embed(want) * res.s
        image[:, basis.constant] = res.a
        assert (slot - image).abs().max() < 1e-5 * res.s * want.abs().max()
        assert (basis.project(slot) / res.s - want).abs().max() < 1e-5 * want.abs().max()
        assert torch.equal(slot[:, d], torch.full((n,), res.a))  # no writer touches it


def test_matmul_operands_hold_almost_no_exact_zeros(pairs):
    """Every Linear's weight and input: at most one channel in 256 exactly zero (the constant
    channel's column or row); the sparse construction's are mostly zeros."""
    _, big = pairs
    seen: dict[str, float] = {}

    def hook(name):
        def record(_module, args):
            seen[name] = max(seen.get(name, 0.0), float((args[0] == 0).float().mean()))

        return record

    modules = [
        *big.target.named_modules(),
        *(("draft." + n, m) for n, m in big.drafter.named_modules()),
    ]
    linears = [(n, m) for n, m in modules if isinstance(m, torch.nn.Linear)]
    handles = [m.register_forward_pre_hook(hook(n)) for n, m in linears]
    try:
        _run(big, "dflash", [ByteTokenizer().encode(TEXT)], max_new=4)
        full_forward(big, ByteTokenizer().encode(TEXT))
    finally:
        for h in handles:
            h.remove()
    assert len(seen) == len(linears)  # every matmul ran
    assert max(seen.values()) <= 1 / 256, sorted(seen.items(), key=lambda kv: -kv[1])[:3]
    # fc's last slot reads nothing (the small drafter reads 3 layers): its rows are orthogonal
    # to Q, exactly zero on a channel that alone carries a small one (257 of 511 at this
    # reduced width, none at Qwen3-8B's: test_qwen3_8b_plan...).
    weights = {n: m.weight for n, m in linears}
    weights["draft.fc"] = weights["draft.fc"][:, : 3 * 512]
    zeros = {n: float((w == 0).float().mean()) for n, w in weights.items()}
    assert max(zeros.values()) <= 1 / 256, sorted(zeros.items(), key=lambda kv: -kv[1])[:3]
    sparse = scale_pair(load_embedded_pair(), SCALE, seed=5, construction="sparse")
    down = dict(sparse.target_tensors())["model.layers.2.mlp.down_proj.weight"]
    assert torch.equal(down, torch.zeros_like(down))  # an identity layer's, before


def test_the_sparse_construction_keeps_the_function_too():
    small = load_embedded_pair()
    scaled = scale_pair(small, SCALE, seed=5, construction="sparse")
    target = Qwen3Target(scaled.target_config)
    target.load_state_dict(dict(scaled.target_tensors()), strict=True)
    ids = ByteTokenizer().encode(TEXT)
    want = full_forward(small, ids)
    got = full_forward(ModelPair(target.eval(), small.drafter, "sparse", "-", False), ids)
    assert (got[:, : small.target.config.vocab_size] - want).abs().max() < 1e-4
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    with pytest.raises(ConfigError, match="construction"):
        scale_pair(small, SCALE, construction="zeros")


def _run(pair: ModelPair, algo: str, prompts: list[list[int]], max_new: int = 24):
    engine = Engine(pair, algo, budget=8 if algo == "ddtree" else None, max_batch=2,
                    context_len=160)  # fmt: skip
    seqs = generate(engine, prompts, max_new)
    return [s.output for s in seqs], [(s.verify_ct, s.accepted_tokens) for s in seqs]


@pytest.mark.parametrize("algo", ["ar", "dflash", "ddtree"])
def test_greedy_outputs_and_acceptance_are_the_small_pairs(pairs, algo):
    small, big = pairs
    tok = ByteTokenizer()
    prompts = [tok.encode(TEXT), tok.encode("import os\nimport sys\n\n\ndef main(argv):\n")]
    want, want_rounds = _run(small, algo, prompts)
    got, got_rounds = _run(big, algo, prompts)
    assert got == want
    assert got_rounds == want_rounds  # the drafter proposes what the small one does
    if algo != "ar":
        rounds, accepted = map(sum, zip(*got_rounds, strict=True))
        assert accepted > 2 * rounds  # the trained drafter is right most of the time


def test_qwen3_8b_plan_places_the_trained_layers_under_the_published_feature_layers():
    scaled = scale_pair(load_embedded_pair(), QWEN3_8B)
    assert scaled.target_config.hidden_size == 4096
    assert scaled.draft_config.target_layer_ids == (1, 9, 17, 25, 33)
    assert scaled.draft_config.mask_token_id == 257 and scaled.draft_config.block_size == 16
    # The trained drafter reads small layers 1, 2, 3 of 5.
    assert scaled.target_places == [0, 1, 9, 17, 18]
    assert scaled.drafter_places == [0, 1]
    res = scaled.residual
    assert (res.s, res.k) == (4.0, 1.5)
    assert res.a == pytest.approx((4096 * 1e-6 * 0.5) ** 0.5)
    # Q: every channel but the constant one belongs to one small channel, 10 or 11 each, and
    # its columns are orthonormal.
    basis = scaled.basis
    assert scaled.facts()["residual"]["big_channels_per_small_channel"] == [10, 11]
    assert (basis.owner < 0).nonzero().flatten().tolist() == [basis.constant] == [384]
    eye = basis.project(basis.embed(torch.eye(384)))
    assert (eye - torch.eye(384)).abs().max() < 1e-6
    # Rows that read nothing are dense too: exactly zero only on the constant channel.
    rows = basis.complement(torch.randn(8, 4096))
    assert (rows == 0).nonzero()[:, 1].unique().tolist() == [384]
    assert (basis.embed(torch.randn(8, 384)) @ rows.T).abs().max() < 1e-4


def test_layout_helpers():
    assert place_layers(4, (1, 3), 8, (2, 6)) == [0, 2, 3, 6]
    with pytest.raises(ConfigError, match="cannot place"):
        place_layers(4, (1, 3), 8, (2, 3))  # small layer 2 has no room between big 2 and 3
    with pytest.raises(ConfigError, match="must increase"):
        place_layers(4, (2, 1), 8, (1, 5))
    q, kv = head_map(AttnShape(6, 2, 64), AttnShape(32, 8, 128))
    assert q.tolist() == [0, 1, 2, 4, 5, 6] and kv.tolist() == [0, 1]
    with pytest.raises(ConfigError, match="do not fit"):
        head_map(AttnShape(8, 2, 64), AttnShape(8, 4, 128))  # groups of 4 into groups of 2
    assert dim_map(4, 8).tolist() == [0, 2, 4, 6]
    with pytest.raises(ConfigError, match="divide"):
        dim_map(64, 96)


def test_refuses_shapes_that_cannot_hold_the_pair():
    small = load_embedded_pair()
    with pytest.raises(ConfigError, match="smaller than the pair"):
        scale_pair(small, reduced_scale(layers=4, feature_layers=(1, 2)))
    with pytest.raises(ConfigError, match="no room"):
        scale_pair(small, reduced_scale(hidden=384))
    eps = reduced_scale()
    from dataclasses import replace

    eps = replace(eps, target=replace(eps.target, rms_norm_eps=1e-5))
    with pytest.raises(ConfigError, match="rms_norm_eps"):
        scale_pair(small, eps)


def test_export_shards_the_target_and_hashes_every_file(tmp_path):
    small = load_embedded_pair()
    result = export_scaled(small, SCALE, tmp_path / "o", dtype="bfloat16", shard_bytes=64 << 20)
    index = json.loads((result.target / "model.safetensors.index.json").read_text())
    shards = sorted(p.name for p in result.target.glob("model-*.safetensors"))
    assert len(shards) > 1 and set(index["weight_map"].values()) == set(shards)
    assert (result.draft / "model.safetensors").is_file()
    manifest = json.loads((result.folder / "export.json").read_text())
    assert manifest["scaled"]["target_layers_of_small_layers"] == [0, 1, 3, 5, 6]
    for rel, digest in manifest["sha256"].items():
        assert _file_sha256(result.folder / rel) == digest
    config = json.loads((result.target / "config.json").read_text())
    assert config["tie_word_embeddings"] is False and config["max_window_layers"] == 8


def test_command_line_refuses_a_non_empty_folder_before_building(tmp_path):
    out = tmp_path / "o"
    out.mkdir()
    (out / "keep").write_text("x")
    proc = subprocess.run(
        [sys.executable, "-m", "ddtree_cli.engine.export", "--scale", "qwen3-8b", str(out)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode != 0
    assert proc.stderr.startswith("Error: ") and "not empty" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
    assert [p.name for p in out.iterdir()] == ["keep"]
