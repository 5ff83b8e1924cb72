"""Stages 2 and 4: the training loops of the target (next-token loss) and of the drafter
(the block's positions, early ones weighted more), each with its held-out measure."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from ddtree_cli.engine.drafter import DFlashDrafter
from ddtree_cli.engine.model_config import DraftConfig, TargetConfig
from ddtree_cli.engine.target import Qwen3Target
from ddtree_cli.engine.weights import random_pair
from ddtree_cli.training.corpus import Corpus
from ddtree_cli.training.forwards import drafter_forward, target_forward
from ddtree_cli.training.model_setup import (
    SEED,
    autocast,
    device_setup,
    draft_config_for,
    log,
    lr_schedule,
    save_target,
    seed_all,
)


@torch.no_grad()
def heldout_loss(target: Qwen3Target, stream: torch.Tensor, seq: int, max_windows: int) -> float:
    """Mean next-token cross-entropy (nats) over non-overlapping held-out windows."""
    dev = next(target.parameters()).device
    n = (len(stream) - 1) // seq
    idx = torch.arange(min(n, max_windows)) * seq
    total, count = 0.0, 0
    for chunk in idx.split(64):
        win = torch.stack([stream[i : i + seq + 1] for i in chunk.tolist()]).to(dev)
        with autocast(dev):
            hidden, _ = target_forward(target, win[:, :-1])
            logits = target.logits(hidden).float()
        total += F.cross_entropy(logits.flatten(0, 1), win[:, 1:].flatten(), reduction="sum").item()
        count += win[:, 1:].numel()
    return total / max(count, 1)


def adamw(model: torch.nn.Module, lr: float, weight_decay: float, dev: torch.device):
    """AdamW with weight decay on the matrices only."""
    decay = [p for p in model.parameters() if p.dim() == 2]
    other = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": weight_decay}, {"params": other, "weight_decay": 0.0}],
        lr=lr,
        betas=(0.9, 0.95),
        fused=dev.type == "cuda",
    )


def run_steps(
    name: str,
    model: torch.nn.Module,
    opt: torch.optim.Optimizer,
    lr: float,
    seconds: float,
    max_steps: int,
    step_loss,
) -> tuple[int, torch.Tensor | None, float]:
    """Optimiser steps on ``step_loss()`` until ``seconds`` or ``max_steps`` run out, the
    learning rate following :func:`lr_schedule`. Returns (steps, last loss, start time)."""
    start, step, last_log, loss = time.perf_counter(), 0, 0.0, None
    while step < max_steps:
        frac = max((time.perf_counter() - start) / seconds, step / max_steps)
        if frac >= 1.0:
            break
        for group in opt.param_groups:
            group["lr"] = lr_schedule(frac, lr)
        loss = step_loss()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        now = time.perf_counter() - start
        if now - last_log > 20 or step == 1:
            last_log = now
            log(f"{name} step {step} {now:.0f}s loss {loss.item():.3f}")
    return step, loss, start


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
    dev = device_setup(device)
    gen = seed_all(seed)
    target = random_pair(cfg, draft_config_for(cfg), seed=seed).target.to(dev).train()
    train, held = corpus.stream(False), corpus.stream(True)
    train_dev = train.to(dev)
    opt = adamw(target, lr, 0.1, dev)
    offs = torch.arange(seq + 1, device=dev)

    def step_loss() -> torch.Tensor:
        starts = torch.randint(0, len(train) - seq - 1, (batch,), generator=gen).to(dev)
        win = train_dev[starts.unsqueeze(1) + offs]
        with autocast(dev):
            hidden, _ = target_forward(target, win[:, :-1])
            logits = target.logits(hidden)
        return F.cross_entropy(logits.float().flatten(0, 1), win[:, 1:].flatten())

    step, loss, start = run_steps("target", target, opt, lr, seconds, max_steps, step_loss)
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
    dev = device_setup(device)
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
    opt = adamw(drafter, lr, 0.01, dev)
    held = torch.arange(n)[-max(1, min(256, n // 50)) :]  # last rows: validation
    train_rows = n - len(held)

    def step_loss() -> torch.Tensor:
        rows = torch.randint(0, max(train_rows, 1), (batch,), generator=gen).to(dev)
        anchors = torch.randint(lo, hi + 1, (batch, blocks), generator=gen).to(dev)
        with autocast(dev):
            logits, labels = drafter_forward(drafter, target, tokens[rows], features(rows), anchors)
        ce = F.cross_entropy(
            logits.float().flatten(0, 2), labels.flatten(), reduction="none"
        ).view_as(labels)
        return (ce * weights).sum(-1).mean() / weights.sum()

    step, loss, start = run_steps("drafter", drafter, opt, lr, seconds, max_steps, step_loss)
    drafter.eval()
    with torch.no_grad(), autocast(dev):
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
