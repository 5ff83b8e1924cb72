"""``python -m ddtree_cli.training``: one command per stage, fixed seeds, each stage's
outputs in files (the usage is in the package docstring)."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from ddtree_cli.engine.drafter import DFlashDrafter
from ddtree_cli.engine.model_config import DraftConfig, TargetConfig
from ddtree_cli.engine.target import Qwen3Target
from ddtree_cli.engine.weights import MANIFEST
from ddtree_cli.training import __doc__ as USAGE
from ddtree_cli.training.corpus import Corpus, build_corpus
from ddtree_cli.training.data import generate_data, load_data, save_data
from ddtree_cli.training.evaluation import evaluate
from ddtree_cli.training.loop import train_drafter, train_target
from ddtree_cli.training.model_setup import CONFIGS, load_target, log, save_trained_pair


def write_json(path: Path, obj: dict) -> None:
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


def run_target(args, corpus: Corpus, out: Path, cfg: TargetConfig) -> tuple[Qwen3Target, dict]:
    """Stage 2 with the command line's options."""
    return train_target(
        corpus,
        out,
        cfg,
        device=args.device,
        seconds=args.target_seconds,
        max_steps=args.target_steps,
        batch=args.batch,
        seq=args.seq,
    )


def run_gendata(args, target: Qwen3Target, corpus: Corpus) -> dict:
    """Stage 3 with the command line's options."""
    return generate_data(
        target,
        corpus,
        device=args.device,
        seconds=args.gen_seconds,
        max_seqs=args.gen_seqs,
        batch=args.gen_batch,
        prompt_len=args.prompt_len,
        new_tokens=args.new_tokens,
    )


def run_drafter(
    args, target: Qwen3Target, data: dict, cfg: DraftConfig
) -> tuple[DFlashDrafter, dict]:
    """Stage 4 with the command line's options."""
    return train_drafter(
        target,
        data,
        cfg,
        device=args.device,
        seconds=args.drafter_seconds,
        max_steps=args.drafter_steps,
        batch=args.drafter_batch,
        blocks=args.drafter_blocks,
        lr=args.drafter_lr,
    )


def provenance(args, target_stats: dict | None, data: dict, drafter_stats: dict) -> dict:
    """The manifest's ``training`` record: the stages' statistics and where they ran."""
    return {
        "target": target_stats,
        "gendata": gendata_meta(data),
        "drafter": drafter_stats,
        "device": args.device,
        "torch": torch.__version__,
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
        target, tstats = run_target(args, corpus, out, tcfg)
    data = run_gendata(args, target, corpus)
    drafter, dstats = run_drafter(args, target, data, dcfg)
    prov = {"corpus": corpus_meta(corpus), **provenance(args, tstats, data, dstats)}
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
        write_json(Path(args.eval_out or out / "eval.json"), res)
    return prov


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m ddtree_cli.training",
        description=USAGE,
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
        run_target(args, Corpus.load(args.corpus), args.out, CONFIGS[args.config][0])
    elif args.cmd == "gendata":
        target = load_target(args.model)
        data = run_gendata(args, target, Corpus.load(args.corpus))
        save_data(data, args.out)
    elif args.cmd == "drafter":
        target = load_target(args.model)
        data = load_data(args.data)
        drafter, stats = run_drafter(args, target, data, CONFIGS[args.config][1])
        prov = provenance(args, target_stats_of(args.model), data, stats)
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
        write_json(args.out, res)
        print(json.dumps(res, indent=2))
    else:
        pipeline(args)
    return 0
