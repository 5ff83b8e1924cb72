"""The wheel, installed with no extras into a fresh venv, runs patch, deploy, doctor and the
bench client, carries its data files, and refuses the engine commands in one line.

Real components: the wheel is built from this checkout with ``python -m build``, installed
with its dependencies from the package index (network) into a venv made by ``python -m
venv``, and every command runs from a temporary folder with no source checkout on
``sys.path``. The venv is built once per module (one test run) and shared by its tests.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import require

REPO = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]


def _run(argv: list, *, cwd: Path, env: dict | None = None, timeout: float = 900):
    return subprocess.run(
        [str(a) for a in argv], cwd=cwd, env=env, capture_output=True, text=True,
        timeout=timeout, check=False,
    )  # fmt: skip


class PlainVenv:
    def __init__(self, root: Path):
        self.root = root
        self.bin = root / "venv" / "bin"
        self.cwd = root / "cwd"
        self.cwd.mkdir()
        self.env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
        self.env["PATH"] = f"{self.bin}{os.pathsep}{self.env.get('PATH', '')}"
        self.env["DDTREE_WHEEL_CACHE"] = str(root / "wheel-cache")  # a real download

    def python(self, *args, **kw):
        return _run([self.bin / "python", *args], cwd=self.cwd, env=self.env, **kw)

    def ddtree(self, *args, **kw):
        return _run([self.bin / "ddtree", *args], cwd=self.cwd, env=self.env, **kw)


@pytest.fixture(scope="module")
def plain(tmp_path_factory) -> PlainVenv:
    require(importlib.util.find_spec("build") is not None,
            "the 'build' package (in the test extras) builds the wheel")  # fmt: skip
    root = tmp_path_factory.mktemp("plain-install")
    dist = root / "dist"
    built = _run([sys.executable, "-m", "build", "--outdir", dist, REPO], cwd=root)
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
    wheels = sorted(dist.glob("ddtree_cli-*.whl"))
    assert len(wheels) == 1, wheels
    made = _run([sys.executable, "-m", "venv", root / "venv"], cwd=root)
    assert made.returncode == 0, made.stderr
    venv = PlainVenv(root)
    installed = venv.python("-m", "pip", "install", "--disable-pip-version-check", "-q", wheels[0])
    require(installed.returncode == 0,
            f"pip install of the wheel and its dependencies: {installed.stderr.strip()[-300:]}")  # fmt: skip
    return venv


def test_plain_install_has_no_torch_and_no_matplotlib(plain):
    for module in ("torch", "matplotlib", "safetensors"):
        proc = plain.python("-c", f"import {module}")
        assert proc.returncode != 0
        assert f"No module named '{module}'" in proc.stderr


def test_runs_from_the_installed_wheel_with_its_data(plain):
    probe = (
        "import json, ddtree_cli; from pathlib import Path; p = Path(ddtree_cli.__file__).parent; "
        "print(json.dumps({'pkg': str(p), 'files': sorted(str(f.relative_to(p)) for f in "
        "p.rglob('*') if f.is_file() and f.suffix in ('.json', '.patch', '.jsonl', '.safetensors'))}))"
    )
    proc = plain.python("-c", probe)
    assert proc.returncode == 0, proc.stderr
    seen = json.loads(proc.stdout)
    assert Path(seen["pkg"]).is_relative_to(plain.root / "venv")
    source = REPO / "ddtree_cli"
    want = {
        str(f.relative_to(source))
        for pattern in ("patching/series/*/*", "engine/embedded/**/*", "bench/data/*")
        for f in source.glob(pattern)
        if f.is_file() and "__pycache__" not in f.parts
    }
    assert want, "the checkout has no data files to compare with"
    assert want <= set(seen["files"])


def test_every_command_has_help(plain):
    from ddtree_cli.cli import app

    commands = [c.name for c in app.registered_commands]
    assert {"patch", "deploy", "bench", "doctor", "serve"} <= set(commands)
    for argv in ([], *([name] for name in commands)):
        proc = plain.ddtree(*argv, "--help")
        assert proc.returncode == 0, (argv, proc.stderr)
        assert "Usage" in proc.stdout


def test_serve_the_embedded_bench_and_training_name_the_engine_extra_in_one_line(plain):
    for argv in (["serve"], ["bench", "--output", plain.root / "bench-embedded"]):
        proc = plain.ddtree(*argv)
        assert proc.returncode == 3, (argv, proc.stdout, proc.stderr)
        lines = [line for line in proc.stderr.splitlines() if line.strip()]
        assert len(lines) == 1, lines
        assert "pip install 'ddtree-cli[engine]'" in lines[0]
        assert "pipx inject ddtree-cli torch safetensors" in lines[0]
    assert not (plain.root / "bench-embedded").exists()
    training = plain.python("-m", "ddtree_cli.training", "corpus", "--out", plain.root / "c.npz")
    assert training.returncode == 3, training.stderr
    assert training.stderr.strip().splitlines() == [
        "Error: python -m ddtree_cli.training needs the engine extra (torch, safetensors not "
        "installed): pip install 'ddtree-cli[engine]' (pipx: pipx inject ddtree-cli torch "
        "safetensors)"
    ]


def test_patch_fetches_checks_and_applies_without_a_checkout(plain):
    into = plain.root / "sglang-0.5.23"
    fetched = plain.ddtree("patch", "--fetch", "0.5.23", "--into", into)
    require(fetched.returncode == 0 or "cannot download" not in fetched.stderr,
            f"the package index (sglang 0.5.23 wheel): {fetched.stderr.strip()}")  # fmt: skip
    assert fetched.returncode == 0, fetched.stderr
    assert (into / "sglang" / "srt").is_dir()
    check = plain.ddtree("patch", into, "--check", "--json")
    assert check.returncode == 5, check.stderr
    assert json.loads(check.stdout)["state"] == "pristine"
    applied = plain.ddtree("patch", into, "--json")
    assert applied.returncode == 0, applied.stderr
    check = plain.ddtree("patch", into, "--check", "--json")
    assert check.returncode == 0, check.stderr
    assert json.loads(check.stdout)["state"] == "applied"


def test_doctor_json_on_this_machine(plain):
    proc = plain.ddtree("doctor", "--json", timeout=300)
    assert proc.returncode in (0, 5), proc.stderr
    report = json.loads(proc.stdout)
    assert report["ok"] is (proc.returncode == 0)
    assert report["checks"] and {"host", "id", "status", "detail", "fix"} <= set(
        report["checks"][0]
    )


def test_bench_client_without_matplotlib_writes_json_and_markdown(plain):
    # The emitter streams SGLang 0.5.23's /generate wire format without a model: a stand-in
    # for a real server (which cannot run here); the bench client is the thing under test.
    emitter = subprocess.Popen(
        [plain.bin / "python", "-m", "ddtree_cli.bench.emitter", "--port", "0"],
        cwd=plain.cwd, env=plain.env, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        port = int(emitter.stdout.readline())
        out = plain.root / "bench-url"
        proc = plain.ddtree(
            "bench", "--algo", "ddtree", "--baseline", "none", "--url",
            f"http://127.0.0.1:{port}", "--trials", "1", "--output", out, "--json",
            timeout=300,
        )  # fmt: skip
    finally:
        emitter.terminate()
        emitter.wait(30)
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout)
    assert (out / "summary.json").is_file() and (out / "report.md").is_file()
    assert not list(out.glob("*.png"))
    assert summary["files"]["plots"] == []
    skipped = [w for w in summary["warnings"] if "matplotlib is not installed" in w]
    assert len(skipped) == 1
    assert "throughput.png" in skipped[0] and "ddtree-cli[plots]" in skipped[0]
    assert skipped[0] in (out / "report.md").read_text()
