"""Prompt sets: the built-in code/math/chat/stdlib sets, JSONL and ShareGPT files, random prompts.

Both arms of an A/B get the same list, in the same order: the list depends only on the
dataset, the number of prompts and the seed.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from ddtree_cli.errors import ConfigError

# code/math/chat: requests as users write them, for real models. stdlib: windows of the
# Python standard library files the embedded pair was never trained on (its own kind of
# text; benchmarks/stdlib_prompts.py says how they were cut).
BUILTIN = ("code", "math", "chat", "stdlib")

# Real-text words for random prompts: acceptance depends on text that looks like text, so
# random prompts are made of words, not random token ids.
_WORDS = [
    "the",
    "of",
    "and",
    "to",
    "in",
    "is",
    "that",
    "for",
    "it",
    "as",
    "was",
    "with",
    "be",
    "by",
    "on",
    "not",
    "he",
    "this",
    "are",
    "or",
    "his",
    "from",
    "at",
    "which",
    "but",
    "have",
    "an",
    "they",
    "you",
    "were",
    "her",
    "she",
    "there",
    "one",
    "all",
    "we",
    "their",
    "can",
    "has",
    "been",
    "if",
    "more",
    "when",
    "will",
    "would",
    "who",
    "so",
    "no",
    "time",
    "about",
    "many",
    "then",
    "them",
    "these",
    "some",
    "into",
    "two",
    "could",
    "state",
    "only",
    "new",
    "year",
    "other",
    "over",
    "such",
    "first",
    "after",
    "also",
    "any",
    "most",
    "where",
    "like",
    "our",
    "between",
    "high",
    "made",
    "world",
    "city",
    "water",
    "system",
    "number",
    "people",
    "small",
    "large",
    "place",
    "work",
    "light",
    "river",
    "house",
    "market",
    "energy",
    "model",
    "memory",
    "paper",
    "garden",
    "music",
    "report",
    "engine",
    "signal",
    "forest",
    "summer",
]


@dataclass(frozen=True)
class Prompt:
    id: str
    text: str | None = None
    input_ids: tuple[int, ...] | None = None

    def payload(self) -> dict:
        """The prompt part of an SGLang /generate body."""
        if self.input_ids is not None:
            return {"input_ids": list(self.input_ids)}
        return {"text": self.text}


def load_workload(
    dataset: str, num_prompts: int, *, seed: int = 0, random_input_len: int = 32
) -> list[Prompt]:
    """Return ``num_prompts`` prompts from a built-in set, a file, or random words."""
    if num_prompts < 1:
        raise ConfigError(f"--num-prompts must be at least 1, got {num_prompts}")
    if dataset == "random":
        return random_prompts(num_prompts, seed=seed, words=random_input_len)
    if dataset in BUILTIN:
        pool = _builtin(dataset)
        source = f"built-in set '{dataset}'"
    else:
        path = Path(dataset)
        if not path.is_file():
            raise ConfigError(
                f"unknown dataset '{dataset}'",
                hint=f"use one of {', '.join(BUILTIN)}, random, or a .jsonl/.json file",
            )
        pool = load_file(path)
        source = str(path)
    if len(pool) < num_prompts:
        raise ConfigError(
            f"{source} has {len(pool)} prompts; --num-prompts {num_prompts} needs more",
            hint="lower --num-prompts, or use --dataset random or a bigger file",
        )
    # A seeded shuffle, so that a prefix of the set is not always the same few prompts
    # while both arms (and reruns with the same seed) still see one list.
    order = list(range(len(pool)))
    random.Random(seed).shuffle(order)
    return [pool[i] for i in order[:num_prompts]]


def random_prompts(n: int, *, seed: int, words: int) -> list[Prompt]:
    rng = random.Random(seed)
    return [
        Prompt(id=f"random-{i:04d}", text=" ".join(rng.choice(_WORDS) for _ in range(words)))
        for i in range(n)
    ]


def _builtin(name: str) -> list[Prompt]:
    text = resources.files("ddtree_cli.bench").joinpath("data", f"{name}.jsonl").read_text()
    return _parse_jsonl(text, f"<built-in {name}>")


def load_file(path: Path) -> list[Prompt]:
    """JSONL (one prompt per line) or a ShareGPT-format JSON list."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: cannot read: {exc}") from exc
    if text.lstrip().startswith("["):
        try:
            items = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{path}:{exc.lineno}: invalid JSON: {exc.msg}") from exc
        prompts = [_prompt_from(item, f"{path}[{i}]", i) for i, item in enumerate(items)]
    else:
        prompts = _parse_jsonl(text, str(path))
    prompts = [p for p in prompts if p is not None]
    if not prompts:
        raise ConfigError(f"{path}: no prompts found", hint="see docs/bench.md for the formats")
    return prompts


def _parse_jsonl(text: str, where: str) -> list[Prompt]:
    out = []
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{where}:{lineno}: invalid JSON: {exc.msg}") from exc
        prompt = _prompt_from(item, f"{where}:{lineno}", len(out))
        if prompt is not None:
            out.append(prompt)
    return out


def _prompt_from(item: object, where: str, index: int) -> Prompt | None:
    """One record: {"prompt"|"text": str} or {"input_ids": [int]} or ShareGPT conversations."""
    if not isinstance(item, dict):
        raise ConfigError(f"{where}: expected a JSON object, got {type(item).__name__}")
    pid = str(item.get("id", f"p{index:04d}"))
    for key in ("prompt", "text"):
        value = item.get(key)
        if isinstance(value, str) and value.strip():
            return Prompt(id=pid, text=value)
    ids = item.get("input_ids")
    if isinstance(ids, list) and ids and all(isinstance(t, int) and t >= 0 for t in ids):
        return Prompt(id=pid, input_ids=tuple(ids))
    conversations = item.get("conversations")
    if isinstance(conversations, list):
        # ShareGPT: the first human turn is the prompt; records without one are skipped,
        # as SGLang's and vLLM's loaders do.
        for turn in conversations:
            if isinstance(turn, dict) and turn.get("from") in ("human", "user"):
                value = turn.get("value")
                if isinstance(value, str) and value.strip():
                    return Prompt(id=pid, text=value)
        return None
    raise ConfigError(
        f"{where}: no prompt in this record",
        hint='give "prompt" (a string), "input_ids" (a list of ints) or ShareGPT "conversations"',
    )
