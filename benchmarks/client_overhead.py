"""Client CPU per streamed token: `ddtree bench` vs SGLang's `bench_serving`, same emitter.

Both clients stream SGLang-format SSE (one token per chunk, cumulative text and ids, as
SGLang 0.5.23 sends by default) from the same local emitter process
(``ddtree_cli.bench.emitter``), at the same concurrency and output length. Each client
runs as its own process, pinned to one core, with the emitter pinned to another. The
client's CPU time (user + sys, from ``wait4``) is measured at two prompt counts; the
difference divided by the difference in streamed tokens is the marginal CPU per token,
which removes start-up (imports, tokenizer loading, plots, summaries).

``ddtree bench`` runs as the real command (``--url`` against the emitter, one arm, JSONL,
summary, report and plots written). ``bench_serving`` comes from the sglang 0.5.23 wheel
(``pip download --no-deps``), installed with the few packages it needs into a throwaway
venv. Two imports outside its request path (`sglang.srt.utils.network` URL helpers and a
constant from `sglang.srt.disaggregation.utils`) are replaced by equivalents, because the
packages around them import torch, triton and more at import time; the request loop,
aiohttp and orjson parsing are SGLang's own. A word-level tokenizer is built locally for
its ``random-ids`` dataset.

    python benchmarks/client_overhead.py                  # both clients, 200 and 600 prompts
    python benchmarks/client_overhead.py --skip-sglang    # ours only
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
import venv
import zipfile
from pathlib import Path

SGLANG_VERSION = "0.5.23"
BENCH_SERVING_DEPS = [
    "aiohttp",
    "msgspec",
    "numpy",
    "orjson",
    "requests",
    "tqdm",
    "transformers",
    "pybase64",
    "pillow",
    "datasets",
]
WHEEL_CACHE = Path.home() / ".cache" / "ddtree" / "wheels"
SYS_SHARE: dict[str, list[tuple[float, float]]] = {}  # per client: (user s, sys s) per run

SHIM = r"""
import runpy, sys, types
from pathlib import Path
root = Path(sys.argv.pop(1)) / "sglang"
# Bare packages: their __init__ files import torch/triton and are not needed here.
for name, path in {"sglang": root, "sglang.srt": root / "srt",
                   "sglang.srt.utils": root / "srt" / "utils",
                   "sglang.srt.disaggregation": root / "srt" / "disaggregation"}.items():
    mod = types.ModuleType(name)
    mod.__path__ = [str(path)]
    sys.modules[name] = mod
stubs = {
    "sglang.srt.disaggregation.utils": {"FAKE_BOOTSTRAP_HOST": "2.2.2.2"},
    "sglang.srt.utils.network": {
        "resolve_base_url": lambda base_url, host, port: base_url or f"http://{host}:{port}",
        "resolve_host_port": lambda base_url, host, port: base_url or f"{host}:{port}",
    },
}
for name, attrs in stubs.items():
    mod = types.ModuleType(name)
    mod.__dict__.update(attrs)
    sys.modules[name] = mod
runpy.run_module("sglang.benchmark.serving", run_name="__main__")
"""

TOKENIZER = r"""
import json, sys
from tokenizers import Tokenizer, models, pre_tokenizers
vocab = {"[UNK]": 0, **{f"w{i}": i + 1 for i in range(1000)}}
tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
out = sys.argv[1]
tok.save(f"{out}/tokenizer.json")
json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "[UNK]",
           "model_max_length": 4096}, open(f"{out}/tokenizer_config.json", "w"))
"""


def pinned(core: int):
    def fn() -> None:
        if hasattr(os, "sched_setaffinity"):
            os.sched_setaffinity(0, {core})

    return fn


def run_measured(
    cmd: list[str], core: int, env: dict | None = None, cwd: Path | None = None
) -> tuple[float, float, str]:
    """Run a client; return (cpu seconds, wall seconds, stdout); CPU = user + sys."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        preexec_fn=pinned(core),
        env=env,
        cwd=cwd,
    )
    out = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"client failed: {' '.join(cmd)}\n{out[-3000:]}")
    SYS_SHARE.setdefault(cmd[1], []).append((usage.ru_utime, usage.ru_stime))
    return usage.ru_utime + usage.ru_stime, wall, out


def start_emitter(core: int) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "ddtree_cli.bench.emitter", "--port", "0"],
        stdout=subprocess.PIPE,
        text=True,
        preexec_fn=pinned(core),
    )
    port = int(proc.stdout.readline())
    return proc, f"http://127.0.0.1:{port}"


def ours(url: str, prompts: int, args, workdir: Path, core: int) -> tuple[float, float, int]:
    out_dir = workdir / f"ours-{prompts}"
    cmd = [
        sys.executable,
        "-m",
        "ddtree_cli",
        "bench",
        "--url",
        f"dflash={url}",
        "--algo",
        "dflash",
        "--baseline",
        "none",
        "--dataset",
        "random",
        "--num-prompts",
        str(prompts),
        "--max-new-tokens",
        str(args.output_len),
        "--concurrency",
        str(args.concurrency),
        "--trials",
        "1",
        "--warmup",
        "1",
        "--output",
        str(out_dir),
        "--json",
    ]
    cpu, wall, out = run_measured(cmd, core)
    summary = json.loads(out[out.index("{") :])
    tokens = summary["arms"]["dflash"]["completion_tokens"]
    return cpu, wall, tokens


def prepare_bench_serving(venv_dir: Path, workdir: Path) -> tuple[Path, Path, Path]:
    python = venv_dir / "bin" / "python"
    if not python.exists():
        venv.create(venv_dir, with_pip=True)
        subprocess.run([str(python), "-m", "pip", "install", "-q", *BENCH_SERVING_DEPS], check=True)
    WHEEL_CACHE.mkdir(parents=True, exist_ok=True)
    wheels = list(WHEEL_CACHE.glob(f"sglang-{SGLANG_VERSION}-*.whl"))
    if not wheels:
        subprocess.run(
            [
                str(python),
                "-m",
                "pip",
                "download",
                "-q",
                "--no-deps",
                f"sglang=={SGLANG_VERSION}",
                "-d",
                str(WHEEL_CACHE),
            ],
            check=True,
        )
        wheels = list(WHEEL_CACHE.glob(f"sglang-{SGLANG_VERSION}-*.whl"))
    site = workdir / "sglang-src"
    with zipfile.ZipFile(wheels[0]) as zf:
        zf.extractall(site, [n for n in zf.namelist() if n.startswith("sglang/")])
    tokenizer = workdir / "tokenizer"
    tokenizer.mkdir(exist_ok=True)
    subprocess.run([str(python), "-c", TOKENIZER, str(tokenizer)], check=True)
    shim = workdir / "bench_serving_shim.py"
    shim.write_text(SHIM)
    return python, site, tokenizer


def bench_serving(url, prompts, args, workdir, core, python, site, tokenizer):
    # bench_serving writes its result file (sglang_<date>_<n>_...jsonl) into the current
    # folder: run it in the work folder, with absolute paths, so nothing lands in the caller's.
    cmd = [
        os.path.abspath(python),
        os.path.abspath(workdir / "bench_serving_shim.py"),
        os.path.abspath(site),
        "--backend",
        "sglang",
        "--base-url",
        url,
        "--model",
        "emitter",
        "--tokenizer",
        os.path.abspath(tokenizer),
        "--dataset-name",
        "random-ids",
        "--random-input-len",
        "32",
        "--random-output-len",
        str(args.output_len),
        "--random-range-ratio",
        "1.0",
        "--num-prompts",
        str(prompts),
        "--max-concurrency",
        str(args.concurrency),
        "--disable-ignore-eos",
        "--ready-check-timeout-sec",
        "0",
    ]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    cpu, wall, out = run_measured(cmd, core, env, cwd=workdir)
    ok = re.search(r"Successful requests:\s+(\d+)", out)
    tokens = re.search(r"Total generated tokens:\s+(\d+)", out)
    if not ok or int(ok.group(1)) != prompts or not tokens:
        raise SystemExit(f"bench_serving did not complete every request:\n{out[-3000:]}")
    return cpu, wall, int(tokens.group(1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", default="200,600", help="two prompt counts, small,large")
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--skip-sglang", action="store_true")
    ap.add_argument("--venv-dir", type=Path, help="reuse this venv for bench_serving")
    args = ap.parse_args()
    small, large = (int(x) for x in args.prompts.split(","))
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else [0, 1]
    client_core, emitter_core = cores[0], cores[-1]

    workdir = Path(tempfile.mkdtemp(prefix="ddtree-client-overhead-"))
    emitter, url = start_emitter(emitter_core)
    rows = []
    try:
        clients = [("ddtree bench", lambda n: ours(url, n, args, workdir, client_core))]
        if not args.skip_sglang:
            venv_dir = args.venv_dir or workdir / "venv"
            python, site, tok = prepare_bench_serving(venv_dir, workdir)
            clients.append(
                (
                    f"sglang {SGLANG_VERSION} bench_serving",
                    lambda n: bench_serving(url, n, args, workdir, client_core, python, site, tok),
                )
            )
        for name, run in clients:
            measured = {n: run(n) for n in (small, large)}
            (c1, _, t1), (c2, _, t2) = measured[small], measured[large]
            per_token = (c2 - c1) / (t2 - t1)
            rows.append((name, measured, per_token))
    finally:
        emitter.terminate()
        emitter.wait()
        shutil.rmtree(workdir, ignore_errors=True)

    print(
        f"\n{time.strftime('%Y-%m-%d')}, {platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} cores, Python {platform.python_version()}; output {args.output_len} "
        f"tokens/request, one token per chunk, concurrency {args.concurrency}\n"
    )
    print("| client | prompts | streamed tokens | client CPU s | wall s |")
    print("|---|---|---|---|---|")
    for name, measured, _ in rows:
        for n, (cpu, wall, tokens) in measured.items():
            print(f"| {name} | {n} | {tokens:,} | {cpu:.2f} | {wall:.2f} |")
    print(
        "\n| client | marginal CPU per streamed token | of which kernel (sys) | "
        "streamed tokens/s per core |"
    )
    print("|---|---|---|---|")
    for (name, measured, per_token), runs in zip(rows, SYS_SHARE.values(), strict=True):
        (_, _, t1), (_, _, t2) = measured[small], measured[large]
        sys_per_token = (runs[1][1] - runs[0][1]) / (t2 - t1)
        print(
            f"| {name} | {per_token * 1e6:.2f} µs | {sys_per_token * 1e6:.2f} µs | "
            f"{1 / per_token:,.0f} |"
        )
    if len(rows) == 2:
        print(f"\nbench_serving / ddtree bench CPU per token: {rows[1][2] / rows[0][2]:.2f}x")


if __name__ == "__main__":
    main()
