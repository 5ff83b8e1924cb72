"""The compatibility rules, run on fact sets from real machines and strings users reported.

Where a test changes a captured fact set, the change is itself a captured value from the
source named in the test (e.g. the RTX 5090 arch list from torch's own warning).
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

from ddtree_cli.doctor.compatibility import ABI_CHECKS, SNAPSHOT_CHECKS, run_abi_checks
from ddtree_cli.doctor.cuda_rules import (
    check_cuda_packages,
    check_driver_vs_torch,
    check_gpu_arch,
    check_nvcc,
    check_torch_cuda_build,
    check_torch_installed,
)
from ddtree_cli.doctor.kernel_rules import (
    check_flashinfer_version_check_env,
    check_flashinfer_versions,
    check_jit_cache,
    check_probe,
    check_sglang_pins,
)
from ddtree_cli.doctor.parsing import local_cuda_major
from ddtree_cli.doctor.snapshot_abi import SnapshotABI
from ddtree_cli.doctor.snapshot_rules import (
    check_python_abi,
    check_python_version,
    check_sglang_vs_snapshot,
)
from ddtree_cli.doctor.verdict import Status
from ddtree_cli.remote import facts as host_facts


def by_id(verdicts):
    return {v.id: v for v in verdicts}


def test_h200_serving_sglang_0_5_13_passes_the_gpu_and_kernel_rules(h200):
    verdicts = by_id(run_abi_checks(h200))
    for check in (
        "torch.installed",
        "torch.cuda_build",
        "gpu.driver",
        "gpu.driver_cuda",
        "torch.cuda_available",
        "cuda.nvcc",
        "cuda.packages",
        "kernels.sgl_kernel",
        "kernels.flashinfer",
        "flashinfer.versions",
        "flashinfer.version_check",
        "python.version",
    ):
        assert verdicts[check].status is Status.PASS, (check, verdicts[check])
    # 580.159.04 >= 580.65.06, the CUDA 13 minimum (no CUDA line was recorded there).
    assert "580.159.04" in verdicts["gpu.driver_cuda"].detail
    # Its arch list was not recorded: the rule says so instead of guessing.
    assert verdicts["gpu.arch"].status is Status.SKIP
    assert "arch list" in verdicts["gpu.arch"].detail


def test_h200_without_flashinfer_cubin_is_told_to_install_the_pinned_one(h200):
    # That machine had sglang's wheels installed with --no-deps: no flashinfer-cubin.
    verdict = check_sglang_pins(h200)
    assert verdict.status is Status.WARN
    assert "'flashinfer-cubin==0.6.12'" in verdict.fix


def test_sglang_pins_fail_when_torch_drifted_from_the_pin(h200):
    h200["packages"]["torch"] = "2.14.1+cu130"  # what a torchvision upgrade pulled in
    verdict = check_sglang_pins(h200)
    assert verdict.status is Status.FAIL
    assert "torch 2.14.1+cu130 (pinned 2.11.0)" in verdict.detail
    assert "'torch==2.11.0'" in verdict.fix


def test_rtx5080_undefined_symbol_names_the_kernel_and_the_torch(rtx5080):
    verdict = check_probe(rtx5080, "sgl_kernel")
    assert verdict.status is Status.FAIL
    assert "sgl-kernel 0.1.2.post1 was built for another torch than 2.9.0.dev20250722+cu128" in (
        verdict.detail
    )
    assert "_ZN3c104cuda9SetDeviceEa" in verdict.detail
    assert "reinstall sgl-kernel built for torch 2.9.0.dev20250722+cu128" in verdict.fix


def test_undefined_symbol_fix_names_the_pair_sglang_pins(h200, captures):
    text = captures["sgl_kernel_undefined_symbol_torch_jit"]
    h200["probes"]["sgl_kernel"] = {
        "status": "error",
        "error": text,
        "error_kind": host_facts.classify_import_error(text),
    }
    verdict = check_probe(h200, "sgl_kernel")
    assert verdict.status is Status.FAIL
    assert "_ZN5torch3jit17parseSchemaOrNameERKSsb" in verdict.detail
    # torch already matches sglang's pin: only the kernel is reinstalled, without deps.
    assert "--force-reinstall --no-deps 'sglang-kernel==0.4.3'" in verdict.fix
    assert "torch==" not in verdict.fix


def test_a_kernel_built_for_another_torch_is_fixed_with_the_kernel_sglang_pins(h200, captures):
    # sgl-project/sglang issue 36462's state: sglang-kernel 0.4.6.post1 next to torch 2.11
    # (sglang 0.5.13 pins 0.4.3); the loader's message is the one sglang-kernel prints.
    text = captures["sgl_kernel_common_ops_undefined_symbol"]
    h200["packages"]["sglang-kernel"] = "0.4.6.post1"
    lines = [ln for ln in text.splitlines() if "undefined symbol" in ln] + text.splitlines()[-1:]
    h200["probes"]["sgl_kernel"] = {
        "status": "error",
        "error": "\n".join(lines),
        "error_kind": host_facts.classify_import_error(text),
    }
    verdict = check_probe(h200, "sgl_kernel")
    assert verdict.status is Status.FAIL
    assert "sglang-kernel 0.4.6.post1 was built for another torch than 2.11.0+cu130" in (
        verdict.detail
    )
    assert "_ZNK3c106SymInt6sym_neERKS0_" in verdict.detail
    assert verdict.fix.endswith(
        "-m pip install --force-reinstall --no-deps 'sglang-kernel==0.4.3'  (what sglang 0.5.13 pins)"
    )
    pins = check_sglang_pins(h200)
    assert pins.status is Status.FAIL and "'sglang-kernel==0.4.3'" in pins.fix


def test_rtx5080_gpu_side_is_fine(rtx5080):
    verdicts = by_id(run_abi_checks(rtx5080))
    assert verdicts["gpu.driver_cuda"].status is Status.PASS  # 577.00 >= 525.60.13 for cu128
    assert verdicts["cuda.nvcc"].status is Status.PASS  # nvcc 12.8 builds sm_120
    assert verdicts["cuda.packages"].status is Status.PASS


def test_sm120_gpu_with_an_sm90_torch_fails_with_a_cu128_fix(h200, captures):
    text = captures["torch_warning_sm120"]
    arch = re.search(r"supports CUDA capabilities (.*)\.", text).group(1).split()
    h200["torch"]["arch_list"] = arch
    h200["nvidia_smi"]["gpus"][0].update(name="NVIDIA GeForce RTX 5090", compute_cap="12.0")
    verdict = check_gpu_arch(h200)
    assert verdict.status is Status.FAIL
    assert "NVIDIA GeForce RTX 5090 is sm_120" in verdict.detail
    assert "sm_120 (cu128 or newer)" in verdict.fix


def test_same_sm90_arch_list_passes_an_h200_and_sass_runs_on_a_later_minor(h200, captures):
    text = captures["torch_warning_sm120"]
    h200["torch"]["arch_list"] = re.search(r"capabilities (.*)\.", text).group(1).split()
    assert check_gpu_arch(h200).status is Status.PASS
    h200["nvidia_smi"]["gpus"][0]["compute_cap"] = "8.9"  # sm_86 SASS runs on sm_89
    assert check_gpu_arch(h200).status is Status.PASS


def test_ptx_only_arch_is_a_warning(h200):
    h200["torch"]["arch_list"] = ["sm_80", "compute_80"]
    assert check_gpu_arch(h200).status is Status.WARN


def test_cu130_torch_on_a_cuda_11_4_driver_fails(h200, captures):
    driver, cuda = host_facts.parse_smi_header(captures["smi_header_470"])
    assert (driver, cuda) == ("470.86", "11.4")
    h200["nvidia_smi"].update(driver_version=driver, cuda_version=cuda)
    h200["torch"].update(cuda_available=False, warnings=[captures["torch_warning_driver_12040"]])
    verdicts = by_id(run_abi_checks(h200))
    assert verdicts["gpu.driver_cuda"].status is Status.FAIL
    assert "driver 470.86 supports CUDA 11.4, torch 2.11.0+cu130 needs CUDA 13.0" in (
        verdicts["gpu.driver_cuda"].detail
    )
    assert "580.65" in verdicts["gpu.driver_cuda"].fix
    assert verdicts["torch.cuda_available"].status is Status.FAIL
    assert "too old (found version 12040)" in verdicts["torch.cuda_available"].detail


def test_driver_table_catches_an_old_driver_without_a_cuda_line(h200):
    h200["nvidia_smi"].update(driver_version="570.124.06", cuda_version=None)  # sglang#4812
    assert check_driver_vs_torch(h200).status is Status.FAIL


def test_minor_version_compatibility_is_a_warning(a40):
    a40["nvidia_smi"]["cuda_version"] = "12.0"
    verdict = check_driver_vs_torch(a40)  # torch 2.4.0+cu121
    assert verdict.status is Status.WARN


def test_no_driver_fails_once_and_the_gpu_rules_behind_it_skip(h200):
    h200["nvidia_smi"] = {
        "present": False,
        "driver_version": None,
        "cuda_version": None,
        "gpus": [],
        "compute_apps": [],
        "error": "nvidia-smi not found on PATH",
    }
    verdicts = by_id(run_abi_checks(h200))
    assert verdicts["gpu.driver"].status is Status.FAIL
    assert verdicts["gpu.driver"].detail == "no NVIDIA driver (nvidia-smi not found)"
    assert ">= 580.65 for CUDA 13" in verdicts["gpu.driver"].fix
    for check in ("gpu.driver_cuda", "torch.cuda_available", "gpu.arch"):
        assert verdicts[check].status is Status.SKIP
        assert "no NVIDIA driver" in verdicts[check].detail


def test_nvcc_of_another_major_than_torch_fails(a40, captures):
    a40["nvcc"]["release"] = host_facts.parse_nvcc_release(captures["nvcc_13_0"])
    verdict = check_nvcc(a40)  # torch cu121
    assert verdict.status is Status.FAIL
    assert "nvcc 13.0" in verdict.detail and "CUDA 12" in verdict.detail
    assert "rm -rf ~/.cache/flashinfer" in verdict.fix


def test_nvcc_too_old_for_sm120_fails(rtx5080, captures):
    rtx5080["nvcc"]["release"] = host_facts.parse_nvcc_release(captures["nvcc_12_4"])
    verdict = check_nvcc(rtx5080)
    assert verdict.status is Status.FAIL
    assert "sm_120" in verdict.detail and "12.8" in verdict.fix


def test_missing_nvcc_is_a_warning_not_a_failure(h200):
    h200["nvcc"] = {"present": False, "path": None, "release": None, "error": "nvcc not found"}
    assert check_nvcc(h200).status is Status.WARN


def _pins_from(text: str) -> dict[str, str]:
    return dict(line.split("==") for line in text.splitlines())


def test_cu12_libraries_next_to_a_cu130_torch_fail(h200, captures):
    h200["packages"].update(_pins_from(captures["pip_cu12_torch_2_7"]))
    verdict = check_cuda_packages(h200)
    assert verdict.status is Status.FAIL
    assert "torch 2.11.0+cu130 is built for CUDA 13" in verdict.detail
    assert "nvidia-cublas-cu12==12.8.3.14 (-cu12 suffix)" in verdict.detail
    assert "uninstall -y nvidia-cublas-cu12 nvidia-cuda-cupti-cu12" in verdict.fix
    assert "Requires-Dist was not read" in verdict.fix  # this fixture has no torch pins
    # Stock CUDA 13 stacks (real torch wheel metadata) are in test_cuda_packages.py.


def test_cu12_torch_stack_is_consistent(a40, captures):
    a40["packages"].update(_pins_from(captures["pip_cu12_torch_2_7"]))
    assert check_cuda_packages(a40).status is Status.PASS


def test_flashinfer_cubin_behind_python_fails_with_the_aligning_install(h200, captures):
    text = captures["flashinfer_cubin_mismatch"]
    h200["packages"].update({"flashinfer-python": "0.6.10", "flashinfer-cubin": "0.6.8.post1"})
    verdict = check_flashinfer_versions(h200)
    assert verdict.status is Status.FAIL
    assert "'flashinfer-cubin==0.6.10'" in verdict.fix
    h200["probes"]["flashinfer"] = {
        "status": "error",
        "error": text,
        "error_kind": host_facts.classify_import_error(text),
    }
    assert check_probe(h200, "flashinfer").status is Status.FAIL


def test_flashinfer_version_check_bypass_is_flagged(h200):
    h200["env"]["FLASHINFER_DISABLE_VERSION_CHECK"] = "1"
    verdict = check_flashinfer_version_check_env(h200)
    assert verdict.status is Status.WARN
    assert "unset FLASHINFER_DISABLE_VERSION_CHECK" in verdict.fix


def test_cpu_torch_fails_with_a_cuda_reinstall(h200):
    h200["torch"].update(version="2.13.0+cpu", cuda=None, cuda_available=False)
    verdict = check_torch_cuda_build(h200)
    assert verdict.status is Status.FAIL
    assert "--index-url https://download.pytorch.org/whl/cu130" in verdict.fix
    assert "'torch==2.13.0'" in verdict.fix


def test_torch_missing_names_sglangs_pin(h200):
    h200["torch"] = {"installed": False}
    verdict = check_torch_installed(h200)
    assert verdict.status is Status.FAIL
    assert verdict.fix.endswith("'torch==2.11.0'")


@pytest.mark.parametrize(
    ("snapshot_tag", "status"), [("cp312", Status.PASS), ("cp311", Status.FAIL)]
)
def test_snapshot_compiled_modules_must_match_the_interpreter(h200, snapshot_tag, status):
    # sglang 0.5.13's wheel ships sglang/srt/grpc/_core.cpython-311-x86_64-linux-gnu.so.
    snapshot = SnapshotABI(
        version="0.5.13",
        compiled=[("sglang/srt/grpc/_core.cpython-311-x86_64-linux-gnu.so", snapshot_tag)],
    )
    verdict = check_python_abi(h200, snapshot)  # Python 3.12.3
    assert verdict.status is status
    if status is Status.FAIL:
        assert "built for cp311 but the host runs cp312" in verdict.detail
        assert "Python 3.11 venv" in verdict.fix


def test_snapshot_requires_python_is_enforced(a40):
    verdict = check_python_version(a40, SnapshotABI(version="0.5.23", requires_python=">=3.11"))
    assert verdict.status is Status.PASS  # 3.11.5
    a40["python"]["version"] = "3.10.12"
    assert check_python_version(a40, SnapshotABI(requires_python=">=3.11")).failed
    assert check_python_version(a40, SnapshotABI(requires_python=">=3.11,<3.14")).failed


def test_installed_sglang_must_be_the_snapshot_version(h200):
    assert check_sglang_vs_snapshot(h200, SnapshotABI(version="0.5.13")).status is (Status.PASS)
    verdict = check_sglang_vs_snapshot(h200, SnapshotABI(version="0.5.23"))
    assert verdict.status is Status.FAIL
    assert verdict.fix.endswith("'sglang==0.5.23'")


@pytest.mark.parametrize(
    ("version", "major"),
    [
        ("2.11.0+cu130", 13),
        ("2.4.0+cu121", 12),
        ("2.0.1+cu118", 11),
        ("2.13.0+cpu", None),
        ("0.1.6+cu121torch2.4", 12),
    ],
)
def test_local_cuda_major(version, major):
    assert local_cuda_major(version) == major


def test_every_rule_survives_empty_facts():
    # A host that answered nothing useful must still get verdicts, never a crash.
    verdicts = run_abi_checks({})
    assert len(verdicts) == len(ABI_CHECKS) + len(SNAPSHOT_CHECKS)
    assert by_id(verdicts)["gpu.driver"].status is Status.FAIL


# torch's wheel ships plain ELF shared objects; found without importing torch.
TORCH_LIB = Path(importlib.util.find_spec("torch").origin).parent / "lib"


def _elf_needing(tmp_path, soname: bytes, into):
    """A real shared object from torch's wheel whose NEEDED libpthread.so.0 is rewritten to
    ``soname`` (same length), as a JIT cache entry built by another nvcc would link it."""
    source = TORCH_LIB / "libtorch_global_deps.so"
    data = source.read_bytes()
    assert data.count(b"libpthread.so.0\0") >= 1 and len(soname) == len(b"libpthread.so.0")
    into.parent.mkdir(parents=True, exist_ok=True)
    into.write_bytes(data.replace(b"libpthread.so.0\0", soname + b"\0"))
    return into


def test_elf_reader_agrees_with_readelf_on_a_real_library():
    needed = host_facts.elf_needed(str(TORCH_LIB / "libtorch_global_deps.so"))
    assert "libc.so.6" in needed and "libpthread.so.0" in needed


def test_jit_cache_built_for_cuda_12_fails_next_to_a_cu130_torch(h200, tmp_path):
    cache = tmp_path / ".cache" / "flashinfer" / "0.6.12" / "90" / "cached_ops" / "sampling"
    _elf_needing(tmp_path, b"libcudart.so.12", cache / "sampling.so")
    _elf_needing(tmp_path, b"libcudart.so.13", cache.parent / "norm" / "norm.so")
    h200["jit_cache"] = host_facts.jit_cache_facts({"FLASHINFER_WORKSPACE_BASE": str(tmp_path)})
    assert h200["jit_cache"]["files"] == 2
    verdict = check_jit_cache(h200)
    assert verdict.status is Status.FAIL
    assert "1 cached kernel(s) link libcudart.so.12 but torch uses CUDA 13" in verdict.detail
    assert verdict.fix.startswith(f"rm -rf {tmp_path / '.cache' / 'flashinfer'}")
    (cache / "sampling.so").unlink()
    h200["jit_cache"] = host_facts.jit_cache_facts({"FLASHINFER_WORKSPACE_BASE": str(tmp_path)})
    assert check_jit_cache(h200).status is Status.PASS


def test_no_jit_cache_is_a_skip(h200):
    h200["jit_cache"] = {"dirs": [], "files": 0, "cudart": {}, "errors": 0}
    assert check_jit_cache(h200).status is Status.SKIP
