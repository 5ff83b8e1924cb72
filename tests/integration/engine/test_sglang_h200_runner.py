"""benchmarks/sglang_h200/run.py's `agree` and `bench` steps against real servers on loopback.

The servers are the embedded engine (`python -m ddtree_cli.engine`), which speaks the part of
SGLang's HTTP API these steps use (``/generate`` with ``input_ids``, ``/health``,
``/server_info``); SGLang itself needs a GPU. The engine is lossless in float32, so every
DFLASH and DDTREE output must equal the plain (autoregressive) server's.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

pytestmark = [pytest.mark.http, pytest.mark.slow]
REPO = Path(__file__).resolve().parents[3]
RUN = REPO / "benchmarks" / "sglang_h200" / "run.py"


def _free_base() -> int:
    """Three consecutive free ports (run.py uses base, base + 1, base + 2)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        socks = []
        try:
            for port in (base, base + 1, base + 2):
                sock = socket.socket()
                socks.append(sock)
                sock.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for sock in socks:
                sock.close()
    raise RuntimeError("no three consecutive free ports")


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    base = _free_base()
    procs = []
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    for i, algo in enumerate(("ar", "dflash", "ddtree")):
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "ddtree_cli.engine", "--algo", algo, "--port", str(base + i)],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env,
        ))  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        for i in range(3):
            while True:
                try:
                    with urllib.request.urlopen(f"http://127.0.0.1:{base + i}/health", timeout=2):
                        break
                except OSError:
                    assert time.monotonic() < deadline, "engine servers did not come up"
                    time.sleep(0.5)
        yield base
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(timeout=30)


def _run(base: int, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "DDTREE_H200_PORT_BASE": str(base)}
    return subprocess.run([sys.executable, str(RUN), "--state", str(cwd / "state"), *args],
                          capture_output=True, text=True, env=env, cwd=cwd, timeout=600)  # fmt: skip


def test_agree_finds_the_lossless_engine_identical(servers, tmp_path):
    proc = _run(servers, "agree", "--prompts", "6", "--prompt-len", "8", "--max-new", "12",
                "--output", str(tmp_path / "agree.json"), cwd=tmp_path)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((tmp_path / "agree.json").read_text())
    for arm in ("dflash", "ddtree"):
        assert report["arms"][arm] == {"identical": 6, "diverged": []}


def test_bench_step_runs_ddtree_bench_against_the_three_servers(servers, tmp_path):
    proc = _run(servers, "bench", "--prompts", "5", "--prompt-len", "8", "--max-new", "8",
                "--trials", "3", "--output", str(tmp_path / "bench"), "--client", str(REPO),
                cwd=tmp_path)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout)
    assert summary["lossless"]["mismatches"] == [] and summary["lossless"]["compared"] > 0
    assert "ci95" in summary["comparison"]["output_tok_s"]
