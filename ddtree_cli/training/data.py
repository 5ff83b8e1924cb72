"""Stage 3: the target's own greedy continuations of corpus windows (tokens only: the
drafter stage recomputes the target's features), saved as shards under 16 MiB each."""

from __future__ import annotations

import copy
import json
import time
from pathlib import Path

import numpy as np
import torch

from ddtree_cli.engine.target import Qwen3Target
from ddtree_cli.training.corpus import Corpus
from ddtree_cli.training.forwards import attend
from ddtree_cli.training.model_setup import SEED, device_setup, log


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
    out = attend(attn, q, k_cache[:, :end], v_cache[:, :end], is_causal=x.shape[1] > 1)
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
    dev = device_setup(device)
    gen = torch.Generator().manual_seed(seed)

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
