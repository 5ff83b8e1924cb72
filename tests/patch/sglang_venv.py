"""A CPU virtual environment with SGLang's Python dependencies, one per SGLang version.

Built from nothing by the import-tier fixture and cached under
``DDTREE_VENV_CACHE`` (default ``~/.cache/ddtree/venvs``) in a folder named after a hash
of its requirement list, so a changed list builds a new one. torch 2.14.1 with
torchvision 0.29.1 is what lets SGLang's model-config chain import (research notes:
``configs/nano_nemotron_vl`` imports torchvision at module level).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

_COMMON = [
    "numpy", "psutil", "msgspec", "orjson",
    "pybase64", "requests", "packaging", "pillow", "starlette", "typing_extensions",
    "pydantic", "pyzmq", "IPython", "dill", "sentencepiece", "gguf", "partial_json_parser",
    "einops", "setproctitle", "aiohttp", "uvicorn", "fastapi", "triton",
]  # fmt: skip

# torch with the torchvision built for it (the model-config chain imports torchvision).
_TORCH = {
    "2.11.0": ["torch==2.11.0", "torchvision==0.26.0"],
    "2.13.0": ["torch==2.13.0", "torchvision==0.28.0"],
    "2.14.1": ["torch==2.14.1", "torchvision==0.29.1"],
}

# Pins that follow each release's own requirements (its wheel METADATA). 0.5.13 keeps
# torch 2.14.1: its venv was built that way first and other tests (exported checkpoints,
# launcher refusals) share it; 0.5.17 and 0.5.21 run on their own torch pins.
REQUIREMENTS: dict[str, list[str]] = {
    "0.5.13": [
        *_TORCH["2.14.1"], *_COMMON, "transformers==5.8.1", "apache-tvm-ffi==0.1.9",
        "compressed-tensors", "openai==2.6.1",
    ],
    "0.5.17": [
        *_TORCH["2.11.0"], *_COMMON, "transformers==5.12.1", "apache-tvm-ffi==0.1.11",
        "compressed-tensors", "openai==2.6.1", "xgrammar==0.2.1",
    ],
    "0.5.21": [
        *_TORCH["2.13.0"], *_COMMON, "transformers==5.12.1", "apache-tvm-ffi==0.1.11",
        "compressed-tensors==0.18.0", "openai==2.6.1", "xgrammar==0.2.7",
    ],
    "0.5.23": [
        *_TORCH["2.14.1"], *_COMMON, "transformers==5.19.0", "apache-tvm-ffi==0.1.11",
        "compressed-tensors==0.18.0", "openai==2.8.0",
    ],
}  # fmt: skip


# Releases without a venv of their own share the one of a release with their torch pin
# (their wheel METADATA: 0.5.13.post1-0.5.17 torch 2.11.0, 0.5.18-0.5.21 torch 2.13.0,
# 0.5.22-0.5.23 torch 2.14.1).
SHARES_VENV = {
    "0.5.13.post1": "0.5.13", "0.5.14": "0.5.17", "0.5.15": "0.5.17",
    "0.5.15.post1": "0.5.17", "0.5.16": "0.5.17", "0.5.18": "0.5.21", "0.5.19": "0.5.21",
    "0.5.20": "0.5.21", "0.5.22": "0.5.23",
}  # fmt: skip


def venv_release(version: str) -> str:
    """The release whose requirement list builds the venv ``version`` is imported in."""
    return SHARES_VENV.get(version, version)


def venv_cache_dir() -> Path:
    env = os.environ.get("DDTREE_VENV_CACHE")
    if env:
        return Path(env).expanduser()
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "ddtree" / "venvs"


def venv_dir(version: str) -> Path:
    key = hashlib.sha256("\n".join(REQUIREMENTS[version]).encode()).hexdigest()[:12]
    return venv_cache_dir() / f"sglang-{version}-cpu-{key}"


def _index_only_env() -> dict[str, str]:
    """pip's environment with local wheel folders and pip config files left out: torch and
    torchvision must both come from the package index (a CPU-only torch from a local
    folder next to the index's torchvision fails at import: torchvision::nms missing)."""
    env = {k: v for k, v in os.environ.items() if k != "PIP_FIND_LINKS"}
    env["PIP_CONFIG_FILE"] = os.devnull
    return env


def ensure_venv(version: str) -> Path:
    """The venv's python, building the venv first if it is not cached."""
    return build_venv(venv_dir(version), REQUIREMENTS[version], f"the SGLang {version} venv")


def build_venv(target: Path, requirements: list[str], what: str) -> Path:
    """``target``'s python: a venv with ``requirements`` installed from the package index
    (local wheel files may be among them), built under a lock unless already complete."""
    python = target / "bin" / "python"
    if (target / ".complete").is_file():
        return python
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f"{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another test process may be building it
        if (target / ".complete").is_file():
            return python
        building = target.parent / f"{target.name}.building"
        shutil.rmtree(building, ignore_errors=True)
        subprocess.run([sys.executable, "-m", "venv", str(building)], check=True)
        try:
            subprocess.run(
                [str(building / "bin" / "python"), "-m", "pip", "install", "--quiet",
                 "--disable-pip-version-check", *requirements],
                check=True, capture_output=True, text=True, env=_index_only_env(),
            )  # fmt: skip
        except subprocess.CalledProcessError as exc:
            shutil.rmtree(building, ignore_errors=True)
            tail = "\n".join((exc.stderr or "").strip().splitlines()[-5:])
            raise RuntimeError(f"building {what} failed:\n{tail}") from None
        (building / ".complete").write_text("\n".join(requirements) + "\n")
        with contextlib.suppress(FileNotFoundError):
            shutil.rmtree(target)
        # A venv's python finds its site-packages relative to pyvenv.cfg, so a rename works.
        os.replace(building, target)
    return python


def venv_python(version: str) -> Path:
    """The cached CPU venv's python for ``version``; if it cannot be built, the calling test
    is skipped with the reason (a failure in CI, see ``tests.conftest.require``)."""
    from tests.conftest import require

    try:
        return ensure_venv(version)
    except (OSError, RuntimeError, subprocess.CalledProcessError) as exc:
        require(False, f"cannot build the SGLang {version} CPU venv: {exc}")
        raise  # require() raises; this keeps type checkers and readers sure of it
