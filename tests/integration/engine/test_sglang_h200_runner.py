"""benchmarks/sglang_h200/run.py's `agree`, `bench` and `validate` steps against real servers
on loopback.

The servers are the embedded engine (`python -m ddtree_cli.engine`), which speaks the part of
SGLang's HTTP API these steps use (``/generate`` with ``input_ids``, ``/health``,
``/server_info``); SGLang itself needs a GPU. The engine is lossless in float32, so every
DFLASH and DDTREE output must equal the plain (autoregressive) server's.

For `validate`, a bundle made by prepare.py's own ``build_tar`` + ``split`` carries a stand-in
``sglang.launch_server`` (SGLang cannot serve here): it reads the flags run.py passes and
becomes the embedded engine with the matching algorithm and budget, and it exits 1 with
``_handle_ddtree``'s message prefixes for the three refused flag sets (the patch's real
refusals are tested against SGLang's own launcher in tests/patch/test_launcher_refusals.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
import time
import urllib.request
from pathlib import Path

import pytest

from tests.sglang_h200 import free_base, standin_bundle

pytestmark = [pytest.mark.http, pytest.mark.slow]
REPO = Path(__file__).resolve().parents[3]
RUN = REPO / "benchmarks" / "sglang_h200" / "run.py"


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    base = free_base()
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


def _run(base: int, *args: str, cwd: Path, **env_extra: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "DDTREE_H200_PORT_BASE": str(base), **env_extra}
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


def test_validate_runs_the_whole_sequence_over_calls(tmp_path):
    pieces = standin_bundle(tmp_path)
    names = sorted(p.name for p in pieces.iterdir() if p.name != "manifest.json")
    base = free_base(10)
    out = tmp_path / "out"
    flags = ["--out", str(out), "--budgets", "15,64", "--concurrency", "1", "--trials", "3",
             "--agree-prompts", "4", "--bench-prompts", "5", "--prompt-len", "8",
             "--max-new", "8"]  # fmt: skip
    env = {"PYTHONPATH": str(REPO)}  # the stand-in's engine imports ddtree_cli
    try:
        # One piece per call, the manifest with each: all but the last only arrive.
        for name in names[:-1]:
            one = tmp_path / f"carry-{name}"
            one.mkdir()
            for f in ("manifest.json", name):
                (one / f).write_bytes((pieces / f).read_bytes())
            proc = _run(base, "validate", "--pieces", str(one), *flags, cwd=tmp_path, **env)
            assert proc.returncode == 0, proc.stderr[-3000:]
            assert json.loads((out / "status.json").read_text())["status"].startswith(
                "waiting for pieces"
            )
        last = tmp_path / "carry-last"
        last.mkdir()
        (last / names[-1]).write_bytes((pieces / names[-1]).read_bytes())
        # No time for the install in this call: nothing starts, the call says what is left.
        proc = _run(base, "validate", "--pieces", str(last), "--until", "1", *flags,
                    cwd=tmp_path, **env)  # fmt: skip
        assert proc.returncode == 3, proc.stdout + proc.stderr[-3000:]
        status = json.loads((out / "status.json").read_text())
        assert status["todo"] == ["install"] and not (tmp_path / "state" / "plain.pid").exists()
        # The same command again, with time: it resumes and finishes.
        proc = _run(base, "validate", "--pieces", str(last), *flags, cwd=tmp_path, **env)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        status = json.loads((out / "status.json").read_text())
        assert status["status"] == "done", status
        expected = {"install", "imports", "refusals", "healthy", "generate", "agree",
                    "bench-n15-c1", "bench-n64-c1"}  # fmt: skip
        assert set(status["done"]) == expected
        results = tmp_path / "results"
        with tarfile.open(out / "results.tgz") as tar:
            tar.extractall(results, filter="data")
        results = results / "results"
        refused = json.loads((results / "refusals.json").read_text())
        assert {k: (r["returncode"], bool(r["message"])) for k, r in refused.items()} == {
            "page_size_4": (1, True), "fa3": (1, True), "hybrid": (1, True)}  # fmt: skip
        servers = json.loads((results / "servers.json").read_text())
        assert sorted(servers) == ["ddtree-n15", "ddtree-n64", "dflash", "plain"]
        assert [s["port"] for s in servers.values()] == [base, base + 1, base + 2, base + 3]
        agree = json.loads((results / "agree.json").read_text())
        assert agree["arms"] == {arm: {"identical": 4, "diverged": []}
                                 for arm in ("dflash", "ddtree-n15", "ddtree-n64")}  # fmt: skip
        generated = json.loads((results / "generate.json").read_text())
        assert all(r["ok"] for rows in generated.values() for r in rows)
        for budget in (15, 64):
            summary = json.loads((results / f"bench-n{budget}-c1" / "summary.json").read_text())
            assert summary["lossless"]["mismatches"] == []
            assert summary["lossless"]["compared"] > 0
        assert (results / "logs" / "ddtree-n64.log").is_file()
        # Called once more, it redoes nothing.
        proc = _run(base, "validate", *flags, cwd=tmp_path, **env)
        assert proc.returncode == 0 and json.loads(proc.stdout.splitlines()[-1])["done"] == sorted(
            expected
        )
    finally:
        _run(base, "stop", "all", cwd=tmp_path)
