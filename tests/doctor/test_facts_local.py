"""The facts collector, run for real on this machine: in-process and as a piped script."""

from __future__ import annotations

import ast
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

from ddtree_cli.remote import facts as host_facts

SCRIPT = Path(host_facts.__file__)
SECTIONS = {
    "schema",
    "hostname",
    "python",
    "packages",
    "requires",
    "torch",
    "nvidia_smi",
    "nvcc",
    "env",
    "disk",
    "systemd",
    "ports",
    "processes",
    "probes",
    "health",
}


def test_script_is_valid_python_3_8_and_stdlib_only():
    tree = ast.parse(SCRIPT.read_text(), feature_version=(3, 8))
    top_level = set()
    for node in tree.body:
        if isinstance(node, ast.Import):
            top_level.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            top_level.add(node.module.split(".")[0])
    assert top_level <= set(sys.stdlib_module_names) | {"__future__"}


def test_piped_to_python3_stdin_prints_one_json_object(tmp_path):
    # Exactly how collect_remote runs it over SSH: source on stdin, options after "-".
    result = subprocess.run(
        [
            sys.executable,
            "-",
            "--python",
            sys.executable,
            "--port",
            "1",
            "--no-probes",
            "--disk",
            str(tmp_path / "not" / "yet"),
        ],
        input=SCRIPT.read_text(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    facts = json.loads(result.stdout)
    assert set(facts) >= SECTIONS
    assert facts["python"]["executable"] == sys.executable
    assert facts["python"]["abi_tag"] == f"cp{sys.version_info[0]}{sys.version_info[1]}"
    assert facts["torch"]["installed"] is True
    assert facts["torch"]["version"].startswith("2.")
    assert facts["disk"][0]["path"] == str(tmp_path / "not" / "yet")  # nearest existing parent


def test_collect_local_sees_a_listener_and_its_owner():
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        facts = host_facts.collect_local(python=sys.executable, ports=[port], probes=False)
    (entry,) = facts["ports"]
    assert entry["listening"] is True
    assert os.getpid() in entry["pids"]


def test_missing_interpreter_is_reported_not_raised(tmp_path):
    facts = host_facts.collect_local(python=str(tmp_path / "no-python"), probes=False)
    assert facts["python"]["found"] is False
    assert "not found" in facts["python"]["error"]
    assert facts["torch"]["installed"] is None


def test_probe_of_a_module_that_fails_to_import_captures_the_error(tmp_path, monkeypatch):
    (tmp_path / "brokenmod.py").write_text("raise ImportError('x.so: undefined symbol: _Zfoo')\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    probes = host_facts.probe_facts(sys.executable, 60, modules=("brokenmod", "no_such_mod"))
    assert probes["brokenmod"]["status"] == "error"
    assert probes["brokenmod"]["error_kind"] == "undefined_symbol"
    assert "undefined symbol: _Zfoo" in probes["brokenmod"]["error"]
    assert probes["no_such_mod"]["status"] == "missing"


def test_unit_environment_keeps_only_whitelisted_names():
    value = 'HF_TOKEN=hf_secret CUDA_VISIBLE_DEVICES=GPU-1 "FLASHINFER_DISABLE_VERSION_CHECK=1"'
    assert host_facts._parse_environment_property(value) == {
        "CUDA_VISIBLE_DEVICES": "GPU-1",
        "FLASHINFER_DISABLE_VERSION_CHECK": "1",
    }


def test_gpu_query_rows_are_parsed():
    # Not a capture: a row in nvidia-smi's documented `--format=csv,noheader,nounits` layout,
    # filled with the values recorded on an H200 machine (UUID made up, marked as such).
    fields = "index,name,uuid,driver_version,compute_cap,memory.used,memory.total,persistence_mode"
    text = "0, NVIDIA H200, GPU-00000000-made-up-uuid, 580.159.04, 9.0, 0, 143771, Enabled\n"
    (gpu,) = host_facts.parse_gpu_rows(text, fields)
    assert gpu == {
        "index": 0,
        "name": "NVIDIA H200",
        "uuid": "GPU-00000000-made-up-uuid",
        "compute_cap": "9.0",
        "memory_used_mib": 0,
        "memory_total_mib": 143771,
        "driver_version": "580.159.04",
        "persistence_mode": "Enabled",
    }


def test_journal_redaction_masks_credentials_and_keeps_diagnostics():
    line = (
        "server_args=ServerArgs(model_path='/m', api_key='sk-1', skip_tokenizer_init=True, "
        "max_total_tokens=1000) --api-key s3 HF_TOKEN=hf_abcdefghijkl token_usage=0.5"
    )
    assert host_facts.redact(line) == (
        "server_args=ServerArgs(model_path='/m', api_key='***', skip_tokenizer_init=True, "
        "max_total_tokens=1000) --api-key *** HF_TOKEN=*** token_usage=0.5"
    )


def test_an_import_probe_keeps_the_line_that_names_the_undefined_symbol(tmp_path, monkeypatch):
    # A real import in a real interpreter, failing with sgl_kernel's loader message (from
    # captures.json: it lists every attempt and ends with "No module named 'common_ops'").
    raw = json.loads((Path(__file__).parent / "fixtures" / "captures.json").read_text())
    text = raw["sgl_kernel_common_ops_undefined_symbol"]["text"].removeprefix("ImportError: ")
    (tmp_path / "kernel_under_test.py").write_text(f"raise ImportError({text!r})\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    probe = host_facts.probe_one(sys.executable, 60, "kernel_under_test")
    assert probe["status"] == "error" and probe["error_kind"] == "undefined_symbol"
    assert "undefined symbol: _ZNK3c106SymInt6sym_neERKS0_" in probe["error"].splitlines()[0]
    assert probe["error"].splitlines()[-1] == "- ModuleNotFoundError: No module named 'common_ops'"


def test_the_installed_version_is_the_one_that_imports_first(tmp_path, monkeypatch):
    # Two copies of one distribution on the path, as when a `pip install --target DIR` on
    # PYTHONPATH shadows site-packages: the first one is what `import` loads.
    for folder, version in (("first", "0.4.6.post1"), ("second", "0.4.3")):
        info = tmp_path / folder / f"sglang_kernel-{version}.dist-info"
        info.mkdir(parents=True)
        (info / "METADATA").write_text(
            f"Metadata-Version: 2.1\nName: sglang-kernel\nVersion: {version}\n"
        )
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path / 'first'}{os.pathsep}{tmp_path / 'second'}")
    facts = host_facts.interpreter_facts(sys.executable, 60)
    assert facts["packages"]["sglang-kernel"] == "0.4.6.post1"
    assert facts["requires"]["sglang-kernel"] == []
