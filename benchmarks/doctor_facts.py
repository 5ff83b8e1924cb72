"""Wall time of collecting one host's facts: imports side by side vs one after another.

The slow part of `ddtree doctor` on a host is importing torch (for the torch facts) and the
kernel packages (sgl_kernel, flashinfer, sglang: each imports torch again) in fresh
interpreters. `gather()` runs those subprocesses in parallel; `parallel=False` runs them one
after another, as a plain collector would. Both arms run in the same process, interleaved
(A B A B ...), on the same interpreter and probe modules.

With no SGLang here, the probes import stand-ins that pull in torch the same way
(default: torch, torch.nn, safetensors.torch). On a GPU host pass the real ones:
``--modules sgl_kernel flashinfer sglang --python /opt/sglang/venv/bin/python``.

    python benchmarks/doctor_facts.py --trials 5
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from ddtree_cli.remote import facts as host_facts  # noqa: E402


def one_run(python: str, modules: list[str], parallel: bool) -> float:
    start = time.perf_counter()
    facts = host_facts.gather(python=python, probe_modules=modules, parallel=parallel)
    elapsed = time.perf_counter() - start
    bad = {m: p for m, p in facts["probes"].items() if p["status"] != "ok"}
    if bad:
        raise SystemExit(f"probe failed, the comparison would be meaningless: {bad}")
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--python", default=sys.executable)
    parser.add_argument("--modules", nargs="+", default=["torch", "torch.nn", "safetensors.torch"])
    parser.add_argument("--trials", type=int, default=5)
    args = parser.parse_args()

    one_run(args.python, args.modules, True)  # warm the page cache for both arms
    times: dict[str, list[float]] = {"sequential": [], "parallel": []}
    for _ in range(args.trials):
        times["sequential"].append(one_run(args.python, args.modules, False))
        times["parallel"].append(one_run(args.python, args.modules, True))

    print(
        f"{platform.node()}: {os.cpu_count()} CPUs, Python {platform.python_version()}, "
        f"probes {' '.join(args.modules)}, {args.trials} interleaved trials per arm"
    )
    print("| arm | median s | min s | max s |")
    print("|---|---|---|---|")
    for arm, values in times.items():
        print(
            f"| {arm} | {statistics.median(values):.2f} | {min(values):.2f} | {max(values):.2f} |"
        )
    ratio = statistics.median(times["sequential"]) / statistics.median(times["parallel"])
    print(f"sequential / parallel (medians): {ratio:.2f}x")


if __name__ == "__main__":
    main()
