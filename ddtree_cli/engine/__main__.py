"""``python -m ddtree_cli.engine``: ``ddtree serve`` without the CLI's Typer/Rich dependencies,
for hosts that only have torch (same options, one JSON line on stdout once ready)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ddtree_cli.engine.server import ServeOptions, ready_summary, run_forever
from ddtree_cli.errors import DdtreeError


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ddtree_cli.engine", description=__doc__)
    p.add_argument("--algo", default="ar", choices=["ar", "dflash", "ddtree"])
    p.add_argument("--budget", help="a number, or 'auto'")
    p.add_argument("--max-budget", type=int)
    p.add_argument("--block-size", type=int)
    p.add_argument("--model", type=Path, help="model folder, or 'random'")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--max-running-requests", type=int, default=8)
    p.add_argument("--context-length", type=int)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    opts = ServeOptions(**vars(args))
    try:
        run_forever(opts, lambda s: print(json.dumps(ready_summary(s)), flush=True))
    except DdtreeError as exc:
        print(f"Error: {exc.message}", file=sys.stderr)
        return int(exc.exit_code)
    return 0


if __name__ == "__main__":
    sys.exit(main())
