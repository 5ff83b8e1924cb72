"""Run patched SGLang 0.5.13 on a GPU machine with no network, one short step per call.

Standard library only (the machine's python3 brings torch; everything else comes from the
bundle made by prepare.py). State lives under ``--state`` (default /tmp/ddtree-h200), so
steps can run in separate calls as long as the machine stays up; servers are started in
their own session and outlive the call that started them.

    python3 run.py receive PIECE_OR_DIR...     copy pieces (+ manifest.json) in, sha256 checked
    python3 run.py install                     reassemble, verify, unpack, pip install --target
    python3 run.py serve ARM [--ckpt random --block 16] [--budget N] [--wait 540]
                                               (ddtree: any budget >= 1 on any block,
                                               e.g. --block 16 --budget 64)
    python3 run.py generate ARM [--batch 1]    one /generate with input_ids; prints meta_info
    python3 run.py refusals [--ckpt ...]       _handle_ddtree's refusals on the real launcher
    python3 run.py agree [--prompts 100]       greedy outputs of dflash/ddtree vs plain, margins
    python3 run.py bench [-- extra bench args] ddtree bench ddtree vs dflash, plain as reference
    python3 run.py profile ARM --output DIR    torch profiler over N decode steps (SGLang's
                                               /start_profile), trace + a per-op summary
    python3 run.py stop ARM|all
    python3 run.py logs DEST                   copy server logs to DEST
    python3 run.py units --config C --inventory I --output units.json
                                               the units `ddtree deploy` renders (router,
                                               multi-node), with their commands (units.py)
    python3 run.py start-units units.json [--only NAME...]
                                               start their ExecStart lines directly (there is
                                               no systemd here); waits for /health
    python3 run.py stop-units [NAME...]

ARM is plain, dflash or ddtree. Every server gets the same flags except the algorithm;
``serve --tp N`` adds ``--tp-size N`` (give every arm of a comparison the same N). Every
server's environment has NVLink multicast off (``MULTICAST_OFF``), whatever the caller's says.
"""

from __future__ import annotations

import argparse
import collections
import gzip
import hashlib
import json
import os
import random
import shlex
import shutil
import signal
import subprocess
import sys
import tarfile
import time
import urllib.error
import urllib.request
from pathlib import Path

_BASE = int(os.environ.get("DDTREE_H200_PORT_BASE", "30000"))
PORTS = {"plain": _BASE, "dflash": _BASE + 1, "ddtree": _BASE + 2}
ALGORITHMS = {"plain": None, "dflash": "DFLASH", "ddtree": "DDTREE"}
# Forced into every server's environment: NVLink multicast stays off on the lent machines.
MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                 "NVSHMEM_DISABLE_NVLS": "1"}  # fmt: skip
REFUSALS = {  # flags that must be refused, and the text the refusal must contain
    "page_size_4": (["--page-size", "4"], "DDTREE requires --page-size 1"),
    "fa3": (["--attention-backend", "fa3"], "DDTREE requires --attention-backend triton"),
    # SGLang's own Qwen3-Next check (radix cache + speculative decoding) fires first unless
    # the radix cache is off; with it off, DDTREE's hybrid gate is what refuses.
    "hybrid": (["--disable-radix-cache"], "DDTREE refuses hybrid target models"),
}


def state_dir(args) -> Path:
    path = Path(args.state)
    path.mkdir(parents=True, exist_ok=True)
    return path


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


# --- bundle ------------------------------------------------------------------------------


def cmd_receive(args) -> int:
    pieces = state_dir(args) / "pieces"
    pieces.mkdir(exist_ok=True)
    sources: list[Path] = []
    for src in map(Path, args.sources):
        sources += sorted(src.iterdir()) if src.is_dir() else [src]
    manifest_src = [s for s in sources if s.name == "manifest.json"]
    if manifest_src:
        shutil.copy(manifest_src[0], pieces / "manifest.json")
    if not (pieces / "manifest.json").is_file():
        print("manifest.json must come with the first piece", file=sys.stderr)
        return 2
    expected = {p["name"]: p for p in json.loads((pieces / "manifest.json").read_text())["pieces"]}
    for src in sources:
        if src.name == "manifest.json":
            continue
        if src.name not in expected:
            print(f"{src.name}: not in manifest.json", file=sys.stderr)
            return 2
        if sha256(src) != expected[src.name]["sha256"]:
            print(f"{src.name}: sha256 mismatch", file=sys.stderr)
            return 2
        shutil.copy(src, pieces / src.name)
    have = sorted(p for p in expected if (pieces / p).is_file())
    print(json.dumps({"received": len(have), "of": len(expected),
                      "missing": sorted(set(expected) - set(have))}))  # fmt: skip
    return 0


def cmd_install(args) -> int:
    state = state_dir(args)
    bundle = state / "bundle"
    if not (bundle / ".complete").is_file():
        code = unpack(state, bundle)
        if code:
            return code
    wheels = sorted((bundle / "wheels").glob("*.whl"))
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
                    "--no-compile", "--no-cache-dir", "--target", str(state / "site"),
                    *map(str, wheels)], check=True)  # fmt: skip
    out = subprocess.run([sys.executable, "-c", "import sglang, sgl_kernel, torch; "
                          "print(sglang.__file__, torch.__version__, torch.cuda.is_available())"],
                         env=server_env(state), capture_output=True, text=True)  # fmt: skip
    print(out.stdout.strip() or out.stderr[-2000:])
    return out.returncode


def unpack(state: Path, bundle: Path) -> int:
    pieces = state / "pieces"
    manifest = json.loads((pieces / "manifest.json").read_text())
    missing = [p["name"] for p in manifest["pieces"] if not (pieces / p["name"]).is_file()]
    if missing:
        print(f"missing pieces: {', '.join(missing)}", file=sys.stderr)
        return 2
    tar_path = state / "bundle.tgz"
    whole = hashlib.sha256()
    with tar_path.open("wb") as out:
        for piece in manifest["pieces"]:
            data = (pieces / piece["name"]).read_bytes()
            whole.update(data)
            out.write(data)
    if whole.hexdigest() != manifest["tar_sha256"]:
        tar_path.unlink()
        print("reassembled bundle: sha256 mismatch", file=sys.stderr)
        return 2
    shutil.rmtree(bundle, ignore_errors=True)
    with tarfile.open(tar_path) as tar:
        tar.extractall(bundle, filter="data")
    tar_path.unlink()
    shutil.rmtree(pieces)  # the disk holds the unpacked copy only
    (bundle / ".complete").write_text(manifest["tar_sha256"] + "\n")
    return 0


def server_env(state: Path) -> dict[str, str]:
    # The patched snapshot first, so it shadows the stock sglang installed with the wheels.
    path = [str(state / "bundle" / "snapshot"), str(state / "site")]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(path + [env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.setdefault("PYTHONUNBUFFERED", "1")
    env.update(MULTICAST_OFF)
    return env


# --- servers -----------------------------------------------------------------------------


def server_cmd(state: Path, arm: str, ckpt: str, block: int | None, budget: int | None,
               port: int, mem_fraction: float, max_bs: int, extra: list[str]) -> list[str]:  # fmt: skip
    folder = state / "bundle" / "ckpt" / ckpt
    draft = folder / ("draft" if block is None else f"draft-b{block}")
    cmd = [sys.executable, "-m", "sglang.launch_server",
           "--model-path", str(folder / "target"), "--skip-tokenizer-init",
           "--attention-backend", "triton", "--sampling-backend", "pytorch",
           "--page-size", "1", "--disable-overlap-schedule",
           "--mem-fraction-static", str(mem_fraction), "--cuda-graph-max-bs", str(max_bs),
           "--max-running-requests", str(max(max_bs, 8)), "--enable-metrics",
           # SGLang draws a fresh seed at every start; one seed for all arms, so that
           # `ddtree bench`'s confound guard sees servers equal but for the algorithm.
           "--random-seed", "0",
           "--host", "127.0.0.1", "--port", str(port)]  # fmt: skip
    algorithm = ALGORITHMS[arm]
    if algorithm:
        cmd += ["--speculative-algorithm", algorithm,
                "--speculative-draft-model-path", str(draft),
                "--speculative-draft-attention-backend", "triton"]  # fmt: skip
    if arm == "ddtree" and budget is not None:
        cmd += ["--speculative-ddtree-budget", str(budget)]
    return cmd + extra


def tp_flags(tp: int) -> list[str]:
    """``serve --tp N``: SGLang's ``--tp-size``; one GPU needs no flag."""
    if tp < 1:
        raise SystemExit(f"--tp must be at least 1, got {tp}")
    return [] if tp == 1 else ["--tp-size", str(tp)]


def tp_tag(tag: str, tp: int) -> str:
    """A TP-N server logs apart from the one-GPU server of the same checkpoint and budget."""
    return tag if tp == 1 else f"{tag}-tp{tp}"


def log_tag(ckpt: str, block: int | None, budget: int | None) -> str:
    """Names a server's log: the checkpoint, the draft's block and the DDTREE budget, so
    ``serve ddtree --block 16 --budget 64`` and ``--budget 15`` keep separate logs."""
    tag = ckpt if block is None else f"{ckpt}-b{block}"
    return tag if budget is None else f"{tag}-n{budget}"


def http(url: str, body: dict | None = None, timeout: float = 120) -> tuple[int, dict | str]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            raw = resp.read().decode()
            status = resp.status
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode(errors="replace")
    try:
        return status, json.loads(raw)
    except json.JSONDecodeError:
        return status, raw


def generate(port: int, input_ids: list, max_new: int, **extra) -> dict | list:
    body = {"input_ids": input_ids, "sampling_params":
            {"max_new_tokens": max_new, "temperature": 0, "ignore_eos": True}, **extra}  # fmt: skip
    status, out = http(f"http://127.0.0.1:{port}/generate", body, timeout=300)
    if status != 200:
        raise RuntimeError(f"/generate on port {port}: HTTP {status}: {str(out)[:500]}")
    return out


def cmd_serve(args) -> int:
    state = state_dir(args)
    logs = state / "logs"
    logs.mkdir(exist_ok=True)
    port = PORTS[args.arm]
    cmd = server_cmd(state, args.arm, args.ckpt, args.block, args.budget, port,
                     args.mem_fraction, args.max_bs, args.extra + tp_flags(args.tp))  # fmt: skip
    tag = tp_tag(log_tag(args.ckpt, args.block, args.budget if args.arm == "ddtree" else None),
                 args.tp)  # fmt: skip
    log = logs / f"{args.arm}-{tag}.log"
    with log.open("w") as f:
        f.write("$ " + " ".join(cmd) + "\n")
        f.flush()
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=server_env(state),
                                start_new_session=True)  # fmt: skip
    (state / f"{args.arm}.pid").write_text(str(proc.pid))
    start = time.monotonic()
    while time.monotonic() - start < args.wait:
        if proc.poll() is not None:
            print(log.read_text()[-6000:])
            print(f"{args.arm}: server exited with {proc.returncode}", file=sys.stderr)
            return 1
        try:
            status, _ = http(f"http://127.0.0.1:{port}/health", timeout=5)
        except (urllib.error.URLError, OSError):
            status = 0
        if status == 200:
            print(json.dumps({"arm": args.arm, "ckpt": tag, "healthy_after_s":
                              round(time.monotonic() - start, 1), "log": str(log)}))  # fmt: skip
            return 0
        time.sleep(2)
    print(log.read_text()[-6000:])
    print(f"{args.arm}: not healthy after {args.wait} s (left running)", file=sys.stderr)
    return 1


def cmd_stop(args) -> int:
    state = state_dir(args)
    for arm in PORTS if args.arm == "all" else [args.arm]:
        stop_session(state / f"{arm}.pid")
    return 0


def stop_session(pidfile: Path) -> None:
    """End the session a server was started in (it and its workers), then its pidfile."""
    if not pidfile.is_file():
        return
    pid = int(pidfile.read_text())
    try:
        os.killpg(pid, signal.SIGTERM)
        for _ in range(30):
            time.sleep(1)
            os.killpg(pid, 0)
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    pidfile.unlink()


# --- deploy's units, started by hand -----------------------------------------------------


def units_script(state: Path) -> Path:
    for path in (Path(__file__).with_name("units.py"), state / "bundle" / "units.py"):
        if path.is_file():
            return path
    raise SystemExit("units.py is neither next to run.py nor in the bundle")


def cmd_units(args) -> int:
    """Render deploy's units (units.py, with the bundle's ddtree_cli) for this machine."""
    state = state_dir(args)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([args.client or str(state / "bundle" / "client"),
                                         str(state / "site")])  # fmt: skip
    cmd = [sys.executable, str(units_script(state)), "--config", args.config,
           "--inventory", args.inventory, "--out", args.output,
           "--python", args.python or sys.executable]  # fmt: skip
    cmd += ["--group", args.group] if args.group else []
    cmd += ["--algo", args.algo] if args.algo else []
    return subprocess.run(cmd, env=env).returncode


def unit_env(state: Path, unit: dict) -> dict[str, str]:
    """The servers' environment with the unit's settings on top (its PYTHONPATH first, as
    the unit's release shadows everything), NVLink multicast forced off again."""
    env = server_env(state)
    for key, value in unit["env"].items():
        env[key] = (
            os.pathsep.join([value, env[key]]) if key == "PYTHONPATH" and env.get(key) else value
        )
    env.update(MULTICAST_OFF)
    return env


def units_refusal(unit: dict) -> str | None:
    """Why a unit cannot be started by hand here, or None."""
    if unit["environment_file"]:
        return (
            f"{unit['name']}: reads secrets from {unit['environment_file']}; run by hand "
            "without server.secret_env"
        )
    workdir = unit["working_directory"]
    if workdir and not Path(workdir).is_dir():
        return (
            f"{unit['name']}: working directory {workdir} does not exist (link a release "
            f"there: ln -sfn <release> {workdir})"
        )
    return None


def cmd_start_units(args) -> int:
    """Start the chosen units' ExecStart lines in their own sessions, in the file's order
    (multi-node rank 0 first), then wait until every unit with a health URL answers 200."""
    state = state_dir(args)
    units = json.loads(Path(args.units).read_text())["units"]
    names = [u["name"] for u in units]
    unknown = sorted(set(args.only) - set(names))
    if unknown:
        print(f"no unit {', '.join(unknown)} in {args.units} (it has {', '.join(names)})",
              file=sys.stderr)  # fmt: skip
        return 2
    chosen = [u for u in units if not args.only or u["name"] in args.only]
    refusals = [r for r in map(units_refusal, chosen) if r]
    if refusals:
        print("\n".join(refusals), file=sys.stderr)
        return 2
    logs = state / "logs"
    logs.mkdir(exist_ok=True)
    started = []
    for unit in chosen:
        log = logs / f"unit-{unit['name']}.log"
        with log.open("w") as f:
            f.write("$ " + shlex.join(unit["argv"]) + "\n")
            f.flush()
            proc = subprocess.Popen(unit["argv"], cwd=unit["working_directory"],
                                    env=unit_env(state, unit), stdout=f,
                                    stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
        (state / f"unit-{unit['name']}.pid").write_text(str(proc.pid))
        started.append((unit, proc, log))
    return wait_healthy(started, args.wait)


def healthy(url: str) -> bool:
    try:
        return http(url, timeout=5)[0] == 200
    except (urllib.error.URLError, OSError):
        return False


def wait_healthy(started: list, wait: float) -> int:
    start = time.monotonic()
    pending = {u["name"]: u["health_url"] for u, _, _ in started if u["health_url"]}
    ready: dict[str, float] = {}
    while True:
        for unit, proc, log in started:
            if proc.poll() is not None:
                print(log.read_text()[-6000:])
                print(f"{unit['name']}: exited with {proc.returncode}", file=sys.stderr)
                return 1
        for name, url in list(pending.items()):
            if healthy(url):
                ready[name] = round(time.monotonic() - start, 1)
                del pending[name]
        if not pending:
            print(json.dumps({u["name"]: {"pid": p.pid, "healthy_after_s": ready.get(u["name"]),
                                          "log": str(log)} for u, p, log in started}))  # fmt: skip
            return 0
        if time.monotonic() - start > wait:
            print(f"not healthy after {wait} s (left running): {', '.join(pending)}",
                  file=sys.stderr)  # fmt: skip
            return 1
        time.sleep(1)


def cmd_stop_units(args) -> int:
    state = state_dir(args)
    pidfiles = [state / f"unit-{n}.pid" for n in args.names] or sorted(state.glob("unit-*.pid"))
    for pidfile in pidfiles:
        stop_session(pidfile)
    return 0


def prompts(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(length)] for _ in range(n)]


def prompt_rows(args, seed: int) -> list[list[int]]:
    """``--prompt-file`` (JSONL of ``{"input_ids": [...]}``; a bare name means the bundle's
    ``prompts/<name>.jsonl``), else fixed-seed random ids below ``--vocab``."""
    if not args.prompt_file:
        return prompts(args.prompts, args.prompt_len, args.vocab, seed=seed)
    path = Path(args.prompt_file)
    if not path.is_file():
        path = state_dir(args) / "bundle" / "prompts" / f"{args.prompt_file}.jsonl"
    rows = [json.loads(line)["input_ids"] for line in path.read_text().splitlines() if line]
    if len(rows) < args.prompts:
        raise SystemExit(f"{path}: {len(rows)} prompts, {args.prompts} asked for")
    return rows[: args.prompts]


def cmd_generate(args) -> int:
    ids = prompts(args.batch, 24, args.vocab)
    out = generate(PORTS[args.arm], ids if args.batch > 1 else ids[0], args.max_new)
    rows = out if isinstance(out, list) else [out]
    summary = [{"output_ids": r.get("output_ids"), "meta_info": r.get("meta_info")} for r in rows]
    print(json.dumps({"arm": args.arm, "batch": args.batch, "results": summary}))
    spec = ALGORITHMS[args.arm] is not None
    ok = all(len(r["output_ids"] or []) == args.max_new for r in summary) and (
        not spec or all((r["meta_info"] or {}).get("spec_verify_ct", 0) > 0 for r in summary)
    )
    return 0 if ok else 1


def cmd_refusals(args) -> int:
    state = state_dir(args)
    hybrid = state / "hybrid-target"
    hybrid.mkdir(exist_ok=True)
    (hybrid / "config.json").write_text(json.dumps(
        {"model_type": "qwen3_next", "architectures": ["Qwen3NextForCausalLM"]}))  # fmt: skip
    results, ok = {}, True
    for name, (flags, expect) in REFUSALS.items():
        cmd = server_cmd(state, "ddtree", args.ckpt, args.block, None, 30009, 0.1, 4, flags)
        if name == "hybrid":
            cmd[cmd.index("--model-path") + 1] = str(hybrid)
        proc = subprocess.run(cmd, env=server_env(state), capture_output=True, text=True,
                              timeout=300)  # fmt: skip
        text = proc.stdout + proc.stderr
        line = next((ln.strip() for ln in text.splitlines() if expect in ln), None)
        results[name] = {"returncode": proc.returncode, "message": line,
                         "tail": None if line else text[-1500:]}  # fmt: skip
        ok &= proc.returncode != 0 and line is not None
    print(json.dumps(results, indent=1))
    return 0 if ok else 1


def cmd_agree(args) -> int:
    """Greedy outputs of each speculative arm against plain; margins where they diverge."""
    batch = prompt_rows(args, seed=1)
    outputs = {}
    for arm in ("plain", "dflash", "ddtree"):
        rows = generate(PORTS[arm], batch, args.max_new)
        outputs[arm] = [r["output_ids"] for r in rows]
    report = {"prompts": args.prompts, "max_new_tokens": args.max_new, "arms": {}}
    for arm in ("dflash", "ddtree"):
        diverged = []
        for i, (ref, got) in enumerate(zip(outputs["plain"], outputs[arm], strict=True)):
            at = next((j for j, (a, b) in enumerate(zip(ref, got, strict=False)) if a != b), None)
            if at is None:
                continue
            # The plain server's top-2 log-probs at the first divergent position.
            probe = generate(PORTS["plain"], batch[i] + ref[:at], 1, return_logprob=True,
                             top_logprobs_num=2)  # fmt: skip
            top = probe["meta_info"]["output_top_logprobs"][0]
            diverged.append({"prompt": i, "position": at, "plain": ref[at], "arm": got[at],
                             "top2_logprob_margin": top[0][0] - top[1][0]})  # fmt: skip
        report["arms"][arm] = {"identical": args.prompts - len(diverged), "diverged": diverged}
    Path(args.output).write_text(json.dumps(report, indent=1))
    print(json.dumps({a: {"identical": r["identical"], "diverged": len(r["diverged"]),
                          "max_margin": max((d["top2_logprob_margin"] for d in r["diverged"]),
                                            default=None)}
                      for a, r in report["arms"].items()}))  # fmt: skip
    return 0


def cmd_bench(args) -> int:
    state = state_dir(args)
    dataset = state / "prompts.jsonl"
    with dataset.open("w") as f:
        for ids in prompt_rows(args, seed=2):
            f.write(json.dumps({"input_ids": ids}) + "\n")
    env = dict(os.environ)
    env["PYTHONPATH"] = args.client or str(state / "bundle" / "client")
    cmd = [sys.executable, "-m", "ddtree_cli", "bench", "--algo", "ddtree", "--baseline", "dflash",
           "--url", f"ddtree=http://127.0.0.1:{PORTS['ddtree']}",
           "--url", f"dflash=http://127.0.0.1:{PORTS['dflash']}",
           "--reference", f"http://127.0.0.1:{PORTS['plain']}",
           "--dataset", str(dataset), "--num-prompts", str(args.prompts),
           "--max-new-tokens", str(args.max_new), "--temperature", "0",
           "--concurrency", args.concurrency, "--trials", str(args.trials),
           "--json", "--output", args.output, *args.extra]  # fmt: skip
    return subprocess.run(cmd, env=env).returncode


def summarise_trace(path: Path, top: int = 25) -> dict:
    """Where the time of a torch-profiler Chrome trace went: per category (GPU kernels, CPU
    ops, CUDA runtime calls), the ``top`` names by total duration, with counts."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        events = json.load(f)
    events = events.get("traceEvents", events) if isinstance(events, dict) else events
    totals: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    counts: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for ev in events:
        cat = ev.get("cat")
        if ev.get("ph") != "X" or cat not in ("kernel", "cpu_op", "cuda_runtime", "gpu_memcpy"):
            continue
        totals[cat][ev["name"]] += float(ev.get("dur", 0.0))
        counts[cat][ev["name"]] += 1
    out: dict = {"trace": path.name}
    for cat, by_name in totals.items():
        out[cat] = {
            "total_us": round(sum(by_name.values()), 1),
            "events": sum(counts[cat].values()),
            "top": [
                {"name": name[:160], "total_us": round(us, 1), "count": counts[cat][name]}
                for name, us in by_name.most_common(top)
            ],  # fmt: skip
        }
    return out


def cmd_profile(args) -> int:
    """Profile ``--steps`` forward steps of a running server under load, then summarise."""
    out = Path(args.output).resolve()
    out.mkdir(parents=True, exist_ok=True)
    before = set(out.glob("*.trace.json*"))
    status, body = http(f"http://127.0.0.1:{PORTS[args.arm]}/start_profile",
                        {"output_dir": str(out), "num_steps": args.steps,
                         "activities": ["CPU", "GPU"], "profile_prefix": args.arm})  # fmt: skip
    if status != 200:
        raise SystemExit(f"/start_profile on {args.arm}: HTTP {status}: {str(body)[:300]}")
    # Enough decode rounds for --steps: every request runs to --max-new (ignore_eos).
    rows = prompt_rows(args, seed=3)
    generate(PORTS[args.arm], rows if len(rows) > 1 else rows[0], args.max_new)
    deadline = time.monotonic() + args.wait
    while not (new := set(out.glob("*.trace.json*")) - before):
        if time.monotonic() > deadline:
            raise SystemExit(f"no trace in {out} after {args.wait:.0f} s")
        time.sleep(1)
    time.sleep(2)  # the writer may still be flushing
    summary = [summarise_trace(t, args.top) for t in sorted(new)]
    (out / f"summary-{args.arm}.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary)[:4000])
    return 0


def cmd_logs(args) -> int:
    dest = Path(args.dest)
    dest.mkdir(parents=True, exist_ok=True)
    for log in sorted((state_dir(args) / "logs").glob("*.log")):
        shutil.copy(log, dest / log.name)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--state", default=os.environ.get("DDTREE_H200_STATE", "/tmp/ddtree-h200"))
    p.add_argument("--vocab", type=int, default=260, help="prompt token ids are drawn below this")
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("receive")
    s.add_argument("sources", nargs="+")
    sub.add_parser("install")
    s = sub.add_parser("serve")
    s.add_argument("arm", choices=sorted(PORTS))
    s.add_argument("--ckpt", default="random")
    s.add_argument("--block", type=int, help="use draft-b<N> (the random pair's drafts)")
    s.add_argument(
        "--budget", type=int, help="DDTREE tree nodes per round (default: block size - 1)"
    )
    s.add_argument("--wait", type=float, default=540)
    s.add_argument("--mem-fraction", type=float, default=0.2)
    s.add_argument("--max-bs", type=int, default=8)
    s.add_argument("--tp", type=int, default=1, help="tensor-parallel size (SGLang --tp-size)")
    s.add_argument("extra", nargs="*", help="more launch_server flags, after --")
    s = sub.add_parser("generate")
    s.add_argument("arm", choices=sorted(PORTS))
    s.add_argument("--batch", type=int, default=1)
    s.add_argument("--max-new", type=int, default=32)
    s = sub.add_parser("refusals")
    s.add_argument("--ckpt", default="random")
    s.add_argument("--block", type=int, default=16)
    s = sub.add_parser("agree")
    s.add_argument("--prompts", type=int, default=100)
    s.add_argument("--prompt-len", type=int, default=32)
    s.add_argument("--max-new", type=int, default=64)
    s.add_argument("--output", default="agree.json")
    s.add_argument("--prompt-file", help="JSONL of input_ids, or a bundle prompt set name")
    # Sized for one 10-minute step per concurrency: 40 prompts (bench wants >= 5 x the
    # concurrency) x 64 new tokens x 3 trials x 2 arms.
    s = sub.add_parser("bench")
    s.add_argument("--prompts", type=int, default=40)
    s.add_argument("--prompt-len", type=int, default=64)
    s.add_argument("--max-new", type=int, default=64)
    s.add_argument("--concurrency", default="1")
    s.add_argument("--trials", type=int, default=3)
    s.add_argument("--output", default="bench")
    s.add_argument("--prompt-file", help="JSONL of input_ids, or a bundle prompt set name")
    s.add_argument("--client", help="folder holding ddtree_cli (default: the bundle's)")
    s.add_argument("extra", nargs="*", help="more ddtree bench flags, after --")
    s = sub.add_parser("profile")
    s.add_argument("arm", choices=sorted(PORTS))
    s.add_argument("--output", required=True)
    s.add_argument("--steps", type=int, default=20, help="forward steps to record")
    s.add_argument("--prompts", type=int, default=1, help="concurrent requests")
    s.add_argument("--prompt-len", type=int, default=64)
    s.add_argument("--prompt-file", help="JSONL of input_ids, or a bundle prompt set name")
    s.add_argument("--max-new", type=int, default=256)
    s.add_argument("--top", type=int, default=25)
    s.add_argument("--wait", type=float, default=120)
    s = sub.add_parser("stop")
    s.add_argument("arm", choices=[*sorted(PORTS), "all"])
    s = sub.add_parser("logs")
    s.add_argument("dest")
    s = sub.add_parser("units")
    s.add_argument("--config", required=True, help="a ddtree deploy config (router/multinode)")
    s.add_argument("--inventory", required=True, help="its hosts, in rank order")
    s.add_argument("--group")
    s.add_argument("--algo", choices=["dflash", "ddtree"])
    s.add_argument("--python", help="the units' interpreter (default: this python3)")
    s.add_argument("--client", help="folder holding ddtree_cli (default: the bundle's)")
    s.add_argument("--output", default="units.json")
    s = sub.add_parser("start-units")
    s.add_argument("units", help="units.json from `units`")
    s.add_argument("--only", nargs="*", default=[], help="unit names (default: all)")
    s.add_argument("--wait", type=float, default=540)
    s = sub.add_parser("stop-units")
    s.add_argument("names", nargs="*", help="unit names (default: every started unit)")
    args = p.parse_args(argv)
    return globals()[f"cmd_{args.command.replace('-', '_')}"](args)


if __name__ == "__main__":
    sys.exit(main())
