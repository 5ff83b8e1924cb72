"""For the tests of benchmarks/sglang_h200 and benchmarks/ (not packages): load a script as
a module, find free ports, and make a bundle whose stand-in ``sglang.launch_server`` becomes the embedded
engine (SGLang itself needs a GPU)."""

from __future__ import annotations

import importlib.util
import json
import socket
from pathlib import Path
from types import ModuleType

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
HERE = BENCHMARKS / "sglang_h200"


def load_script(name: str, folder: Path = HERE) -> ModuleType:
    """A fresh module of benchmarks/sglang_h200/NAME.py (e.g. "prepare", "run", "units"), or
    of FOLDER/NAME.py (``BENCHMARKS``: e.g. "crossover_report")."""
    spec = importlib.util.spec_from_file_location(f"{folder.name}_{name}", folder / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def without_own_ports(server: tuple[int, list[str]], run: ModuleType) -> list[str]:
    """A server's command, ``(port, cmd)`` as run.py and crossover.py keep it, without the
    ports that are its own: HTTP and torch.distributed (``run.NCCL_PORT_OFFSET`` above)."""
    port, cmd = server
    own = {str(port), str(port + run.NCCL_PORT_OFFSET)}
    return [x for x in cmd if x not in own]


def free_base(count: int = 3) -> int:
    """``count`` consecutive free ports (run.py uses base, base + 1, base + 2, ...)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        socks = []
        try:
            for port in range(base, base + count):
                sock = socket.socket()
                socks.append(sock)
                sock.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for sock in socks:
                sock.close()
    raise RuntimeError(f"no {count} consecutive free ports")


# The stand-in for SGLang's launcher (see the module docstring).
LAUNCH_SERVER = """
import argparse, json, os, sys
from pathlib import Path
p = argparse.ArgumentParser()
for flag in ("--port", "--model-path", "--speculative-algorithm", "--speculative-ddtree-budget",
             "--page-size", "--attention-backend", "--cuda-graph-max-bs-decode",
             "--cuda-graph-max-bs"):
    p.add_argument(flag)
a, _ = p.parse_known_args()
algo = (a.speculative_algorithm or "ar").lower()
if algo == "ddtree":
    config = json.loads((Path(a.model_path) / "config.json").read_text())
    if a.page_size != "1":
        sys.exit("ValueError: DDTREE requires --page-size 1")
    if a.attention_backend != "triton":
        sys.exit("ValueError: DDTREE requires --attention-backend triton or flashinfer")
    if config.get("model_type") == "qwen3_next":
        sys.exit("ValueError: DDTREE refuses hybrid target models")
if algo == "ddtree" and os.environ.get("SGLANG_DDTREE_ROUND_GRAPHS") == "1" and os.environ.get(
        "STANDIN_ROUND_GRAPHS_FAIL"):  # a test's way to make a graph server fail its start
    sys.exit("RuntimeError: stand-in: the round graphs' capture failed")
import sglang
graph = a.cuda_graph_max_bs if sglang.__version__ == "0.5.13" else a.cuda_graph_max_bs_decode
assert graph, "run.py passes the release's own graph flag"
cmd = [sys.executable, "-m", "ddtree_cli.engine", "--algo", algo, "--port", a.port]
if a.speculative_ddtree_budget:
    cmd += ["--budget", a.speculative_ddtree_budget]
os.execv(sys.executable, cmd)
"""


def standin_bundle(tmp_path: Path, version: str = "0.5.17") -> Path:
    """Pieces of a bundle for "SGLang VERSION", patched, with a trained pair, made by
    prepare.py's build_tar and split; the checkpoint is a real export (the stand-in serves
    the engine's own weights, the target config is what the refusals read)."""
    from ddtree_cli.engine.export import export_pair, random_export_pair

    prepare = load_script("prepare")
    site, snap = tmp_path / "site", tmp_path / "snap"
    (site / "sgl_kernel").mkdir(parents=True)
    (site / "sgl_kernel" / "__init__.py").write_text("")
    (snap / "sglang").mkdir(parents=True)
    (snap / "sglang" / "__init__.py").write_text(f'__version__ = "{version}"\n')
    (snap / "sglang" / "launch_server.py").write_text(LAUNCH_SERVER)
    (snap / f"sglang-{version}.dist-info").mkdir()
    (snap / f"sglang-{version}.dist-info" / "METADATA").write_text(
        f"Name: sglang\nVersion: {version}\n"
    )
    ckpt = tmp_path / "ckpt" / "trained"
    export_pair(random_export_pair(block_size=16), ckpt, dtype="float32")
    contents = {"sglang": version, "patched": True, "checkpoints": ["trained"], "prompts": []}
    tar = tmp_path / "bundle.tar.xz"
    prepare.build_tar(tar, site, snap, [ckpt], contents)
    pieces = tmp_path / "pieces"
    pieces.mkdir()
    manifest = prepare.split(tar, pieces, 1)
    (pieces / "manifest.json").write_text(json.dumps(manifest))
    assert len(manifest["pieces"]) >= 2
    return pieces
