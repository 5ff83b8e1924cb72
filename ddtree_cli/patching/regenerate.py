"""Maintainers: rebuild a patch series from a pristine and an edited snapshot.

    python -m ddtree_cli.patching.regenerate PRISTINE_ROOT EDITED_ROOT VERSION LAYOUT

Both roots hold ``sglang/``. Every file that differs (or exists only in the edited tree)
goes into ``series/VERSION/ddtree.patch``; ``series.json`` records the pristine SHA-256 of
each modified file. The vendored ``ddtree_tree.py`` is left out (copied at apply time).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from ddtree_cli.patching import unidiff
from ddtree_cli.patching.series import VENDORED_TREE_PATH, series_dir_on_disk, sha256


def _py_files(root: Path) -> dict[str, bytes]:
    return {
        p.relative_to(root).as_posix(): p.read_bytes()
        for p in (root / "sglang").rglob("*.py")
        if "__pycache__" not in p.parts
    }


def regenerate(pristine: Path, edited: Path, version: str, layout: str) -> Path:
    before, after = _py_files(pristine), _py_files(edited)
    pristine_hashes: dict[str, str] = {}
    new_files: list[str] = []
    chunks: list[str] = []
    for rel in sorted(after):
        if rel == VENDORED_TREE_PATH or before.get(rel) == after[rel]:
            continue
        old = before.get(rel)
        if old is None:
            new_files.append(rel)
        else:
            pristine_hashes[rel] = sha256(old)
        chunks.append(
            unidiff.make(rel, None if old is None else old.decode(), after[rel].decode())
        )
    out = series_dir_on_disk(version)
    out.mkdir(parents=True, exist_ok=True)
    (out / "ddtree.patch").write_text("".join(chunks), encoding="utf-8")
    meta = {"version": version, "layout": layout, "pristine": pristine_hashes, "new_files": new_files}
    (out / "series.json").write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
    return out


if __name__ == "__main__":
    if len(sys.argv) != 5:
        sys.exit(__doc__)
    print(regenerate(Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3], sys.argv[4]))
