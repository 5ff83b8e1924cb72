"""The arguments of the benchmarks that run SGLang's own code from an installed GPU bundle
(``kv_move_gpu.py``, ``verify_attention_gpu.py``): ``--state`` (the bundle's folder, as
``sglang_h200/run.py`` installed it) and ``--device`` (``cpu``: the checks only, under
Triton's interpreter)."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def add(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--state", type=Path, help="an installed GPU bundle's folder (run.py's)")
    ap.add_argument(
        "--device", default="cuda",
        help="cpu: the checks only, under TRITON_INTERPRET=1 (no timing)",
    )  # fmt: skip


def use(args: argparse.Namespace) -> None:
    """With ``--state``, SGLang comes from the bundle, as its servers' does."""
    if args.state:
        sys.path.insert(0, str(ROOT / "benchmarks" / "sglang_h200"))
        import run

        sys.path[:0] = run.server_env(args.state)["PYTHONPATH"].split(os.pathsep)
