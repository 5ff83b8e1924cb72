"""`ddtree doctor` on this machine through the real CLI: no GPU here, a CPU build of torch,
and real sglang wheels from the package index as snapshots."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import zipfile

import pytest

from tests.conftest import require

PY_TAG = f"cp{sys.version_info[0]}{sys.version_info[1]}"


def run_cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ddtree_cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def checks_of(result: subprocess.CompletedProcess[str]) -> dict[str, dict]:
    report = json.loads(result.stdout)
    return {c["id"]: c for c in report["checks"] if c["host"] in ("local", "snapshot")}


@pytest.fixture(scope="module")
def local_report():
    if shutil.which("nvidia-smi"):
        pytest.skip("this machine has an NVIDIA driver; these tests describe one without")
    result = run_cli("doctor", "--python", sys.executable, "--json")
    return result


def test_no_gpu_machine_fails_on_the_driver_and_the_cpu_torch(local_report):
    assert local_report.returncode == 5, local_report.stderr
    report = json.loads(local_report.stdout)
    assert report["ok"] is False
    checks = {c["id"]: c for c in report["checks"]}
    assert checks["gpu.driver"]["status"] == "fail"
    assert checks["gpu.driver"]["detail"] == "no NVIDIA driver (nvidia-smi not found)"
    assert checks["gpu.driver"]["fix"].startswith("install the NVIDIA driver")
    # The test venv has the CPU wheel of torch.
    assert checks["torch.cuda_build"]["status"] == "fail"
    assert "is a CPU-only build" in checks["torch.cuda_build"]["detail"]
    assert (
        f"{sys.executable} -m pip install --force-reinstall 'torch=="
        in (checks["torch.cuda_build"]["fix"])
    )
    assert "--index-url https://download.pytorch.org/whl/cu" in checks["torch.cuda_build"]["fix"]
    # What depends on a GPU says why it did not run, rather than failing again.
    for check in ("gpu.driver_cuda", "gpu.arch", "torch.cuda_available", "cuda.nvcc"):
        assert checks[check]["status"] == "skip", check
        assert checks[check]["detail"]
    assert checks["python.version"]["status"] == "pass"
    assert checks["torch.installed"]["status"] == "pass"
    fails = sorted(c["id"] for c in report["checks"] if c["status"] == "fail")
    assert fails == ["gpu.driver", "torch.cuda_build"]


def test_json_is_the_only_thing_on_stdout(local_report):
    json.loads(local_report.stdout)  # one object, nothing else
    assert local_report.stderr == ""


def test_table_output_and_exit_code():
    result = run_cli("doctor", "--python", sys.executable, "--no-probes")
    assert result.returncode == 5
    assert "gpu.driver" in result.stdout and "no NVIDIA driver" in result.stdout
    assert "problems found" in result.stdout


def test_missing_interpreter_fails_clearly(tmp_path):
    result = run_cli("doctor", "--python", str(tmp_path / "venv/bin/python"), "--json")
    assert result.returncode == 5
    version = checks_of(result)["python.version"]
    assert version["status"] == "fail"
    assert "not found" in version["detail"]
    assert "--python" in version["fix"]


def test_bad_snapshot_folder_is_a_one_line_error(tmp_path):
    result = run_cli("doctor", "--snapshot", str(tmp_path / "nope"), "--json")
    assert result.returncode == 3
    assert result.stdout == ""
    # (Rich wraps long lines at the terminal width; the message itself is one line.)
    assert "does not exist" in " ".join(result.stderr.split())
    assert "Traceback" not in result.stderr


def test_help():
    result = run_cli("doctor", "--help")
    assert result.returncode == 0
    for option in (
        "--host",
        "--inventory",
        "--snapshot",
        "--python",
        "--unit",
        "--port",
        "--url",
        "--json",
        "--accept-new-host-key",
        "--identity",
    ):
        assert option in result.stdout


@pytest.mark.sglang
@pytest.mark.slow
def test_real_sglang_wheel_snapshot_abi_version_and_patch_state(tmp_path):
    from ddtree_cli.errors import DdtreeError
    from ddtree_cli.patching.fetch import fetch

    try:
        snapshot = fetch("0.5.13", into=tmp_path / "snap")  # pip download, cached
    except DdtreeError as exc:
        require(False, f"cannot download sglang 0.5.13: {exc}")
    args = (
        "doctor",
        "--python",
        sys.executable,
        "--snapshot",
        str(snapshot),
        "--no-probes",
        "--json",
    )
    checks = checks_of(run_cli(*args))
    # The wheel pip picked for this interpreter ships _core.<this tag>.so.
    assert checks["python.abi"]["status"] == "pass"
    assert f"match {PY_TAG}" in checks["python.abi"]["detail"]
    assert checks["snapshot.patch"]["status"] == "fail"
    assert "is pristine" in checks["snapshot.patch"]["detail"]
    assert checks["snapshot.patch"]["fix"] == f"ddtree patch {snapshot}"
    assert checks["sglang.version"]["status"] == "fail"  # this venv has no sglang
    assert checks["sglang.version"]["fix"].endswith(
        "'sglang==0.5.13' (installs the kernels it pins)"
    )

    patched = run_cli("patch", str(snapshot))
    assert patched.returncode == 0, patched.stderr
    checks = checks_of(run_cli(*args))
    assert checks["snapshot.patch"]["status"] == "pass"
    assert "DDTREE applied" in checks["snapshot.patch"]["detail"]


@pytest.mark.sglang
@pytest.mark.slow
def test_doctor_and_deploy_read_one_snapshot_abi(tmp_path):
    """doctor reads the snapshot folder; deploy's preflight reads the sync manifest of what it
    ships. Both go through one reader and must agree on a real wheel."""
    from ddtree_cli.deploy.sync import scan
    from ddtree_cli.doctor.snapshot_abi import read_snapshot_abi
    from ddtree_cli.errors import DdtreeError
    from ddtree_cli.patching.fetch import fetch

    try:
        snapshot = fetch("0.5.13", into=tmp_path / "snap")  # pip download, cached
    except DdtreeError as exc:
        require(False, f"cannot download sglang 0.5.13: {exc}")
    from_folder = read_snapshot_abi(snapshot)
    from_manifest = read_snapshot_abi(snapshot, scan(snapshot))
    assert from_folder == from_manifest
    assert from_folder.version == "0.5.13"
    assert from_folder.requires_python and from_folder.requires_python.startswith(">=")
    assert any(tag.startswith(PY_TAG) for tag in from_folder.wheel_tags)
    assert any(path.startswith("sglang/srt/grpc/_core.") for path, _ in from_folder.compiled)
    assert from_folder.compiled and all(tag == PY_TAG for _, tag in from_folder.compiled)


@pytest.mark.sglang
@pytest.mark.slow
def test_wheel_for_another_python_fails_the_abi_check(tmp_path):
    other = "3.12" if sys.version_info[:2] != (3, 12) else "3.11"
    other_tag = "cp" + other.replace(".", "")
    from ddtree_cli.patching.fetch import wheel_cache_dir

    cache = wheel_cache_dir() / other_tag  # apart from the cache `patch` reads
    wheels = sorted(cache.glob("sglang-0.5.13-*.whl"))
    if not wheels:
        download = subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--no-deps",
                "--only-binary=:all:",
                "--python-version",
                other,
                "--implementation",
                "cp",
                "--platform",
                "manylinux_2_34_x86_64",
                "--disable-pip-version-check",
                "--quiet",
                "--dest",
                str(cache),
                "sglang==0.5.13",
            ],
            capture_output=True,
            text=True,
            timeout=600,
        )
        require(
            download.returncode == 0,
            f"cannot download the {other_tag} wheel: {download.stderr.strip()[-300:]}",
        )
        wheels = sorted(cache.glob("sglang-0.5.13-*.whl"))
    snapshot = tmp_path / "snap"
    with zipfile.ZipFile(wheels[-1]) as wheel:
        wheel.extractall(snapshot)
    result = run_cli(
        "doctor", "--python", sys.executable, "--snapshot", str(snapshot), "--no-probes", "--json"
    )
    abi = checks_of(result)["python.abi"]
    assert abi["status"] == "fail"
    assert f"built for {other_tag} but the host runs {PY_TAG}" in abi["detail"]
    assert "_core.cpython-" in abi["detail"]
    assert f"serve from a Python {other} venv" in abi["fix"]


@pytest.mark.http
def test_health_and_port_owner_of_a_real_server_on_loopback():
    # The embedded engine speaks SGLang's /health; doctor sees its port owner and asks it.
    import socket
    import time
    import urllib.request

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = subprocess.Popen(
        [sys.executable, "-m", "ddtree_cli", "serve", "--port", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                    break
            except OSError:
                assert server.poll() is None and time.monotonic() < deadline
                time.sleep(0.2)
        url = f"http://127.0.0.1:{port}/health"
        result = run_cli(
            "doctor",
            "--python",
            sys.executable,
            "--no-probes",
            "--port",
            str(port),
            "--url",
            url,
            "--json",
        )
        checks = checks_of(result)
        assert checks["service.health"]["status"] == "pass"
        assert checks["service.health"]["detail"] == f"GET {url} -> 200 (from this machine)"
        owner = checks[f"service.port.{port}"]
        assert owner["status"] == "warn"  # busy, and without --unit we cannot say it is ours
        assert f"pid {server.pid} (" in owner["detail"] and "serve" in owner["detail"]
    finally:
        server.terminate()
        server.wait(timeout=30)
    result = run_cli("doctor", "--python", sys.executable, "--no-probes", "--url", url, "--json")
    health = checks_of(result)["service.health"]
    assert health["status"] == "fail"
    assert "refused" in health["detail"].lower()


def test_draft_layers_of_real_exported_checkpoints(tmp_path):
    """Checkpoints written by the exporter, read by the facts collector through the CLI; the
    drafter of the failed H200 attempt (reading the target's last layer) is caught."""
    from ddtree_cli.engine.export import export_pair, random_export_pair

    export_pair(random_export_pair(block_size=16), tmp_path / "ckpt", dtype="float32")
    target, draft = tmp_path / "ckpt" / "target", tmp_path / "ckpt" / "draft"

    def verdict() -> dict:
        result = run_cli("doctor", "--python", sys.executable, "--no-probes", "--json",
                         "--model-path", str(target), "--draft-model-path", str(draft))  # fmt: skip
        return checks_of(result)["speculative.draft_layers"]

    good = verdict()
    assert good["status"] == "pass" and "layers [1, 2] of 4" in good["detail"]
    config = json.loads((draft / "config.json").read_text())
    config["dflash_config"]["target_layer_ids"] = [1, 3]
    (draft / "config.json").write_text(json.dumps(config))
    bad = verdict()
    assert bad["status"] == "fail" and "layer 3 is the target's last" in bad["detail"]
    (draft / "config.json").write_text("{ broken")
    assert verdict()["status"] == "skip"


def test_save_facts_writes_what_the_verdicts_were_made_from(tmp_path):
    from ddtree_cli.doctor.cuda_rules import check_cuda_packages

    saved = tmp_path / "facts.json"
    result = run_cli("doctor", "--python", sys.executable, "--no-probes", "--json",
                     "--save-facts", str(saved))  # fmt: skip
    facts = json.loads(saved.read_text())["local"]
    assert facts["python"]["executable"] == sys.executable
    assert "torch" in facts["requires"]  # torch's Requires-Dist, for cuda.packages
    verdict = check_cuda_packages(facts)
    check = checks_of(result)["cuda.packages"]
    assert (check["status"], check["detail"]) == (verdict.status.value, verdict.detail)
