"""The training stages (tiny config, tiny corpus slice) and the shipped trained pair."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from ddtree_cli.engine.decoding import Engine, generate
from ddtree_cli.engine.export import check_sglang_capturable
from ddtree_cli.engine.tokenizer import EOS_ID, MASK_ID
from ddtree_cli.engine.weights import (
    EMBEDDED_DIR,
    MANIFEST,
    load_embedded_pair,
    load_pair,
    pair_for,
    random_pair,
)
from ddtree_cli.errors import ConfigError
from ddtree_cli.training.cli import main as train_main
from ddtree_cli.training.corpus import Corpus, is_heldout
from ddtree_cli.training.data import load_data
from ddtree_cli.training.forwards import drafter_forward, target_forward
from ddtree_cli.training.model_setup import CONFIGS, TINY_DRAFT, TINY_TARGET, load_target


@pytest.fixture(scope="module")
def corpus_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("corpus") / "corpus.npz"
    assert train_main(["corpus", "--out", str(path), "--max-files", "12"]) == 0
    return path


def test_corpus_records_version_files_and_a_stable_heldout_rule(corpus_file):
    import platform

    corpus = Corpus.load(corpus_file)
    assert corpus.meta["python"] == platform.python_version()
    assert corpus.meta["files"] == len(corpus.names) == len(corpus.files)
    assert sum(corpus.heldout) >= 1 and not all(corpus.heldout)
    for name, held in zip(corpus.names, corpus.heldout, strict=True):
        assert is_heldout(name) == bool(held)
    # Tokens are the engine tokenizer's bytes; each file ends with EOS in the stream.
    assert corpus.stream(True).tolist().count(EOS_ID) == int(sum(corpus.heldout))
    assert max(int(f.max()) for f in corpus.files) < 256


def test_training_forwards_match_the_engines_decoding_forwards():
    """What is trained must be what the engine decodes with: the full-sequence target
    forward equals the cached one, and every training block equals the engine's drafter
    round at that position."""
    torch.set_grad_enabled(False)
    try:
        pair = random_pair(TINY_TARGET, TINY_DRAFT, seed=3)
        tgt, dr = pair.target.eval(), pair.drafter.eval()
        ids = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(0))
        hidden, feats = target_forward(tgt, ids, (0, 1))
        cache = tgt.new_cache(2, 64, "cpu", torch.float32)
        pos = torch.arange(40).expand(2, 40)
        mask = (pos.unsqueeze(-1) >= pos.unsqueeze(-2)).unsqueeze(1)
        hidden2, feats2 = tgt(ids, pos, cache, pos, mask, (0, 1))
        torch.testing.assert_close(hidden, hidden2)
        torch.testing.assert_close(feats, feats2)
        anchors = torch.tensor([[5, 20], [11, 0]])
        logits, labels = drafter_forward(dr, tgt, ids, feats, anchors)
        for b in range(2):
            for k in range(2):
                a = int(anchors[b, k])
                dcache = dr.new_cache(1, 64, "cpu", torch.float32)
                p = torch.arange(a).unsqueeze(0)
                if a:
                    dr.write_context(dcache, feats[b : b + 1, :a], p, p)
                block = torch.full((1, 16), MASK_ID)
                block[0, 0] = ids[b, a]
                bpos = a + torch.arange(16).unsqueeze(0)
                out = dr(tgt.embed(block), bpos, dcache, torch.tensor([a]), max(a, 1))
                torch.testing.assert_close(logits[b, k], tgt.logits(out[:, 1:])[0])
                assert labels[b, k].tolist() == ids[b, a + 1 : a + 16].tolist()
    finally:
        torch.set_grad_enabled(True)


@pytest.mark.slow
def test_every_stage_runs_end_to_end_and_writes_loadable_outputs(corpus_file, tmp_path):
    model, data, report = tmp_path / "model", tmp_path / "data", tmp_path / "eval.json"
    tiny = ["--config", "tiny", "--device", "cpu"]
    common = ["--corpus", str(corpus_file), *tiny]
    assert train_main(["target", *common, "--out", str(model), "--target-steps", "3",
                   "--batch", "4", "--seq", "64"]) == 0  # fmt: skip
    assert load_target(model).config == TINY_TARGET
    stats = json.loads((model / "target_stats.json").read_text())
    assert stats["steps"] == 3 and stats["heldout_perplexity"] > 1
    assert train_main(["gendata", *common, "--model", str(model), "--out", str(data),
                   "--gen-seqs", "6", "--gen-batch", "4", "--prompt-len", "16",
                   "--new-tokens", "40"]) == 0  # fmt: skip
    gen = load_data(data)
    assert tuple(gen["tokens"].shape) == (6, 56) and gen["prompt_len"] == 16
    # The continuations are the target's own greedy ones (uncached full forward, fp32).
    target = load_target(model).eval()
    with torch.no_grad():
        hidden, _ = target_forward(target, gen["tokens"].long())
    greedy = target.logits(hidden).argmax(-1)[:, 15:-1]
    assert greedy.tolist() == gen["tokens"][:, 16:].tolist()
    assert train_main(["drafter", *tiny, "--data", str(data), "--model", str(model),
                   "--drafter-steps", "3", "--drafter-batch", "2"]) == 0  # fmt: skip
    pair = load_pair(model)
    assert not pair.random_init
    manifest = json.loads((model / MANIFEST).read_text())
    assert manifest["training"]["drafter"]["steps"] == 3
    assert train_main(["eval", *common, "--model", str(model), "--out", str(report),
                   "--eval-prompts", "2", "--eval-new", "12", "--ppl-windows", "4"]) == 0  # fmt: skip
    res = json.loads(report.read_text())
    assert res["weights_sha256"] == pair.weights_sha256
    assert set(res["acceptance"]) == {"dflash", "ddtree-16", "ddtree-32", "ddtree-64", "ddtree-128"}
    assert all(v["same_tokens_as_ar"] == res["prompts"] for v in res["acceptance"].values())
    assert {"ar@1", "dflash@1", "ddtree@1", "ar@8", "dflash@8", "ddtree@8"} == set(
        res["tokens_per_s"]
    )
    # The pipeline can keep a trained target and redo only the drafter's stages.
    again = tmp_path / "again"
    assert train_main(["pipeline", *common, "--target-from", str(model), "--out", str(again),
                   "--gen-seqs", "4", "--prompt-len", "16", "--new-tokens", "24",
                   "--drafter-steps", "2", "--drafter-batch", "2", "--eval-seconds", "0"]) == 0  # fmt: skip
    kept = load_pair(again)
    assert kept.target.state_dict().keys() == target.state_dict().keys()
    for name, value in target.state_dict().items():
        assert torch.equal(kept.target.state_dict()[name], value), name
    prov = json.loads((again / MANIFEST).read_text())["training"]
    assert prov["target"] == stats and prov["gendata"]["sequences"] == 4


def test_the_drafter_never_reads_the_targets_last_layer():
    """SGLang cannot capture the last layer's output, so an exported pair must not need it."""
    target_cfg, draft_cfg = CONFIGS["small"]
    assert max(draft_cfg.target_layer_ids) < target_cfg.num_hidden_layers - 1
    shipped = load_embedded_pair()
    check_sglang_capturable(shipped.target.config, shipped.drafter.config)  # raises if not
    layers = shipped.drafter.config.target_layer_ids
    assert max(layers) < shipped.target.config.num_hidden_layers - 1


def test_shipped_pair_loads_by_default_with_its_hashes_checked():
    files = [EMBEDDED_DIR / p / "model.safetensors" for p in ("target", "draft")]
    assert all(f.stat().st_size <= 16 * 2**20 for f in files)
    assert sum(f.stat().st_size for f in files) <= 25_000_000
    pair = pair_for(None)
    assert not pair.random_init and pair.origin == load_embedded_pair().origin
    assert pair.drafter.config.block_size == 16
    assert pair.weights_sha256 == load_embedded_pair().weights_sha256
    assert pair_for("random").random_init


def test_a_corrupted_copy_of_the_shipped_pair_is_refused(tmp_path):
    copy = tmp_path / "m"
    shutil.copytree(EMBEDDED_DIR, copy)
    path = copy / "draft" / "model.safetensors"
    path.chmod(0o644)
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    path.write_bytes(bytes(raw))
    with pytest.raises(ConfigError, match="sha256 .* does not match"):
        load_pair(copy)


def test_the_shipped_pair_is_lossless_and_its_drafter_is_accepted():
    pair = load_embedded_pair()
    text = "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n"
    prompt = list(text.encode())
    ar = generate(Engine(pair, "ar"), [prompt], 48)[0]
    for algo, budget in (("dflash", None), ("ddtree", 32)):
        seq = generate(Engine(pair, algo, budget=budget), [prompt], 48)[0]
        assert seq.output == ar.output
        # The shipped drafter is accepted for several tokens a round on code it never saw.
        assert seq.accepted_tokens / seq.verify_ct > 2.0
