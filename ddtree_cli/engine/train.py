"""Train the embedded target + DFlash drafter pair on the Python standard library.

One command per stage, fixed seeds, each stage's outputs in files::

    python -m ddtree_cli.engine.train corpus   --out corpus.npz
    python -m ddtree_cli.engine.train target   --corpus corpus.npz --out model
    python -m ddtree_cli.engine.train gendata  --corpus corpus.npz --model model --out data
    python -m ddtree_cli.engine.train drafter  --data data --model model
    python -m ddtree_cli.engine.train eval     --corpus corpus.npz --model model --out eval.json
    python -m ddtree_cli.engine.train pipeline --corpus corpus.npz --out model  # 2-5 in one go
    # keep a trained target, redo 3-5:
    python -m ddtree_cli.engine.train pipeline --corpus corpus.npz --out model --target-from DIR

The corpus is the standard library of the interpreter that runs ``corpus`` (its version and
file list are recorded), tokenised with the engine's byte tokenizer. A file is held out for
evaluation when the SHA-256 of its path relative to the library root is 0 mod 50: the rule
names no version, so the same files are held out wherever they exist.

Training reuses the engine's own modules (``Qwen3Target``, ``DFlashDrafter`` and their
layers) through full-sequence forwards with a causal / block mask, so what is trained is
exactly what the engine decodes with; the pair is written in the engine's model-folder
format (bf16 safetensors, upcast on load). Needs torch, numpy and safetensors only.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import platform
import sys
import sysconfig
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from ddtree_cli.engine.drafter import DFlashDrafter
from ddtree_cli.engine.model_config import DraftConfig, TargetConfig
from ddtree_cli.engine.target import Qwen3Target
from ddtree_cli.engine.tokenizer import EOS_ID, MASK_ID, VOCAB_SIZE, ByteTokenizer
from ddtree_cli.engine.weights import MANIFEST, ModelPair, random_pair, save_pair

HELDOUT_MODULUS = 50
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


# ---- stage 1: corpus -------------------------------------------------------------------


def is_heldout(relpath: str) -> bool:
    digest = hashlib.sha256(relpath.encode()).digest()
    return int.from_bytes(digest[:8], "big") % HELDOUT_MODULUS == 0


def build_corpus(out: Path, max_files: int | None = None) -> dict:
    """Tokenise the running interpreter's stdlib ``*.py`` files into ``out`` (npz)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "dist-packages", "__pycache__"}
    files = sorted(
        p for p in root.rglob("*.py") if p.is_file() and not skip & set(p.relative_to(root).parts)
    )
    tok = ByteTokenizer()
    names, held, chunks, skipped = [], [], [], []
    for path in files:
        rel = path.relative_to(root).as_posix()
        try:
            ids = tok.encode(path.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, OSError):
            skipped.append(rel)  # a few test files are deliberately not UTF-8
            continue
        if not ids:
            continue
        names.append(rel)
        held.append(is_heldout(rel))
        chunks.append(np.asarray(ids, dtype=np.uint8))
    if max_files is not None:
        # A tiny slice for tests: the first files of each split, in path order.
        train_idx = [i for i, h in enumerate(held) if not h][:max_files]
        held_idx = [i for i, h in enumerate(held) if h][: max(1, max_files // 8)]
        keep = sorted(train_idx + held_idx)
        names = [names[i] for i in keep]
        held = [held[i] for i in keep]
        chunks = [chunks[i] for i in keep]
    offsets = np.zeros(len(chunks) + 1, dtype=np.int64)
    offsets[1:] = np.cumsum([len(c) for c in chunks])
    meta = {
        "python": platform.python_version(),
        "implementation": platform.python_implementation(),
        "tokenizer": tok.name,
        "files": len(names),
        "heldout_files": int(sum(held)),
        "tokens": int(offsets[-1]),
        "heldout_tokens": int(sum(len(c) for c, h in zip(chunks, held, strict=True) if h)),
        "skipped_not_utf8": skipped,
        "heldout_rule": f"sha256(path relative to the stdlib root) % {HELDOUT_MODULUS} == 0",
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(
        out,
        data=np.concatenate(chunks) if chunks else np.zeros(0, np.uint8),
        offsets=offsets,
        names=np.asarray(names),
        heldout=np.asarray(held, dtype=bool),
        meta=np.asarray(json.dumps(meta)),
    )
    return meta


@dataclass
class Corpus:
    meta: dict
    names: list[str]
    heldout: np.ndarray
    files: list[np.ndarray]

    @classmethod
    def load(cls, path: Path) -> Corpus:
        with np.load(path) as z:
            data, offsets = z["data"], z["offsets"]
            files = [data[offsets[i] : offsets[i + 1]] for i in range(len(offsets) - 1)]
            return cls(json.loads(str(z["meta"])), list(z["names"]), z["heldout"], files)

    def stream(self, heldout: bool) -> torch.Tensor:
        """The split's files concatenated, each followed by EOS (int64)."""
        parts = []
        for f, h in zip(self.files, self.heldout, strict=True):
            if bool(h) == heldout:
                parts += [f.astype(np.int64), np.asarray([EOS_ID], np.int64)]
        return torch.from_numpy(np.concatenate(parts))

    def heldout_prompts(self, count: int, length: int) -> list[list[int]]:
        """Fixed prompts: the first ``length`` tokens of held-out files, in path order."""
        out = []
        for f, h in zip(self.files, self.heldout, strict=True):
            if h and len(f) >= length:
                out.append(f[:length].astype(np.int64).tolist())
        return out[:count]


# ---- full-sequence forwards through the engine's modules --------------------------------


def _attend(attn, q, k, v, **kw):
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), enable_gqa=True, **kw
    )
    return attn.o_proj(out.transpose(1, 2).flatten(2))


def target_forward(
    target: Qwen3Target,
    ids: torch.Tensor,
    feature_layers: tuple[int, ...] = (),
    features_only: bool = False,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Causal forward over whole sequences (no cache): final normed hidden, features.

    ``features_only`` stops after the last feature layer and returns no hidden states.
    """
    b, n = ids.shape
    pos = torch.arange(n, device=ids.device).expand(b, n)
    x = target.embed(ids)
    feats = []
    for i, layer in enumerate(target.model.layers):
        attn = layer.self_attn
        h = layer.input_layernorm(x)
        q = attn.project_q(h, pos, target.rope)
        k, v = attn.project_kv(h, pos, target.rope)
        x = layer.finish(x, _attend(attn, q, k, v, is_causal=True))
        if i in feature_layers:
            feats.append(x)
            if features_only and len(feats) == len(feature_layers):
                return None, torch.cat(feats, dim=-1)
    return target.model.norm(x), (torch.cat(feats, dim=-1) if feats else None)


def drafter_forward(
    drafter: DFlashDrafter,
    target: Qwen3Target,
    tokens: torch.Tensor,
    feats: torch.Tensor,
    anchors: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits of K blocks per sequence, as the engine's drafter computes them in decoding.

    tokens [b, T], feats [b, T, F] (the target's features), anchors [b, K]: block k is
    ``[tokens[a], mask * (B-1)]`` at positions a..a+B-1 and sees the context features at
    positions < a plus its own block (non-causal). Returns logits [b, K, B-1, V] for
    positions a+1..a+B-1 and their labels [b, K, B-1].
    """
    cfg = drafter.config
    bsz, seq = tokens.shape
    width, k_blocks = cfg.block_size, anchors.shape[1]
    dev = tokens.device
    offs = torch.arange(width, device=dev)
    blk_pos = anchors.unsqueeze(-1) + offs  # [b, K, B]
    blk_ids = torch.full_like(blk_pos, cfg.mask_token_id)
    blk_ids[:, :, 0] = tokens.gather(1, anchors)
    labels = tokens.gather(1, blk_pos[:, :, 1:].flatten(1)).view(bsz, k_blocks, width - 1)
    ctx = drafter.hidden_norm(drafter.fc(feats))
    ctx_pos = torch.arange(seq, device=dev).expand(bsz, seq)
    qpos = blk_pos.flatten(1)
    ctx_vis = torch.arange(seq, device=dev).view(1, 1, 1, seq) < anchors.view(bsz, k_blocks, 1, 1)
    ctx_vis = ctx_vis.expand(bsz, k_blocks, width, seq).reshape(bsz, k_blocks * width, seq)
    blk = torch.arange(k_blocks * width, device=dev) // width
    own = (blk.unsqueeze(0) == blk.unsqueeze(1)).expand(bsz, -1, -1)
    mask = torch.cat([ctx_vis, own], dim=-1).unsqueeze(1)
    with torch.no_grad():
        x = target.embed(blk_ids.flatten(1))
    for layer in drafter.layers:
        attn = layer.self_attn
        h = layer.input_layernorm(x)
        q = attn.project_q(h, qpos, drafter.rope)
        k, v = attn.project_kv(h, qpos, drafter.rope)
        ck, cv = attn.project_kv(ctx, ctx_pos, drafter.rope)
        keys, values = torch.cat([ck, k], dim=1), torch.cat([cv, v], dim=1)
        x = layer.finish(x, _attend(attn, q, keys, values, attn_mask=mask))
    hidden = drafter.norm(x).view(bsz, k_blocks, width, -1)[:, :, 1:]
    return target.logits(hidden), labels


# ---- model folders ---------------------------------------------------------------------


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
    import copy

    t16 = copy.deepcopy(target).cpu().to(torch.bfloat16)
    d16 = copy.deepcopy(drafter).cpu().to(torch.bfloat16)
    pair = ModelPair(t16, d16, "ddtree-embedded-trained", "", False)
    save_pair(pair, folder)
    manifest = json.loads((folder / MANIFEST).read_text())
    manifest["training"] = provenance
    (folder / MANIFEST).write_text(json.dumps(manifest, indent=2))


# ---- stage 2: target -------------------------------------------------------------------


def _lr(frac: float, peak: float, warm: float = 0.03) -> float:
    if frac < warm:
        return peak * frac / warm
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, (frac - warm) / (1 - warm)))))


def _device_setup(device: str) -> torch.device:
    dev = torch.device(device)
    if dev.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    return dev


def _autocast(dev: torch.device):
    return torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda")


@torch.no_grad()
def heldout_loss(target: Qwen3Target, stream: torch.Tensor, seq: int, max_windows: int) -> float:
    """Mean next-token cross-entropy (nats) over non-overlapping held-out windows."""
    dev = next(target.parameters()).device
    n = (len(stream) - 1) // seq
    idx = torch.arange(min(n, max_windows)) * seq
    total, count = 0.0, 0
    for chunk in idx.split(64):
        win = torch.stack([stream[i : i + seq + 1] for i in chunk.tolist()]).to(dev)
        with _autocast(dev):
            hidden, _ = target_forward(target, win[:, :-1])
            logits = target.logits(hidden).float()
        total += F.cross_entropy(logits.flatten(0, 1), win[:, 1:].flatten(), reduction="sum").item()
        count += win[:, 1:].numel()
    return total / max(count, 1)


def train_target(
    corpus: Corpus,
    out: Path,
    cfg: TargetConfig,
    *,
    device: str = "cpu",
    seconds: float = 240.0,
    max_steps: int = 10**9,
    batch: int = 128,
    seq: int = 512,
    lr: float = 2e-3,
    seed: int = SEED,
) -> tuple[Qwen3Target, dict]:
    dev = _device_setup(device)
    gen = seed_all(seed)
    target = random_pair(cfg, DraftConfig(**_draft_for(cfg)), seed=seed).target.to(dev).train()
    train, held = corpus.stream(False), corpus.stream(True)
    train_dev = train.to(dev)
    decay = [p for n, p in target.named_parameters() if p.dim() == 2]
    other = [p for n, p in target.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": other, "weight_decay": 0.0}],
        lr=lr,
        betas=(0.9, 0.95),
        fused=dev.type == "cuda",
    )
    start, step, last_log = time.perf_counter(), 0, 0.0
    offs = torch.arange(seq + 1, device=dev)
    while step < max_steps:
        frac = max((time.perf_counter() - start) / seconds, step / max_steps)
        if frac >= 1.0:
            break
        for group in opt.param_groups:
            group["lr"] = _lr(frac, lr)
        starts = torch.randint(0, len(train) - seq - 1, (batch,), generator=gen).to(dev)
        win = train_dev[starts.unsqueeze(1) + offs]
        with _autocast(dev):
            hidden, _ = target_forward(target, win[:, :-1])
            logits = target.logits(hidden)
        loss = F.cross_entropy(logits.float().flatten(0, 1), win[:, 1:].flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(target.parameters(), 1.0)
        opt.step()
        step += 1
        now = time.perf_counter() - start
        if now - last_log > 20 or step == 1:
            last_log = now
            log(f"target step {step} {now:.0f}s loss {loss.item():.3f}")
    elapsed = time.perf_counter() - start
    target.eval()
    held_nats = heldout_loss(target, held.to(dev), seq, max_windows=512)
    stats = {
        "steps": step,
        "seconds": round(elapsed, 1),
        "tokens_seen": step * batch * seq,
        "batch": batch,
        "seq": seq,
        "lr": lr,
        "seed": seed,
        "final_train_loss": round(float(loss.item()), 4) if step else None,
        "heldout_nats_per_token": round(held_nats, 4),
        "heldout_perplexity": round(math.exp(held_nats), 4),
        "params": sum(p.numel() for p in target.parameters()),
    }
    log(f"target done: {stats}")
    save_target(target, out)
    (out / "target_stats.json").write_text(json.dumps(stats, indent=2))
    return target, stats


def _draft_for(cfg: TargetConfig) -> dict:
    """A drafter config matching ``cfg`` (only to build the target through ``random_pair``)."""
    for t, d in CONFIGS.values():
        if t == cfg:
            return asdict(d)
    d = asdict(TINY_DRAFT)
    d.update(hidden_size=cfg.hidden_size, target_layer_ids=(0,))
    return d


# ---- stage 3: the target's own greedy continuations + features --------------------------


def _cached_layer(layer, rope, x, pos, k_cache, v_cache, start: int) -> torch.Tensor:
    """One layer over ``x`` [n, m, H] at positions start..start+m-1, the same in every row.

    Rows share their length, so no mask is needed: a prefill (start 0) is causal, a step
    (m == 1) sees the whole cache written so far.
    """
    attn = layer.self_attn
    h = layer.input_layernorm(x)
    q = attn.project_q(h, pos, rope)
    k, v = attn.project_kv(h, pos, rope)
    end = start + x.shape[1]
    k_cache[:, start:end] = k
    v_cache[:, start:end] = v
    out = _attend(attn, q, k_cache[:, :end], v_cache[:, :end], is_causal=x.shape[1] > 1)
    return layer.finish(x, out)


@torch.no_grad()
def greedy_continue(target: Qwen3Target, prompts: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """Greedy continuation of equal-length prompts [N, P] with a KV cache.

    The prompts share their length, so the cache is one contiguous tensor per layer and no
    step needs a mask; decoding is cheap enough to do for thousands of rows at once.
    """
    dev = prompts.device
    n, plen = prompts.shape
    cfg = target.config
    dtype = next(target.parameters()).dtype
    shape = (n, plen + new_tokens, cfg.num_key_value_heads, cfg.head_dim)
    caches = [
        (torch.empty(shape, device=dev, dtype=dtype), torch.empty(shape, device=dev, dtype=dtype))
        for _ in target.model.layers
    ]

    def run(ids: torch.Tensor, start: int) -> torch.Tensor:
        pos = torch.arange(start, start + ids.shape[1], device=dev).unsqueeze(0)
        x = target.embed(ids)
        for layer, (kc, vc) in zip(target.model.layers, caches, strict=True):
            x = _cached_layer(layer, target.rope, x, pos, kc, vc, start)
        return target.logits(target.model.norm(x[:, -1])).argmax(-1)

    out = torch.empty(n, plen + new_tokens, dtype=prompts.dtype, device=dev)
    out[:, :plen] = prompts
    tok = run(prompts, 0)
    out[:, plen] = tok
    for t in range(plen, plen + new_tokens - 1):
        tok = run(tok.unsqueeze(1), t)
        out[:, t + 1] = tok
    return out


@torch.no_grad()
def generate_data(
    target: Qwen3Target,
    corpus: Corpus,
    *,
    device: str = "cpu",
    seconds: float = 90.0,
    max_seqs: int = 10**6,
    batch: int = 4096,
    prompt_len: int = 128,
    new_tokens: int = 256,
    seed: int = SEED + 1,
) -> dict:
    """Prompts: windows of the training files at uniformly random positions; continuations:
    the target's own greedy tokens. Only tokens are kept: the drafter stage recomputes the
    target's features (one cheap forward per batch), so the data stays small.
    """
    dev = _device_setup(device)
    gen = torch.Generator().manual_seed(seed)
    import copy

    model = copy.deepcopy(target).to(dev)
    if dev.type == "cuda":
        model = model.to(torch.bfloat16)
    model.eval()
    train = corpus.stream(False)
    toks = []
    start, made = time.perf_counter(), 0
    while made < max_seqs and time.perf_counter() - start < seconds:
        n = min(batch, max_seqs - made)
        starts = torch.randint(0, len(train) - prompt_len, (n,), generator=gen)
        prompts = train[starts.unsqueeze(1) + torch.arange(prompt_len)].to(dev)
        toks.append(greedy_continue(model, prompts, new_tokens).to("cpu", torch.int16))
        made += n
        log(f"gendata: {made} sequences after {time.perf_counter() - start:.1f}s")
    data = {
        "tokens": torch.cat(toks),
        "prompt_len": prompt_len,
        "seconds": round(time.perf_counter() - start, 1),
        "seed": seed,
    }
    log(f"gendata: {made} sequences of {prompt_len}+{new_tokens} in {data['seconds']}s")
    return data


SHARD_BYTES = 15 * 2**20  # every output file stays under 16 MiB


def save_data(data: dict, folder: Path) -> None:
    """``folder/tokens-NNN.npy`` shards (int16) and ``folder/meta.json``."""
    folder.mkdir(parents=True, exist_ok=True)
    for old in folder.glob("tokens-*.npy"):
        old.unlink()
    tokens = data["tokens"].numpy()
    rows = max(1, SHARD_BYTES // max(1, tokens.shape[1] * tokens.itemsize))
    for i in range(0, len(tokens), rows):
        np.save(folder / f"tokens-{i // rows:03d}.npy", tokens[i : i + rows])
    meta = {k: v for k, v in data.items() if k != "tokens"}
    meta["shape"] = list(tokens.shape)
    (folder / "meta.json").write_text(json.dumps(meta, indent=2))


def load_data(folder: Path) -> dict:
    meta = json.loads((folder / "meta.json").read_text())
    shards = sorted(folder.glob("tokens-*.npy"))
    tokens = torch.from_numpy(np.concatenate([np.load(p) for p in shards]))
    if list(tokens.shape) != meta["shape"]:
        raise ValueError(f"{folder}: shards hold {list(tokens.shape)}, meta says {meta['shape']}")
    return {**meta, "tokens": tokens}


# ---- stage 4: drafter ------------------------------------------------------------------


def train_drafter(
    target: Qwen3Target,
    data: dict,
    cfg: DraftConfig,
    *,
    device: str = "cpu",
    seconds: float = 150.0,
    max_steps: int = 10**9,
    batch: int = 64,
    blocks: int = 24,
    lr: float = 1e-3,
    gamma: float = 7.0,
    seed: int = SEED + 2,
) -> tuple[DFlashDrafter, dict]:
    """Cross-entropy on the block's B-1 positions, position k weighted exp(-(k-1)/gamma)
    (early positions decide acceptance)."""
    dev = _device_setup(device)
    gen = seed_all(seed)
    drafter = random_pair(target.config, cfg, seed=seed).drafter.to(dev).train()
    target = target.to(dev).eval()
    for p in target.parameters():
        p.requires_grad_(False)
    tokens = data["tokens"].to(dev).long()
    layer_ids = tuple(cfg.target_layer_ids)
    n, seq = tokens.shape

    def features(rows: torch.Tensor) -> torch.Tensor:
        # Recomputed per batch: one frozen target forward is cheap next to storing them.
        with torch.no_grad():
            return target_forward(target, tokens[rows], layer_ids, features_only=True)[1]

    lo, hi = int(data["prompt_len"]), seq - cfg.block_size  # anchors inside the continuation
    weights = torch.exp(-torch.arange(cfg.block_size - 1, device=dev) / gamma)
    decay = [p for p in drafter.parameters() if p.dim() == 2]
    other = [p for p in drafter.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.01}, {"params": other, "weight_decay": 0.0}],
        lr=lr,
        betas=(0.9, 0.95),
        fused=dev.type == "cuda",
    )
    held = torch.arange(n)[-max(1, min(256, n // 50)) :]  # last rows: validation
    train_rows = n - len(held)
    start, step, last_log = time.perf_counter(), 0, 0.0
    while step < max_steps:
        frac = max((time.perf_counter() - start) / seconds, step / max_steps)
        if frac >= 1.0:
            break
        for group in opt.param_groups:
            group["lr"] = _lr(frac, lr)
        rows = torch.randint(0, max(train_rows, 1), (batch,), generator=gen).to(dev)
        anchors = torch.randint(lo, hi + 1, (batch, blocks), generator=gen).to(dev)
        with _autocast(dev):
            logits, labels = drafter_forward(drafter, target, tokens[rows], features(rows), anchors)
        ce = F.cross_entropy(
            logits.float().flatten(0, 2), labels.flatten(), reduction="none"
        ).view_as(labels)
        loss = (ce * weights).sum(-1).mean() / weights.sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(drafter.parameters(), 1.0)
        opt.step()
        step += 1
        now = time.perf_counter() - start
        if now - last_log > 20 or step == 1:
            last_log = now
            log(f"drafter step {step} {now:.0f}s loss {loss.item():.3f}")
    drafter.eval()
    with torch.no_grad(), _autocast(dev):
        g = torch.Generator().manual_seed(seed)
        rows = held.to(dev)
        anchors = torch.randint(lo, hi + 1, (len(held), blocks), generator=g).to(dev)
        logits, labels = drafter_forward(drafter, target, tokens[rows], features(rows), anchors)
        hit = (logits.argmax(-1) == labels).long()
    # Expected accepted drafts per block if the chain stops at the first miss (teacher-forced).
    chain = hit.cumprod(-1).sum(-1).float().mean().item()
    stats = {
        "steps": step,
        "seconds": round(time.perf_counter() - start, 1),
        "batch": batch,
        "blocks_per_sequence": blocks,
        "target_layer_ids": list(layer_ids),
        "sequences": n,
        "sequences_seen": step * batch,
        "lr": lr,
        "gamma": gamma,
        "seed": seed,
        "final_loss": round(float(loss.item()), 4) if step else None,
        "val_top1_by_position": [round(x, 3) for x in hit.float().mean((0, 1)).tolist()],
        "val_chain_accept_length": round(1 + chain, 3),
        "params": sum(p.numel() for p in drafter.parameters()),
    }
    log(f"drafter done: {stats}")
    return drafter, stats


# ---- stage 5: evaluation ---------------------------------------------------------------


def evaluate(
    folder: Path,
    corpus: Corpus,
    *,
    device: str = "cpu",
    budgets: tuple[int, ...] = (16, 32, 64, 128),
    prompts: int = 16,
    prompt_len: int = 128,
    max_new: int = 256,
    speed_batches: tuple[int, ...] = (1, 8),
    speed_budget: int | None = None,
    deadline: float | None = None,
    ppl_windows: int = 256,
) -> dict:
    """Perplexity, acceptance per mode, tokens/s per mode and batch; greedy, fp32."""
    from ddtree_cli.engine.decoding import Engine, generate
    from ddtree_cli.engine.weights import load_pair

    dev = torch.device(device)
    if dev.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
    pair = load_pair(folder)
    held = corpus.stream(True)
    res: dict = {
        "device": torch.cuda.get_device_name(dev)
        if dev.type == "cuda"
        else platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "weights_sha256": pair.weights_sha256,
        "target_params": pair.identity()["target_params"],
        "draft_params": pair.identity()["draft_params"],
    }
    pair.target.to(dev)
    if ppl_windows:
        nats = heldout_loss(pair.target, held.to(dev), 512, max_windows=ppl_windows)
        res["heldout_nats_per_token"] = round(nats, 4)
        res["heldout_perplexity"] = round(math.exp(nats), 4)
    ps = corpus.heldout_prompts(prompts, prompt_len)
    res["prompts"] = len(ps)
    ctx = prompt_len + max_new + 8

    def run(algo: str, budget: int | None, batch: int, items: list[list[int]]):
        eng = Engine(pair, algo, budget=budget, max_batch=batch, context_len=ctx, device=dev)
        generate(eng, [items[0][:16]], 8)  # warm-up
        if dev.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        seqs = generate(eng, items, max_new)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        return seqs, time.perf_counter() - t0

    # Acceptance does not depend on the batch (greedy): one wave of every prompt.
    ar, _ = run("ar", None, len(ps), ps)
    ref = [s.output for s in ar]
    modes = [("dflash", None)] + [("ddtree", b) for b in budgets]
    acc = {}
    for algo, budget in modes:
        if deadline and time.time() > deadline:
            break
        seqs, _ = run(algo, budget, len(ps), ps)
        name = algo if budget is None else f"ddtree-{budget}"
        acc[name] = {
            "accept_length": round(
                sum(s.accepted_tokens for s in seqs) / max(1, sum(s.verify_ct for s in seqs)), 3
            ),
            "same_tokens_as_ar": sum(s.output == r for s, r in zip(seqs, ref, strict=True)),
        }
        log(f"eval {name}: {acc[name]}")
    res["acceptance"] = acc
    trees = {k: v["accept_length"] for k, v in acc.items() if k.startswith("ddtree-")}
    best = speed_budget or (int(max(trees, key=trees.get).split("-")[1]) if trees else 15)
    res["speed_budget"] = best
    speed = {}
    for batch in speed_batches:
        for algo, budget in (("ar", None), ("dflash", None), ("ddtree", best)):
            if deadline and time.time() > deadline:
                break
            items = ps[: max(batch, 2)]  # one wave at batch 8, two sequences at batch 1
            seqs, secs = run(algo, budget, batch, items)
            toks = sum(len(s.output) for s in seqs)
            speed[f"{algo}@{batch}"] = round(toks / secs, 1)
            log(f"speed {algo} batch {batch}: {toks / secs:.1f} tok/s")
    res["tokens_per_s"] = speed
    return res


# ---- commands --------------------------------------------------------------------------


def _write_json(path: Path, obj: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=2))


def target_stats_of(folder: Path) -> dict | None:
    """The target's training record: ``target_stats.json``, else the folder's manifest."""
    stats = folder / "target_stats.json"
    if stats.is_file():
        return json.loads(stats.read_text())
    manifest = folder / MANIFEST
    if manifest.is_file():
        return (json.loads(manifest.read_text()).get("training") or {}).get("target")
    return None


def corpus_meta(corpus: Corpus) -> dict:
    return {k: v for k, v in corpus.meta.items() if k != "skipped_not_utf8"}


def gendata_meta(data: dict) -> dict:
    return {
        "sequences": int(data["tokens"].shape[0]),
        "length": int(data["tokens"].shape[1]),
        "prompt_len": data["prompt_len"],
        "seconds": data["seconds"],
        "seed": data.get("seed"),
    }


def pipeline(args) -> dict:
    """Stages 2-5 back to back, each one's outputs written as soon as it ends."""
    t0 = time.time()
    tcfg, dcfg = CONFIGS[args.config]
    corpus = Corpus.load(args.corpus)
    out = Path(args.out)
    if args.target_from:
        # Keep a trained target; only the drafter is (re)trained.
        target, tstats = load_target(args.target_from), target_stats_of(args.target_from)
        if target.config != tcfg:
            raise SystemExit(
                f"{args.target_from}: target config differs from --config {args.config}"
            )
        log(f"target loaded from {args.target_from}: {tstats}")
    else:
        target, tstats = train_target(
            corpus,
            out,
            tcfg,
            device=args.device,
            seconds=args.target_seconds,
            max_steps=args.target_steps,
            batch=args.batch,
            seq=args.seq,
        )
    data = generate_data(
        target,
        corpus,
        device=args.device,
        seconds=args.gen_seconds,
        max_seqs=args.gen_seqs,
        batch=args.gen_batch,
        prompt_len=args.prompt_len,
        new_tokens=args.new_tokens,
    )
    drafter, dstats = train_drafter(
        target,
        data,
        dcfg,
        device=args.device,
        seconds=args.drafter_seconds,
        max_steps=args.drafter_steps,
        batch=args.drafter_batch,
        blocks=args.drafter_blocks,
        lr=args.drafter_lr,
    )
    prov = {
        "corpus": corpus_meta(corpus),
        "target": tstats,
        "gendata": gendata_meta(data),
        "drafter": dstats,
        "device": args.device,
        "torch": torch.__version__,
    }
    del data
    save_trained_pair(target, drafter, out, prov)
    log(f"pair saved to {out} after {time.time() - t0:.0f}s")
    if args.eval_seconds > 0:
        res = evaluate(
            out,
            corpus,
            device=args.device,
            deadline=time.time() + args.eval_seconds,
            prompts=args.eval_prompts,
            max_new=args.eval_new,
        )
        _write_json(Path(args.eval_out or out / "eval.json"), res)
    return prov


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m ddtree_cli.engine.train",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = p.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("corpus", help="stage 1: tokenise this interpreter's stdlib")
    c.add_argument("--out", type=Path, required=True)
    c.add_argument("--max-files", type=int, help="a tiny slice (tests)")

    def common(sp, corpus=True):
        if corpus:
            sp.add_argument("--corpus", type=Path, required=True)
        sp.add_argument("--config", choices=sorted(CONFIGS), default="small")
        sp.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")

    def target_opts(sp):
        sp.add_argument("--target-seconds", type=float, default=240)
        sp.add_argument("--target-steps", type=int, default=10**9)
        sp.add_argument("--batch", type=int, default=128)
        sp.add_argument("--seq", type=int, default=512)

    def gen_opts(sp):
        sp.add_argument("--gen-seconds", type=float, default=90)
        sp.add_argument("--gen-seqs", type=int, default=10**6)
        sp.add_argument("--gen-batch", type=int, default=4096)
        sp.add_argument("--prompt-len", type=int, default=128)
        sp.add_argument("--new-tokens", type=int, default=256)

    def drafter_opts(sp):
        sp.add_argument("--drafter-seconds", type=float, default=150)
        sp.add_argument("--drafter-steps", type=int, default=10**9)
        sp.add_argument("--drafter-batch", type=int, default=64)
        sp.add_argument("--drafter-blocks", type=int, default=24, help="anchors per sequence")
        sp.add_argument("--drafter-lr", type=float, default=1e-3)

    def eval_opts(sp):
        sp.add_argument("--eval-prompts", type=int, default=16)
        sp.add_argument("--eval-new", type=int, default=256)

    t = sub.add_parser("target", help="stage 2: train the target")
    common(t)
    target_opts(t)
    t.add_argument("--out", type=Path, required=True)
    g = sub.add_parser("gendata", help="stage 3: the target's greedy continuations")
    common(g)
    gen_opts(g)
    g.add_argument("--model", type=Path, required=True)
    g.add_argument("--out", type=Path, required=True, help="a folder of token shards")
    d = sub.add_parser("drafter", help="stage 4: train the drafter, write the pair")
    common(d, corpus=False)
    drafter_opts(d)
    d.add_argument("--data", type=Path, required=True)
    d.add_argument("--model", type=Path, required=True)
    e = sub.add_parser("eval", help="stage 5: perplexity, acceptance, tokens/s")
    common(e)
    eval_opts(e)
    e.add_argument("--model", type=Path, required=True)
    e.add_argument("--out", type=Path, required=True)
    e.add_argument("--speed-budget", type=int)
    e.add_argument("--ppl-windows", type=int, default=256)
    a = sub.add_parser("pipeline", help="stages 2-5 in one process")
    common(a)
    target_opts(a)
    gen_opts(a)
    drafter_opts(a)
    eval_opts(a)
    a.add_argument("--out", type=Path, required=True)
    a.add_argument("--target-from", type=Path, help="a model folder whose trained target is kept")
    a.add_argument("--eval-seconds", type=float, default=60)
    a.add_argument("--eval-out", type=Path)
    args = p.parse_args(argv)

    if args.cmd == "corpus":
        print(json.dumps(build_corpus(args.out, args.max_files), indent=2))
    elif args.cmd == "target":
        train_target(
            Corpus.load(args.corpus),
            args.out,
            CONFIGS[args.config][0],
            device=args.device,
            seconds=args.target_seconds,
            max_steps=args.target_steps,
            batch=args.batch,
            seq=args.seq,
        )
    elif args.cmd == "gendata":
        target = load_target(args.model)
        data = generate_data(
            target,
            Corpus.load(args.corpus),
            device=args.device,
            seconds=args.gen_seconds,
            max_seqs=args.gen_seqs,
            batch=args.gen_batch,
            prompt_len=args.prompt_len,
            new_tokens=args.new_tokens,
        )
        save_data(data, args.out)
    elif args.cmd == "drafter":
        target = load_target(args.model)
        data = load_data(args.data)
        drafter, stats = train_drafter(
            target,
            data,
            CONFIGS[args.config][1],
            device=args.device,
            seconds=args.drafter_seconds,
            max_steps=args.drafter_steps,
            batch=args.drafter_batch,
            blocks=args.drafter_blocks,
            lr=args.drafter_lr,
        )
        prov = {
            "target": target_stats_of(args.model),
            "gendata": gendata_meta(data),
            "drafter": stats,
            "device": args.device,
            "torch": torch.__version__,
        }
        save_trained_pair(target, drafter, args.model, prov)
    elif args.cmd == "eval":
        res = evaluate(
            args.model,
            Corpus.load(args.corpus),
            device=args.device,
            prompts=args.eval_prompts,
            max_new=args.eval_new,
            speed_budget=args.speed_budget,
            ppl_windows=args.ppl_windows,
        )
        _write_json(args.out, res)
        print(json.dumps(res, indent=2))
    else:
        pipeline(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
