"""Stage 1: the corpus (this interpreter's standard library, tokenised with the engine's
byte tokenizer; its version and file list are recorded) and the held-out rule.

A file is held out for evaluation when the SHA-256 of its path relative to the library root
is 0 mod 50: the rule names no version, so the same files are held out wherever they exist.
"""

from __future__ import annotations

import hashlib
import json
import platform
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ddtree_cli.engine.tokenizer import EOS_ID, ByteTokenizer

HELDOUT_MODULUS = 50


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
