"""Stage 5: perplexity on held-out files, acceptance length per decoding mode, tokens/s
per mode and batch (greedy, fp32), through the engine itself."""

from __future__ import annotations

import math
import platform
import time
from pathlib import Path

import torch

from ddtree_cli.training.corpus import Corpus
from ddtree_cli.training.loop import heldout_loss
from ddtree_cli.training.model_setup import log


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
    identity = pair.identity()
    res: dict = {
        "device": torch.cuda.get_device_name(dev)
        if dev.type == "cuda"
        else platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "weights_sha256": pair.weights_sha256,
        "target_params": identity["target_params"],
        "draft_params": identity["draft_params"],
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
