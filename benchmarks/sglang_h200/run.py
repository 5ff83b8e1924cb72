"""Run patched SGLang on a GPU machine with no network, one short step per call.

Standard library only (the machine's python3 brings torch; everything else comes from the
bundle made by prepare.py, whose ``contents.json`` names the SGLang release). State lives
under ``--state`` (default /tmp/ddtree-h200), so steps can run in separate calls as long as
the machine stays up; servers are started in their own session and outlive the call that
started them.

    python3 run.py receive PIECE_OR_DIR...     copy pieces (+ manifest.json) in, sha256 checked
    python3 run.py install                     reassemble, verify, unpack (a bundle made by an
                                               older prepare.py: pip install --target its wheels)
    python3 run.py scale [--name scaled]       the trained pair scaled to Qwen3-8B's shape
                                               (ckpt/scaled; docs/scaled-pair.md)
    python3 run.py serve ARM [--ckpt random --block 16] [--budget N] [--wait 540]
                                               (ddtree: any budget >= 1 on any block in the
                                               0.5.13 series, >= block - 1 in the v2 layout)
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
    python3 run.py validate --pieces DIR --out DIR
                                               all of the above for one release in as few
                                               calls as the pieces allow: receive, install,
                                               plain + DFLASH + one DDTREE server per budget
                                               at once, refusals meanwhile, generate, agree,
                                               bench per budget and concurrency; stops before
                                               --until seconds and resumes where it stopped
                                               when called again; results in OUT/results.tgz

ARM is plain, dflash or ddtree. Every server gets the same flags except the algorithm;
``serve --tp N`` adds ``--tp-size N`` (give every arm of a comparison the same N). Every
server's environment has NVLink multicast off (``MULTICAST_OFF``), whatever the caller's says.
``DDTREE_H200_PORT_BASE`` moves a second set of servers to other ports (e.g. the small pair
on 31000 next to the scaled pair on 30000); their pid files carry the port base.
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
_PID_SUFFIX = "" if _BASE == 30000 else f"-{_BASE}"
MIB = 1 << 20
REFUSAL_PORT = _BASE + 9  # refusals exit during argument handling; never bound
ALGORITHMS = {"plain": None, "dflash": "DFLASH", "ddtree": "DDTREE"}
# Forced into every server's environment: NVLink multicast stays off on the GPU machines this
# bundle targets, whatever the caller's environment says.
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


def contents(state: Path) -> dict:
    """What the installed bundle holds (``contents.json``, written by prepare.py). A bundle
    made before the file existed was always patched SGLang 0.5.13."""
    path = state / "bundle" / "contents.json"
    return json.loads(path.read_text()) if path.is_file() else {"sglang": "0.5.13", "patched": True}


def version_tuple(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in version.split(".")[:3] if part.isdigit())


def graph_max_bs_flag(version: str) -> str:
    """0.5.14 (the v2 layout) renamed ``--cuda-graph-max-bs`` to ``--cuda-graph-max-bs-decode``
    (the old name is a deprecated alias there)."""
    v2 = version_tuple(version) >= (0, 5, 14)
    return "--cuda-graph-max-bs-decode" if v2 else "--cuda-graph-max-bs"


def pool_wait(version: str) -> float | None:
    """Seconds ``start_servers`` waits for each server's KV pool before starting the next:
    from 0.5.14 a server's KV pool is what is free when it profiles, less a slack taken from
    what was free before its weights loaded, so a neighbour allocating its pool in between
    leaves it nothing ("Loaded weights leave no GPU memory for the KV cache"). 0.5.13 sizes
    its pool otherwise: its servers start at once."""
    return 300.0 if version_tuple(version) >= (0, 5, 14) else None


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


# --- bundle ------------------------------------------------------------------------------


def cmd_receive(args) -> int:
    code, status = receive(state_dir(args), args.sources)
    if code == 0:
        print(json.dumps(status))
    return code


def receive(state: Path, paths: list[str]) -> tuple[int, dict]:
    """Copy the pieces (files, or every file in a folder) in, each checked against the
    manifest; returns (exit code, what has arrived)."""
    pieces = state / "pieces"
    pieces.mkdir(exist_ok=True)
    sources: list[Path] = []
    for src in map(Path, paths):
        sources += sorted(src.iterdir()) if src.is_dir() else [src]
    manifest_src = [s for s in sources if s.name == "manifest.json"]
    if manifest_src:
        shutil.copy(manifest_src[0], pieces / "manifest.json")
    if not (pieces / "manifest.json").is_file():
        print("manifest.json must come with the first piece", file=sys.stderr)
        return 2, {}
    expected = {p["name"]: p for p in json.loads((pieces / "manifest.json").read_text())["pieces"]}
    for src in sources:
        if src.name == "manifest.json":
            continue
        if src.name not in expected:
            print(f"{src.name}: not in manifest.json", file=sys.stderr)
            return 2, {}
        if sha256(src) != expected[src.name]["sha256"]:
            print(f"{src.name}: sha256 mismatch", file=sys.stderr)
            return 2, {}
        shutil.copy(src, pieces / src.name)
    have = sorted(p for p in expected if (pieces / p).is_file())
    return 0, {"received": len(have), "of": len(expected),
               "missing": sorted(set(expected) - set(have))}  # fmt: skip


def cmd_install(args) -> int:
    code, text = install(state_dir(args))
    print(text)
    return code


def install(state: Path) -> tuple[int, str]:
    """Unpack the received bundle (once) and check that sglang, sgl_kernel and torch import;
    returns (exit code, what the check printed)."""
    bundle = state / "bundle"
    if not (bundle / ".complete").is_file():
        code = unpack(state, bundle)
        if code:
            return code, "unpack failed"
    wheels = sorted((bundle / "wheels").glob("*.whl"))
    if wheels:  # a bundle from before prepare.py installed the site itself
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
                        "--no-compile", "--no-cache-dir", "--target", str(state / "site"),
                        *map(str, wheels)], check=True)  # fmt: skip
    out = subprocess.run([sys.executable, "-c", "import sglang, sgl_kernel, torch; print("
                          "sglang.__file__, sglang.__version__, torch.__version__, "
                          "torch.cuda.is_available())"],
                         env=server_env(state), capture_output=True, text=True)  # fmt: skip
    return out.returncode, out.stdout.strip() or out.stderr[-2000:]


def unpack(state: Path, bundle: Path) -> int:
    pieces = state / "pieces"
    manifest = json.loads((pieces / "manifest.json").read_text())
    missing = [p["name"] for p in manifest["pieces"] if not (pieces / p["name"]).is_file()]
    if missing:
        print(f"missing pieces: {', '.join(missing)}", file=sys.stderr)
        return 2
    tar_path = state / "bundle.tar"
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
    with tarfile.open(tar_path) as tar:  # gzip (older bundles) or xz, told by its header
        tar.extractall(bundle, filter="data")
    tar_path.unlink()
    shutil.rmtree(pieces)  # the disk holds the unpacked copy only
    (bundle / ".complete").write_text(manifest["tar_sha256"] + "\n")
    return 0


def server_env(state: Path) -> dict[str, str]:
    # The patched snapshot first, so it shadows a stock sglang installed with older bundles'
    # wheels; then the site prepare.py installed (or, for those bundles, run.py did).
    path = [str(state / "bundle" / "snapshot"), str(state / "bundle" / "site"), str(state / "site")]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(path + [env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.setdefault("PYTHONUNBUFFERED", "1")
    env.update(MULTICAST_OFF)
    return env


def build_scaled(state: Path, name: str, scale: str, client: str | None) -> dict:
    """Build ``ckpt/<name>`` from the bundle's client (or ``client``): the shipped trained pair
    embedded in Qwen3-8B's shape (16 GB target, 2 GB drafter; built on this GPU, never
    transferred). Raises RuntimeError with the exporter's error."""
    out = state / "bundle" / "ckpt" / name
    cmd = [sys.executable, "-m", "ddtree_cli.engine.export", "--scale", scale, str(out)]
    start = time.monotonic()
    proc = subprocess.run(cmd, env=client_env(state, client), capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"export --scale {scale} failed: {proc.stderr[-3000:]}")
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    return {"ckpt": name, "seconds": round(time.monotonic() - start, 1),
            "files": len(summary["sha256"])}  # fmt: skip


def cmd_scale(args) -> int:
    try:
        print(json.dumps(build_scaled(state_dir(args), args.name, args.scale, args.client)))
    except RuntimeError as exc:
        print(str(exc), file=sys.stderr)
        return 1
    return 0


# --- servers -----------------------------------------------------------------------------


NCCL_PORT_OFFSET = 10000  # each server's torch.distributed port: its HTTP port + this


def server_cmd(state: Path, arm: str, ckpt: str, block: int | None, budget: int | None,
               port: int, mem_fraction: float, max_bs: int, extra: list[str],
               version: str | None = None) -> list[str]:  # fmt: skip
    """``version``: the SGLang release the flags are for (default: the installed bundle's)."""
    folder = state / "bundle" / "ckpt" / ckpt
    draft = folder / ("draft" if block is None else f"draft-b{block}")
    version = version or contents(state)["sglang"]
    cmd = [sys.executable, "-m", "sglang.launch_server",
           "--model-path", str(folder / "target"), "--skip-tokenizer-init",
           "--attention-backend", "triton", "--sampling-backend", "pytorch",
           "--page-size", "1", "--disable-overlap-schedule",
           "--mem-fraction-static", str(mem_fraction), graph_max_bs_flag(version), str(max_bs),
           "--max-running-requests", str(max(max_bs, 8)), "--enable-metrics",
           # SGLang draws a fresh seed at every start; one seed for all arms, so that
           # `ddtree bench`'s confound guard sees servers equal but for the algorithm.
           "--random-seed", "0",
           "--host", "127.0.0.1", "--port", str(port),
           # SGLang's default is a port free when it looks, bound later: servers started
           # together raced for one (an H100 run lost its auto server to EADDRINUSE).
           "--nccl-port", str(port + NCCL_PORT_OFFSET)]  # fmt: skip
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


_CMD_MARK = "$ "  # a server log's first line: this, then the command line it was started with


def start_server(state: Path, name: str, cmd: list[str],
                 log_name: str | None = None) -> tuple[subprocess.Popen, Path]:  # fmt: skip
    """Start ``cmd`` in its own session (it outlives this call), logging to
    ``logs/<log_name or name>.log``; its pid goes to ``<name>.pid`` for ``stop``."""
    logs = state / "logs"
    logs.mkdir(exist_ok=True)
    log = logs / f"{log_name or name}.log"
    with log.open("w") as f:
        f.write(_CMD_MARK + " ".join(cmd) + "\n")
        f.flush()
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=server_env(state),
                                start_new_session=True)  # fmt: skip
    (state / f"{name}.pid").write_text(str(proc.pid))
    return proc, log


def healthy(port: int) -> bool:
    try:
        status, _ = http(f"http://127.0.0.1:{port}/health", timeout=5)
    except (urllib.error.URLError, OSError):
        return False
    return status == 200


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a child of this process that exited but was not waited for
        return os.waitpid(pid, os.WNOHANG) == (0, 0)
    except ChildProcessError:
        return True


POOL_ALLOCATED = "Memory pool end"  # logged once the server's KV pool is allocated


def wait_for_pool(proc: subprocess.Popen, log: Path, port: int, timeout: float) -> None:
    """Until the server has allocated its KV pool, is healthy, exited, or ``timeout`` passed."""
    end = time.monotonic() + max(timeout, 0.0)
    while time.monotonic() < end and proc.poll() is None:
        if POOL_ALLOCATED in log.read_text(errors="replace") or healthy(port):
            return
        time.sleep(1)


def cmd_serve(args) -> int:
    state = state_dir(args)
    port = PORTS[args.arm]
    cmd = server_cmd(state, args.arm, args.ckpt, args.block, args.budget, port,
                     args.mem_fraction, args.max_bs, args.extra + tp_flags(args.tp))  # fmt: skip
    tag = tp_tag(log_tag(args.ckpt, args.block, args.budget if args.arm == "ddtree" else None),
                 args.tp)  # fmt: skip
    proc, log = start_server(state, f"{args.arm}{_PID_SUFFIX}", cmd, f"{args.arm}-{tag}")
    start = time.monotonic()
    while time.monotonic() - start < args.wait:
        if proc.poll() is not None:
            print(log.read_text()[-6000:])
            print(f"{args.arm}: server exited with {proc.returncode}", file=sys.stderr)
            return 1
        if healthy(port):
            print(json.dumps({"arm": args.arm, "ckpt": tag, "healthy_after_s":
                              round(time.monotonic() - start, 1), "log": str(log)}))  # fmt: skip
            return 0
        time.sleep(2)
    print(log.read_text()[-6000:])
    print(f"{args.arm}: not healthy after {args.wait} s (left running)", file=sys.stderr)
    return 1


def stop_server(state: Path, name: str) -> None:
    stop_session(state / f"{name}.pid")


def cmd_stop(args) -> int:
    state = state_dir(args)
    names = [p.stem for p in sorted(state.glob("*.pid"))] if args.arm == "all" else [args.arm]
    for name in names:
        stop_server(state, name)
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


def url_healthy(url: str) -> bool:
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
            if url_healthy(url):
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
    return load_rows(state_dir(args), args.prompt_file, args.prompts, args.prompt_len,
                     args.vocab, seed)  # fmt: skip


def load_rows(state: Path, prompt_file: str | None, count: int, length: int, vocab: int,
              seed: int) -> list[list[int]]:  # fmt: skip
    if not prompt_file:
        return prompts(count, length, vocab, seed=seed)
    path = Path(prompt_file)
    if not path.is_file():
        path = state / "bundle" / "prompts" / f"{prompt_file}.jsonl"
    rows = [json.loads(line)["input_ids"] for line in path.read_text().splitlines() if line]
    if len(rows) < count:
        raise SystemExit(f"{path}: {len(rows)} prompts, {count} asked for")
    return rows[:count]


def generate_check(port: int, batch: int, max_new: int, vocab: int, spec: bool) -> dict:
    """One /generate of ``batch`` random prompts; ``ok``: every answer has all its tokens and,
    for a speculative server, ``spec_verify_ct > 0``."""
    ids = prompts(batch, 24, vocab)
    out = generate(port, ids if batch > 1 else ids[0], max_new)
    rows = out if isinstance(out, list) else [out]
    summary = [{"output_ids": r.get("output_ids"), "meta_info": r.get("meta_info")} for r in rows]
    ok = all(len(r["output_ids"] or []) == max_new for r in summary) and (
        not spec or all((r["meta_info"] or {}).get("spec_verify_ct", 0) > 0 for r in summary)
    )
    return {"batch": batch, "ok": ok, "results": summary}


def cmd_generate(args) -> int:
    spec = ALGORITHMS[args.arm] is not None
    out = generate_check(PORTS[args.arm], args.batch, args.max_new, args.vocab, spec)
    print(json.dumps({"arm": args.arm, "batch": args.batch, "results": out["results"]}))
    return 0 if out["ok"] else 1


def draft_block(state: Path, ckpt: str, block: int | None) -> int | None:
    """``block``, else none for a checkpoint with one ``draft`` (the trained pair), else 16
    (the random pair's ``draft-b16``)."""
    if block is not None or (state / "bundle" / "ckpt" / ckpt / "draft").is_dir():
        return block
    return 16


def refusals(state: Path, ckpt: str, block: int | None, timeout: float = 300) -> tuple[bool, dict]:
    """Launch the real server once per refused flag set, all at once (each exits during
    argument handling); each must exit non-zero with its message."""
    hybrid = state / "hybrid-target"
    hybrid.mkdir(exist_ok=True)
    (hybrid / "config.json").write_text(json.dumps(
        {"model_type": "qwen3_next", "architectures": ["Qwen3NextForCausalLM"]}))  # fmt: skip
    block = draft_block(state, ckpt, block)
    procs = {}
    for name, (flags, _) in REFUSALS.items():
        cmd = server_cmd(state, "ddtree", ckpt, block, None, REFUSAL_PORT, 0.1, 4, flags)
        if name == "hybrid":
            cmd[cmd.index("--model-path") + 1] = str(hybrid)
        procs[name] = subprocess.Popen(cmd, env=server_env(state), stdout=subprocess.PIPE,
                                       stderr=subprocess.STDOUT, text=True)  # fmt: skip
    results, ok = {}, True
    deadline = time.monotonic() + timeout
    for name, proc in procs.items():
        try:
            text, _ = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            text = proc.communicate()[0] + f"\n(killed after {timeout:.0f} s)"
        expect = REFUSALS[name][1]
        line = next((ln.strip() for ln in text.splitlines() if expect in ln), None)
        results[name] = {"returncode": proc.returncode, "message": line,
                         "tail": None if line else text[-1500:]}  # fmt: skip
        ok &= proc.returncode != 0 and line is not None
    return ok, results


def cmd_refusals(args) -> int:
    ok, results = refusals(state_dir(args), args.ckpt, args.block)
    print(json.dumps(results, indent=1))
    return 0 if ok else 1


def agreement(batch: list[list[int]], max_new: int, ports: dict[str, int],
              plain_port: int) -> dict:  # fmt: skip
    """Greedy outputs of each speculative server in ``ports`` (name -> port) against the
    plain server's; at each first divergence, the plain server's top-2 log-prob margin."""
    outputs = {name: [r["output_ids"] for r in generate(port, batch, max_new)]
               for name, port in {"plain": plain_port, **ports}.items()}  # fmt: skip
    report = {"prompts": len(batch), "max_new_tokens": max_new, "arms": {}}
    for name in ports:
        diverged = []
        for i, (ref, got) in enumerate(zip(outputs["plain"], outputs[name], strict=True)):
            at = next((j for j, (a, b) in enumerate(zip(ref, got, strict=False)) if a != b), None)
            if at is None:
                continue
            probe = generate(plain_port, batch[i] + ref[:at], 1, return_logprob=True,
                             top_logprobs_num=2)  # fmt: skip
            top = probe["meta_info"]["output_top_logprobs"][0]
            diverged.append({"prompt": i, "position": at, "plain": ref[at], "arm": got[at],
                             "top2_logprob_margin": top[0][0] - top[1][0]})  # fmt: skip
        report["arms"][name] = {"identical": len(batch) - len(diverged), "diverged": diverged}
    return report


def agreement_line(report: dict) -> dict:
    return {a: {"identical": r["identical"], "diverged": len(r["diverged"]),
                "max_margin": max((d["top2_logprob_margin"] for d in r["diverged"]),
                                  default=None)}
            for a, r in report["arms"].items()}  # fmt: skip


def cmd_agree(args) -> int:
    """Greedy outputs of each speculative arm against plain; margins where they diverge."""
    ports = {"dflash": PORTS["dflash"], "ddtree": args.ddtree_port or PORTS["ddtree"]}
    report = agreement(prompt_rows(args, seed=1), args.max_new, ports, PORTS["plain"])
    Path(args.output).write_text(json.dumps(report, indent=1))
    print(json.dumps(agreement_line(report)))
    return 0


def write_rows(path: Path, rows: list[list[int]]) -> Path:
    """``rows`` as the JSONL of ``{"input_ids": [...]}`` that ``ddtree bench --dataset`` and
    ``load_rows`` read."""
    path.write_text("".join(json.dumps({"input_ids": ids}) + "\n" for ids in rows))
    return path


def bench_cmd(state: Path, rows: list[list[int]], ddtree_port: int, max_new: int,
              concurrency: str, trials: int, output: str, extra: list[str]) -> list[str]:  # fmt: skip
    """``ddtree bench`` DDTREE (on ``ddtree_port``) against DFLASH, plain as the reference;
    the prompts are written to ``prompts.jsonl`` in ``state``."""
    dataset = write_rows(state / "prompts.jsonl", rows)
    return [sys.executable, "-m", "ddtree_cli", "bench", "--algo", "ddtree", "--baseline", "dflash",
            "--url", f"ddtree=http://127.0.0.1:{ddtree_port}",
            "--url", f"dflash=http://127.0.0.1:{PORTS['dflash']}",
            "--reference", f"http://127.0.0.1:{PORTS['plain']}",
            "--dataset", str(dataset), "--num-prompts", str(len(rows)),
            "--max-new-tokens", str(max_new), "--temperature", "0",
            "--concurrency", concurrency, "--trials", str(trials),
            "--json", "--output", output, *extra]  # fmt: skip


def client_env(state: Path, client: str | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = client or str(state / "bundle" / "client")
    return env


def cmd_bench(args) -> int:
    state = state_dir(args)
    cmd = bench_cmd(state, prompt_rows(args, seed=2), args.ddtree_port or PORTS["ddtree"],
                    args.max_new, args.concurrency, args.trials, args.output, args.extra)  # fmt: skip
    return subprocess.run(cmd, env=client_env(state, args.client)).returncode


# Python functions whose host time a trace summary lists (SGLang records stacks by
# default): the speculative workers' own, where DDTREE's round and DFLASH's differ.
PY_FUNCTION_SCOPE = "/speculative/"


def summarise_trace(path: Path, top: int = 25) -> dict:
    """Where the time of a torch-profiler Chrome trace went: per category (GPU kernels, CPU
    ops, CUDA runtime calls), the ``top`` names by total duration, with counts; and, when
    the trace has Python stacks, the host time of every function under
    ``PY_FUNCTION_SCOPE`` (``py_function``: inclusive, per name, most first)."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        events = json.load(f)
    events = events.get("traceEvents", events) if isinstance(events, dict) else events
    totals: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    counts: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for ev in events:
        cat = ev.get("cat")
        if cat == "python_function" and PY_FUNCTION_SCOPE in str(ev.get("name", "")):
            cat = "py_function"
        elif cat not in ("kernel", "cpu_op", "cuda_runtime", "gpu_memcpy"):
            continue
        if ev.get("ph") != "X":
            continue
        totals[cat][ev["name"]] += float(ev.get("dur", 0.0))
        counts[cat][ev["name"]] += 1
    out: dict = {"trace": path.name}
    # The GPU's share of the traced time: kernels' first start to last end, and the time
    # inside that span with no kernel running (host-bound gaps between launches).
    kernels = sorted((float(ev["ts"]), float(ev["ts"]) + float(ev.get("dur", 0.0)))
                     for ev in events if ev.get("ph") == "X" and ev.get("cat") == "kernel" and "ts" in ev)  # fmt: skip
    if kernels:
        idle, reach = 0.0, kernels[0][0]
        for start, end in kernels:
            idle += max(0.0, start - reach)
            reach = max(reach, end)
        out["gpu"] = {"span_us": round(reach - kernels[0][0], 1), "idle_us": round(idle, 1)}
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


def profile_server(port: int, name: str, out: Path, rows: list[list[int]], steps: int,
                   max_new: int, top: int = 25, wait: float = 120) -> list[dict]:  # fmt: skip
    """Profile ``steps`` forward steps of the server on ``port`` while it decodes ``rows``
    (all at once), then summarise the trace into ``out/summary-<name>.json``."""
    out = out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    before = set(out.glob("*.trace.json*"))
    status, body = http(f"http://127.0.0.1:{port}/start_profile",
                        {"output_dir": str(out), "num_steps": steps,
                         "activities": ["CPU", "GPU"], "profile_prefix": name})  # fmt: skip
    if status != 200:
        raise SystemExit(f"/start_profile on {name}: HTTP {status}: {str(body)[:300]}")
    # Enough decode rounds for the steps: every request runs to max_new (ignore_eos).
    generate(port, rows if len(rows) > 1 else rows[0], max_new)
    deadline = time.monotonic() + wait
    while not (new := set(out.glob("*.trace.json*")) - before):
        if time.monotonic() > deadline:
            raise SystemExit(f"no trace in {out} after {wait:.0f} s")
        time.sleep(1)
    time.sleep(2)  # the writer may still be flushing
    summary = [summarise_trace(t, top) for t in sorted(new)]
    (out / f"summary-{name}.json").write_text(json.dumps(summary, indent=1))
    return summary


def cmd_profile(args) -> int:
    """Profile ``--steps`` forward steps of a running server under load, then summarise."""
    summary = profile_server(PORTS[args.arm], args.arm, Path(args.output),
                             prompt_rows(args, seed=3), args.steps, args.max_new, args.top,
                             args.wait)  # fmt: skip
    print(json.dumps(summary)[:4000])
    return 0


def cmd_logs(args) -> int:
    dest = Path(args.dest)
    dest.mkdir(parents=True, exist_ok=True)
    for log in sorted((state_dir(args) / "logs").glob("*.log")):
        shutil.copy(log, dest / log.name)
    return 0


# --- validate: the whole run for one release, resumable across calls --------------------

# Seconds a step may take at most on an H200 (the 2026-11-30 / 12-01 runs, with margin): a
# step is not started with less time left in the call, so a call ends with its results
# written instead of being killed half-way.
ESTIMATE_S = {"install": 60, "refusals": 120, "generate": 40, "agree": 90, "bench-c1": 170,
              "bench-c8": 100}  # fmt: skip
LOG_KEYS = ("worker ready", "Capture", "capture", "cuda graph: True", "Overlap", "overlap",
            "Error", "error", "Traceback", "deprecated", "Deprecated")  # fmt: skip


class Validation:
    """One call of ``validate``: what is done (kept in ``results/progress.json`` across
    calls), the time left, and the results folder that goes back as ``results.tgz``."""

    def __init__(self, args, folder: str = "results", estimates: dict | None = None):
        self.args = args
        self.t0 = time.monotonic()
        self.state = state_dir(args)
        self.estimates = ESTIMATE_S if estimates is None else estimates
        self.results = self.state / folder
        self.results.mkdir(exist_ok=True)
        self.progress_file = self.results / "progress.json"
        self.progress = (json.loads(self.progress_file.read_text())
                         if self.progress_file.is_file() else {"done": {}, "calls": 0,
                                                               "started": {}})  # fmt: skip
        self.progress["calls"] += 1

    def left(self) -> float:
        return self.args.until - (time.monotonic() - self.t0)

    def done(self, step: str) -> bool:
        return step in self.progress["done"]

    def record(self, step: str, **facts) -> None:
        self.progress["done"][step] = {"at_s": round(time.monotonic() - self.t0, 1),
                                       "call": self.progress["calls"], **facts}  # fmt: skip
        self.save()
        print(json.dumps({"step": step, **self.progress["done"][step]})[:1500], flush=True)

    def save(self) -> None:
        self.progress_file.write_text(json.dumps(self.progress, indent=1))

    def fits(self, step: str, kind: str | None = None) -> bool:
        return self.left() >= self.estimates[kind or step]

    def write(self, path: str, data) -> None:
        (self.results / path).write_text(json.dumps(data, indent=1))

    def finish(self, status: str, code: int, todo: list[str] = ()) -> int:
        """Write ``OUT/status.json`` and ``OUT/results.tgz`` (results, logs, excerpts)."""
        self.progress["status"] = status
        self.progress["todo"] = list(todo)
        self.save()
        self.collect_logs()
        out = Path(self.args.out)
        out.mkdir(parents=True, exist_ok=True)
        summary = {"status": status, "call": self.progress["calls"],
                   "elapsed_s": round(time.monotonic() - self.t0, 1), "todo": list(todo),
                   "done": sorted(self.progress["done"])}  # fmt: skip
        (out / "status.json").write_text(json.dumps(summary, indent=1))
        pack_results(self.results, out / "results.tgz")
        print(json.dumps(summary))
        return code

    def collect_logs(self) -> None:
        logs = self.state / "logs"
        dest = self.results / "logs"
        dest.mkdir(exist_ok=True)
        excerpts = []
        for log in sorted(logs.glob("*.log")) if logs.is_dir() else []:
            data = log.read_bytes()
            if len(data) > 6 * MIB:  # the start (flags, graphs) and the end (last batches)
                data = data[: 3 * MIB] + b"\n[... cut ...]\n" + data[-3 * MIB :]
            (dest / log.name).write_bytes(data)
            lines = [ln for ln in data.decode(errors="replace").splitlines()
                     if any(k in ln for k in LOG_KEYS)]  # fmt: skip
            excerpts += [f"== {log.name}"] + lines[:40] + (["..."] if len(lines) > 40 else [])
        (self.results / "log-excerpts.txt").write_text("\n".join(excerpts) + "\n")


def pack_results(folder: Path, dest: Path, limit: int = 15 * MIB) -> None:
    """``folder`` as one gzipped tar under ``limit`` bytes (what comes back from the machine
    is at most 16 MiB a file): if it is larger, per-request records and then logs go first."""
    for skip in ((), ("requests.jsonl",), ("requests.jsonl", ".log")):

        def keep(info: tarfile.TarInfo, skip: tuple[str, ...] = skip) -> tarfile.TarInfo | None:
            return None if skip and info.name.endswith(skip) else info

        tmp = dest.with_suffix(".partial")
        with tarfile.open(tmp, "w:gz") as tar:
            tar.add(folder, folder.name, filter=keep)
        tmp.replace(dest)
        if dest.stat().st_size <= limit:
            return


# The modules a server imports on its way up, each tried on its own, so that one call names
# every package a bundle lacks (a server's log shows only the first).
SERVER_MODULES = ("sglang.srt.entrypoints.http_server", "sglang.srt.managers.scheduler",
                  "sglang.srt.managers.detokenizer_manager", "sglang.srt.model_executor.model_runner",
                  "sglang.srt.models.qwen3", "sglang.srt.models.dflash",
                  "sglang.srt.layers.attention.triton_backend",
                  "sglang.srt.speculative.dflash_worker_v2", "sglang.srt.speculative.dflash_worker",
                  "sglang.srt.speculative.ddtree_worker_v2", "sglang.srt.speculative.ddtree_worker")  # fmt: skip
IMPORT_CHECK = """
import importlib, importlib.util, json, sys
out = {}
try:  # the package first: if it fails, the children it imported stay half-registered
    import sglang
except Exception as exc:
    print(json.dumps({"sglang": f"{type(exc).__name__}: {exc}"[:300]}))
    sys.exit()
for name in sys.argv[1:]:
    try:
        if importlib.util.find_spec(name) is None:
            continue  # the other layout's module
        importlib.import_module(name)
        out[name] = "ok"
    except Exception as exc:
        out[name] = f"{type(exc).__name__}: {exc}"[:300]
print(json.dumps(out))
"""


def import_check(state: Path, modules: tuple[str, ...] = SERVER_MODULES,
                 timeout: float = 180) -> dict:  # fmt: skip
    """Import each of ``modules`` that the snapshot has, in one process; module -> "ok" or
    the error (only ``sglang`` when the package itself fails)."""
    try:
        proc = subprocess.run([sys.executable, "-c", IMPORT_CHECK, *modules],
                              env=server_env(state), capture_output=True, text=True,
                              timeout=timeout)  # fmt: skip
    except subprocess.TimeoutExpired:
        return {"error": f"no answer in {timeout:.0f} s"}
    try:
        return json.loads(proc.stdout.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        return {"error": proc.stderr[-1500:]}


def validation_servers(state: Path, args, c: dict) -> dict[str, tuple[int, list[str]]]:
    """name -> (port, command): plain, DFLASH and, for a patched bundle, one DDTREE server
    per budget (ports base + 2, base + 3, ...), all with the same flags but the algorithm."""
    ckpt = args.ckpt
    block = draft_block(state, ckpt, args.block)
    arms = [("plain", "plain", None), ("dflash", "dflash", None)]
    if c.get("patched", True):
        arms += [(f"ddtree-n{b}", "ddtree", b) for b in args.budgets]
    out = {}
    for i, (name, arm, budget) in enumerate(arms):
        port = PORTS["plain"] + i
        cmd = server_cmd(state, arm, ckpt, block, budget, port, args.mem_fraction, args.max_bs,
                         [], c["sglang"])  # fmt: skip
        out[name] = (port, cmd)
    return out


class ServerExited(RuntimeError):
    """A server started by this run is gone; the message names its log's end."""


class ServerMismatch(RuntimeError):
    """A server of that name runs with another command line (another map's or run's)."""


def running_command(state: Path, name: str) -> str | None:
    """The command line a server was started with by ``start_server`` (its log's first line)."""
    log = state / "logs" / f"{name}.log"
    if not log.is_file():
        return None
    with log.open() as f:
        first = f.readline().rstrip("\n")
    return first.removeprefix(_CMD_MARK) if first.startswith(_CMD_MARK) else None


def server_alive(state: Path, name: str) -> bool:
    """Whether the server ``name`` started (its pid file) is still running."""
    pidfile = state / f"{name}.pid"
    return pidfile.is_file() and alive(int(pidfile.read_text()))


def start_servers(v: Validation, servers: dict, pool_wait: float | None = None) -> None:
    """Start every server of ``servers`` (name -> (port, command)) not already running (its
    pid file names it), each after the one before has allocated its KV pool when
    ``pool_wait`` (at most that many seconds). A server started in an earlier call that is
    gone raises ServerExited; one running with another command line (started for another
    map or run) raises ServerMismatch, before anything is started."""
    running = [n for n in servers if server_alive(v.state, n)]
    for name in running:
        if running_command(v.state, name) != " ".join(servers[name][1]):
            raise ServerMismatch(
                f"{name} is already running with another command line (another map's or "
                f"run's server): stop it first (run.py stop {name}, or stop all)"
            )
    for name, (port, cmd) in servers.items():
        if name in running:
            continue
        if name in v.progress["started"]:
            raise ServerExited(exited(v.state, name))
        proc, log = start_server(v.state, name, cmd)
        v.progress["started"][name] = time.time()
        v.save()
        if pool_wait is not None:
            wait_for_pool(proc, log, port=port, timeout=min(pool_wait, v.left() - 60))


def servers_healthy(v: Validation, servers: dict, margin: float) -> bool:
    """Until every server answers /health (True) or fewer than ``margin`` seconds of the call
    are left (False); a server that exits raises ServerExited."""
    while not all(healthy(port) for port, _ in servers.values()):
        for name in servers:
            if not server_alive(v.state, name):
                raise ServerExited(exited(v.state, name))
        if v.left() < margin:
            return False
        time.sleep(2)
    return True


def start_ages(v: Validation, names) -> dict:
    """Seconds since each server was started by this run, or a note for one it found running."""
    started = v.progress["started"]
    return {n: round(time.time() - started[n], 1) if n in started else "running before"
            for n in names}  # fmt: skip


def cmd_validate(args) -> int:
    v = Validation(args)
    try:
        return validate(v)
    except Exception as exc:  # whatever broke, the results so far still go back
        import traceback

        traceback.print_exc()
        return v.finish(f"failed: {type(exc).__name__}: {str(exc)[:800]}", 1)


def receive_and_install(v: Validation) -> int | None:
    """The pieces this call carries, then the install once all have arrived: None when the
    bundle is installed, else the call's exit code (its status written)."""
    args, state = v.args, v.state
    if not (state / "bundle" / ".complete").is_file():
        if args.pieces:
            code, got = receive(state, args.pieces)
            if code:
                return v.finish("failed: a piece was refused (see the output)", code)
            if got["missing"]:
                return v.finish(f"waiting for pieces: {', '.join(got['missing'])}", 0,
                                ["receive"])  # fmt: skip
        if not v.fits("install"):
            return v.finish("incomplete: no time to install", 3, ["install"])
    if not v.done("install"):
        code, text = install(state)
        if code:
            return v.finish(f"failed: install: {text[-500:]}", 1)
        v.record("install", check=text, contents=contents(state))
    return None


def validate(v: Validation) -> int:
    args, state = v.args, v.state
    if (code := receive_and_install(v)) is not None:
        return code
    c = contents(state)
    args.ckpt = args.ckpt or ("trained" if "trained" in c.get("checkpoints", []) else "random")
    if args.prompt_file is None and args.ckpt == "trained" and "heldout" in c.get("prompts", []):
        args.prompt_file = "heldout"
    servers = validation_servers(state, args, c)
    v.write("servers.json", {n: {"port": p, "cmd": cmd} for n, (p, cmd) in servers.items()})
    try:
        # Each server once the one before has allocated its KV pool (graph capture and warmup
        # still overlap), whatever the release: pool_wait says why 0.5.14 and later need it.
        start_servers(v, servers, pool_wait=300.0)
    except ServerMismatch as exc:
        return v.finish(f"refused: {exc}", 2)
    except ServerExited as exc:
        return v.finish(str(exc), 1)
    # While the servers start: each refused launch exits during argument handling.
    if not v.done("imports"):
        checked = import_check(state)
        v.write("imports.json", checked)
        v.record("imports", failed=sorted(m for m, r in checked.items() if r != "ok"))
    if c.get("patched", True) and not v.done("refusals") and v.fits("refusals"):
        refusals_step(v)
    try:
        if not servers_healthy(v, servers, margin=30):
            return v.finish("incomplete: servers still starting (left running)", 3,
                            ["healthy", *plan_steps(args, c)])  # fmt: skip
    except ServerExited as exc:
        return v.finish(str(exc), 1)
    if not v.done("healthy"):
        v.record("healthy", after_s=start_ages(v, servers))
    spec = {n: port for n, (port, _) in servers.items() if n != "plain"}
    todo = [s for s in plan_steps(args, c) if not v.done(s)]
    if c.get("patched", True) and not v.done("refusals"):
        todo.insert(0, "refusals")
    for step in list(todo):
        kind = step if not step.startswith("bench") else f"bench-c{step.rsplit('-c', 1)[1]}"
        if not v.fits(step, kind):
            return v.finish(f"incomplete: {len(todo)} steps left; call again", 3, todo)
        try:
            if not run_step(v, step, servers, spec):
                return v.finish(f"incomplete: {step} cut at the call's end; call again", 3, todo)
        except (RuntimeError, OSError, ValueError, KeyError) as exc:  # a server's answer
            v.record(step, error=f"{type(exc).__name__}: {str(exc)[:800]}")
        todo.remove(step)
    failed = sorted(n for n, d in v.progress["done"].items() if "error" in d)
    return v.finish("done" if not failed else f"done, with errors in {', '.join(failed)}",
                    0 if not failed else 1)  # fmt: skip


def run_step(v: Validation, step: str, servers: dict, spec: dict[str, int]) -> bool:
    """Run one step and record it; False when it was cut short by the call's end."""
    args, state = v.args, v.state
    if step == "refusals":
        refusals_step(v)
    elif step == "generate":
        out = {n: [generate_check(port, b, 32, args.vocab, True) for b in (1, 4)]
               for n, port in spec.items()}  # fmt: skip
        v.write("generate.json", out)
        v.record(step, ok=all(r["ok"] for rs in out.values() for r in rs))
    elif step == "agree":
        rows = load_rows(state, args.prompt_file, args.agree_prompts, args.prompt_len,
                         args.vocab, seed=1)  # fmt: skip
        report = agreement(rows, args.max_new, spec, PORTS["plain"])
        v.write("agree.json", report)
        v.record(step, summary=agreement_line(report))
    else:
        budget, conc = step.removeprefix("bench-n").split("-c")
        code = run_bench_step(v, servers[f"ddtree-n{budget}"][0], conc, step)
        if code == 124:
            return False
        v.record(step, returncode=code)
    return True


def exited(state: Path, name: str) -> str:
    log = state / "logs" / f"{name}.log"
    tail = log.read_text(errors="replace")[-1200:] if log.is_file() else ""
    return f"failed: server {name} exited (results/logs/{name}.log ends: {tail})"


def refusals_step(v: Validation) -> None:
    ok, res = refusals(v.state, v.args.ckpt, v.args.block, timeout=ESTIMATE_S["refusals"])
    v.write("refusals.json", res)
    v.record("refusals", ok=ok)


def plan_steps(args, c: dict) -> list[str]:
    steps = ["generate", "agree"]
    if c.get("patched", True):
        steps += [f"bench-n{b}-c{n}" for b in args.budgets for n in args.concurrency]
    return steps


def run_bench_step(v: Validation, ddtree_port: int, concurrency: str, step: str) -> int:
    """One ``ddtree bench`` of DDTREE against DFLASH (``guarded_bench``)."""
    args, state = v.args, v.state
    rows = load_rows(state, args.prompt_file, args.bench_prompts, args.prompt_len, args.vocab,
                     seed=2)  # fmt: skip
    output = v.results / step
    cmd = bench_cmd(state, rows, ddtree_port, args.max_new, concurrency, args.trials,
                    str(output), args.extra)  # fmt: skip
    return guarded_bench(v, step, cmd, client_env(state), margin=20)


def guarded_bench(v: Validation, step: str, cmd: list[str], env: dict[str, str],
                  margin: float) -> int:  # fmt: skip
    """Run the ``ddtree bench`` command ``cmd`` (its ``--output`` is ``results/STEP``) without
    ``--allow-mismatch`` first, so the confound guard is tested on the real servers; if the
    guard refuses, the refusal is kept in ``STEP.guard.txt`` and the bench runs again with
    ``--allow-mismatch`` (the servers differ only in the algorithm and its widths, by
    construction). 124: cut ``margin`` seconds before the call's end."""
    output = v.results / step
    log, err = v.results / f"{step}.stdout.json", v.results / f"{step}.stderr.txt"

    def bench(extra: list[str]) -> int:
        shutil.rmtree(output, ignore_errors=True)  # a bench cut short in an earlier call
        with log.open("w") as f, err.open("w") as e:
            try:
                return subprocess.run(cmd + extra, env=env, stdout=f, stderr=e,
                                      timeout=max(10.0, v.left() - margin)).returncode  # fmt: skip
            except subprocess.TimeoutExpired:
                return 124

    code = bench([])
    refusal = err.read_text(errors="replace")
    # The arms against the baseline ("more than the algorithm"), or the timed reference
    # against the arms ("more than speculation": from 0.5.14 a plain server captures its
    # decode graphs at fewer batch sizes than a speculative one).
    guard = ("more than the algorithm", "more than speculation")
    if code in (0, 124) or not any(text in refusal for text in guard):
        return code
    (v.results / f"{step}.guard.txt").write_text(refusal)
    return bench(["--allow-mismatch"])


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--state", default=os.environ.get("DDTREE_H200_STATE", "/tmp/ddtree-h200"))
    p.add_argument("--vocab", type=int, default=260, help="prompt token ids are drawn below this")
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("receive")
    s.add_argument("sources", nargs="+")
    sub.add_parser("install")
    s = sub.add_parser("scale")
    s.add_argument("--name", default="scaled", help="ckpt/<name> in the bundle")
    s.add_argument("--scale", default="qwen3-8b")
    s.add_argument("--client", help="folder holding ddtree_cli (default: the bundle's)")
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
    s.add_argument("--block", type=int, help="default: the trained draft, or draft-b16")
    s = sub.add_parser("agree")
    s.add_argument("--prompts", type=int, default=100)
    s.add_argument("--prompt-len", type=int, default=32)
    s.add_argument("--max-new", type=int, default=64)
    s.add_argument("--output", default="agree.json")
    s.add_argument("--prompt-file", help="JSONL of input_ids, or a bundle prompt set name")
    s.add_argument("--ddtree-port", type=int, help="the DDTREE server's port (default: ddtree's)")
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
    s.add_argument("--ddtree-port", type=int, help="the DDTREE server's port (default: ddtree's)")
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
    s.add_argument("arm", help="plain, dflash, ddtree, a validate server (ddtree-n64) or all")
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
    s = sub.add_parser("validate", help="the whole run, resumable: call again until done")
    s.add_argument("--pieces", nargs="*", default=[], help="pieces (files or folders) to receive")
    s.add_argument("--out", default="validate-out",
                   help="where status.json and results.tgz go")  # fmt: skip
    s.add_argument("--until", type=float, default=540,
                   help="seconds this call may use; no step starts that would run past it")  # fmt: skip
    s.add_argument("--ckpt", help="default: trained if the bundle has it, else random")
    s.add_argument("--block", type=int, help="the random pair's draft block (default 16)")
    s.add_argument("--budgets", type=_ints, default=[15, 64], help="DDTREE budgets (15,64)")
    s.add_argument("--concurrency", type=lambda t: t.split(","), default=["1", "8"])
    s.add_argument("--trials", type=int, default=5)
    s.add_argument("--agree-prompts", type=int, default=100)
    s.add_argument("--bench-prompts", type=int, default=100)
    s.add_argument("--prompt-len", type=int, default=64, help="for random-id prompts")
    s.add_argument("--max-new", type=int, default=64)
    s.add_argument("--prompt-file", help="default: the bundle's heldout set for the trained pair")
    s.add_argument("--mem-fraction", type=float, default=0.18)
    s.add_argument("--max-bs", type=int, default=8)
    s.add_argument("extra", nargs="*", default=[],
                   help="ddtree bench flags, after -- (the confound guard runs; a refusal is "
                   "kept and the bench rerun with --allow-mismatch)")  # fmt: skip
    args = p.parse_args(argv)
    return globals()[f"cmd_{args.command.replace('-', '_')}"](args)


if __name__ == "__main__":
    sys.exit(main())
