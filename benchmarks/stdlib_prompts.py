"""Write ``ddtree_cli/bench/data/stdlib.jsonl``: the built-in ``stdlib`` prompt set.

The embedded pair was trained on CPython 3.11.7's standard library, except the held-out files
(``sha256(relative path) % 50 == 0``). These prompts are windows of those held-out files, cut
by the rule the GPU runs use (``benchmarks/sglang_h200/prepare.py``'s ``heldout_prompts``:
64 bytes from a line start, spread evenly through each file, round-robin over the files in
path order), so the pair is measured on code of its own kind that it never saw. The first 48
of that list; the rule was fixed before any measurement and no prompt was picked by hand.

    python benchmarks/stdlib_prompts.py     # needs CPython 3.11.7 (the training corpus)
"""

from __future__ import annotations

import json
import platform
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(HERE / "sglang_h200"))

from prepare import heldout_prompts  # noqa: E402

COUNT, LENGTH = 48, 64
OUT = REPO / "ddtree_cli" / "bench" / "data" / "stdlib.jsonl"
SOURCE = "CPython 3.11.7 Lib/, held-out split of the embedded pair (benchmarks/stdlib_prompts.py)"


def main() -> None:
    if platform.python_version() != "3.11.7":
        raise SystemExit(f"the corpus is CPython 3.11.7's stdlib; this is {sys.version}")
    lines = []
    for i, ids in enumerate(heldout_prompts(COUNT, LENGTH)):
        record = {"id": f"stdlib-{i:02d}", "prompt": bytes(ids).decode("utf-8"), "source": SOURCE}
        lines.append(json.dumps(record))
    OUT.write_text("\n".join(lines) + "\n")
    print(f"{OUT.relative_to(REPO)}: {len(lines)} prompts of {LENGTH} bytes")


if __name__ == "__main__":
    main()
