"""`_handle_ddtree`'s refusals through SGLang 0.5.13's real launcher, on CPU.

``python -m sglang.launch_server`` from a freshly patched 0.5.13 snapshot, in the cached CPU
venv, with ``--device cpu`` (SGLang's CPU engine switch): argument handling runs exactly as
on a GPU host, and each refused configuration must exit non-zero with its message. An
accepted configuration gets past argument handling and then stops where this venv lacks
server dependencies; that is outside what is tested here.

Only 0.5.13's launcher is run here: 0.5.17's, tried the same way, stops before argument
handling, importing ``sgl_kernel`` (a compiled kernel package this venv lacks) for its CPU
KV-cache copy. The v2 releases' refusals are checked by calling ``_handle_ddtree`` in the
import tier, and on the real launcher on the GPU.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess

import pytest

from ddtree_cli.engine.export import export_pair, random_export_pair
from ddtree_cli.patching import engine, snapshot
from tests.patch.sglang_venv import venv_python

pytestmark = [pytest.mark.sglang_import, pytest.mark.slow]

CASES = {
    "page_size_4": (["--page-size", "4"], "DDTREE requires --page-size 1, got 4"),
    "fa3": (["--attention-backend", "fa3"],
            "DDTREE requires --attention-backend triton or flashinfer"),
    # Without --disable-radix-cache SGLang's own Qwen3-Next check refuses first.
    "hybrid": (["--disable-radix-cache"], "DDTREE refuses hybrid target models (model_type "
               "'qwen3_next')"),
    "budget_0": (["--speculative-ddtree-budget", "0"],
                 "--speculative-ddtree-budget must be between 1 and 1024"),
    "budget_autox": (["--speculative-ddtree-budget", "autox"],
                     "argument --speculative-ddtree-budget: --speculative-ddtree-budget must be "
                     "a number of tree nodes or 'auto', got 'autox'"),
    "max_budget_without_auto": (["--speculative-ddtree-max-budget", "64"],
                                "--speculative-ddtree-max-budget applies to "
                                "--speculative-ddtree-budget auto only, got budget unset"),
    "auto_max_below_block": (["--speculative-ddtree-budget", "auto",
                              "--speculative-ddtree-max-budget", "8"],
                             "max budget 8 is below the drafter's block - 1 (15)"),
}  # fmt: skip


@pytest.fixture(scope="module")
def launch(pristine_root, tmp_path_factory):
    python = venv_python("0.5.13")
    work = tmp_path_factory.mktemp("launcher")
    root = work / "snapshot"
    shutil.copytree(pristine_root("0.5.13"), root)
    engine.apply(snapshot.detect(root))
    ckpt = export_pair(random_export_pair(block_size=16), work / "ckpt").folder
    hybrid = work / "hybrid"
    hybrid.mkdir()
    (hybrid / "config.json").write_text(
        json.dumps({"model_type": "qwen3_next", "architectures": ["Qwen3NextForCausalLM"]})
    )
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("PYTHON")},
        "PYTHONPATH": str(root),
        "SGLANG_USE_CPU_ENGINE": "1",
        "CUDA_VISIBLE_DEVICES": "",
        "HF_HUB_OFFLINE": "1",
    }

    def run(extra: list[str], model=None) -> subprocess.CompletedProcess:
        cmd = [str(python), "-m", "sglang.launch_server",
               "--model-path", str(model or ckpt / "target"), "--skip-tokenizer-init",
               "--attention-backend", "triton", "--page-size", "1",
               "--disable-overlap-schedule", "--device", "cpu",
               "--speculative-algorithm", "DDTREE",
               "--speculative-draft-model-path", str(ckpt / "draft"),
               "--host", "127.0.0.1", "--port", "1", *extra]  # fmt: skip
        return subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=work, timeout=300)

    return run, hybrid


@pytest.mark.parametrize("case", sorted(CASES))
def test_refused_with_its_message(launch, case):
    run, hybrid = launch
    flags, message = CASES[case]
    proc = run(flags, model=hybrid if case == "hybrid" else None)
    assert proc.returncode != 0
    assert message in proc.stdout + proc.stderr, (proc.stdout + proc.stderr)[-3000:]


def test_the_override_lets_a_hybrid_target_through_with_a_warning(launch):
    run, hybrid = launch
    proc = run(["--disable-radix-cache", "--speculative-ddtree-allow-hybrid"], model=hybrid)
    out = proc.stdout + proc.stderr
    assert "DDTREE refuses" not in out
    assert "was allowed by --speculative-ddtree-allow-hybrid; outputs may be wrong" in out


def test_budget_64_on_a_block_16_draft_gets_past_argument_handling(launch):
    """The paper's setting: a block-16 drafter verified as a 64-node tree.

    Argument handling completes (the launcher reaches ``run_server``, which then stops on
    what this venv lacks); the widths it resolves are checked in the import tier.
    """
    run, _ = launch
    proc = run(["--speculative-ddtree-budget", "64"])
    out = proc.stdout + proc.stderr
    assert "ValueError" not in out, out[-3000:]
    assert "in run_server" in out, out[-3000:]


def test_budget_auto_gets_past_argument_handling(launch):
    """``--speculative-ddtree-budget auto``: accepted by the flag's type and resolved by
    ``_handle_ddtree`` (candidates 15, 32, 64 for the block-16 drafter, logged), then the
    launcher stops where this venv lacks server dependencies, as for a number."""
    run, _ = launch
    proc = run(["--speculative-ddtree-budget", "auto"])
    out = proc.stdout + proc.stderr
    assert "ValueError" not in out and "error: argument" not in out, out[-3000:]
    assert "in run_server" in out, out[-3000:]
