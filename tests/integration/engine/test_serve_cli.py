"""The ``ddtree serve`` command as users and systemd run it: a real process on loopback."""

from __future__ import annotations

import json
import signal
import subprocess
import sys

import pytest

from ddtree_cli.engine.weights import random_pair, save_pair
from tests.integration.engine.client import get, post
from tests.unit.engine.helpers import TINY_DRAFT, TINY_TARGET

pytestmark = pytest.mark.http


def launch(*args: str, module: str = "ddtree_cli") -> tuple[subprocess.Popen, dict]:
    cmd = [
        sys.executable,
        "-m",
        module,
        *([] if module != "ddtree_cli" else ["serve"]),
        "--port",
        "0",
        *args,
    ]
    if module == "ddtree_cli":
        cmd.append("--json")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines = []
    while True:  # one JSON object (possibly indented) once the engine is ready
        line = proc.stdout.readline()
        if not line:
            raise AssertionError(f"server exited: {proc.wait()} {proc.stderr.read()}")
        lines.append(line)
        try:
            return proc, json.loads("".join(lines))
        except json.JSONDecodeError:
            continue


def stop(proc: subprocess.Popen) -> int:
    proc.send_signal(signal.SIGTERM)
    return proc.wait(timeout=30)


@pytest.mark.parametrize("module", ["ddtree_cli", "ddtree_cli.engine"])
def test_serve_runs_until_sigterm_and_exits_zero(module):
    proc, ready = launch("--algo", "ddtree", "--budget", "8", "--block-size", "8", module=module)
    try:
        assert ready["algo"] == "ddtree" and ready["budget"] == 8 and ready["block_size"] == 8
        assert ready["random_init"] is False  # the default: the embedded trained pair
        assert get(ready["url"], "/health")[0] == 200
        status, body = post(
            ready["url"],
            "/generate",
            {"text": "hi", "sampling_params": {"temperature": 0, "max_new_tokens": 6}},
        )
        assert status == 200 and body["meta_info"]["spec_verify_ct"] >= 1
    finally:
        code = stop(proc)
    assert code == 0
    assert proc.stdout.read() == ""  # --json: nothing after the one object


def test_serve_model_random_is_the_seeded_random_pair():
    proc, ready = launch("--algo", "dflash", "--model", "random", "--seed", "3",
                         "--threads", "2", "--disable-cuda-graph")  # fmt: skip
    try:
        assert ready["random_init"] is True and ready["model"] == "random-init (seed 3)"
        info = get(ready["url"], "/server_info")[1]
        assert info["served_model_name"] == "ddtree-embedded-random"
        assert info["cpu_threads"] == 2  # --threads reaches the server
        assert info["disable_cuda_graph"] is True
    finally:
        assert stop(proc) == 0


def test_serve_loads_a_model_folder(tmp_path):
    pair = random_pair(TINY_TARGET, TINY_DRAFT, seed=9)
    save_pair(pair, tmp_path / "model")
    proc, ready = launch("--algo", "dflash", "--model", str(tmp_path / "model"))
    try:
        assert ready["weights_sha256"] == pair.weights_sha256
        info = get(ready["url"], "/server_info")[1]
        assert info["model_path"] == str(tmp_path / "model")
        assert info["model"]["target_config"]["hidden_size"] == 64
    finally:
        assert stop(proc) == 0


@pytest.mark.parametrize(
    ("args", "message", "code"),
    [
        (["--algo", "beam"], "unknown --algo", 2),
        (["--algo", "dflash", "--budget", "4"], "--budget applies to --algo ddtree only", 2),
        (["--algo", "ddtree", "--budget", "autox"], "--budget must be a positive integer", 2),
        (["--algo", "ddtree", "--budget", "0"], "--budget must be at least 1, got 0", 2),
        (
            ["--algo", "ddtree", "--budget", "auto", "--max-budget", "0"],
            "--max-budget must be at least 1",
            2,
        ),
        (["--algo", "ddtree", "--max-budget", "64"], "--max-budget applies to --budget auto", 2),
        (
            ["--algo", "ddtree", "--budget", "auto", "--max-budget", "4", "--block-size", "8"],
            "below --block-size - 1 (7)",
            2,
        ),
        (["--model", "/nonexistent/model"], "does not exist", 3),
        (["--block-size", "1"], "--block-size must be at least 2", 2),
    ],
)
def test_bad_options_fail_with_one_line(args, message, code):
    proc = subprocess.run(
        [sys.executable, "-m", "ddtree_cli", "serve", "--port", "0", *args],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == code
    assert message in proc.stderr
    assert "Traceback" not in proc.stderr
    assert proc.stdout == ""


def test_port_in_use_is_a_clear_error():
    proc, ready = launch("--algo", "ar")
    try:
        port = ready["url"].rsplit(":", 1)[1]
        other = subprocess.run(
            [sys.executable, "-m", "ddtree_cli", "serve", "--port", port],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert other.returncode != 0
        assert "cannot listen" in other.stderr
    finally:
        stop(proc)
