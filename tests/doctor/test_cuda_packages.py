"""cuda.packages on the package sets a real ``pip install torch`` gives on Linux x86_64.

The stacks are built from the wheels' own METADATA (fixtures/wheel_metadata, each with the
pip command, date and wheel file it came from): torch's Requires-Dist, and for CUDA 13
builds the cuda-toolkit extras torch asks for, resolved here the way pip resolves them on
Linux (a pin "==13.1.0.3.*" installs 13.1.0.3). Nothing below invents a version: the mixes
put a real pin of one torch next to another torch.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from ddtree_cli.doctor.cuda_rules import check_cuda_packages, component_cuda_major, torch_own_pins
from ddtree_cli.doctor.verdict import Status

from .conftest import load_h200_state

METADATA = Path(__file__).parent / "fixtures" / "wheel_metadata"
LINUX = {"platform_system": "Linux", "sys_platform": "linux", "platform_machine": "x86_64"}


def metadata(name: str) -> dict:
    return json.loads((METADATA / f"{name}.json").read_text())


def _applies(marker: str, extras: set[str]) -> bool:
    """Markers of these wheels on Linux x86_64 / Python 3.12: platform tests and extras."""
    for key, value in re.findall(r"(\w+)\s*==\s*['\"]([^'\"]+)['\"]", marker):
        if key == "extra":
            if value not in extras:
                return False
        elif key in LINUX and "or" not in marker and LINUX[key] != value:
            return False
    return not ("linux" not in marker.lower() and "sys_platform" in marker)


def resolve(requires: list[str], extras: set[str] = frozenset()) -> dict[str, tuple[str, str]]:
    """{name: (version spec, [extras])} of the requirements that apply."""
    out = {}
    for line in requires:
        requirement, _, marker = line.partition(";")
        if not _applies(marker, set(extras)):
            continue
        match = re.match(r"^([A-Za-z0-9_.\-]+)(?:\[([^\]]*)\])?\s*(.*)$", requirement.strip())
        out[match.group(1).lower()] = (match.group(3), match.group(2) or "")
    return out


def stock_stack(torch_version: str) -> tuple[dict[str, str], dict[str, list[str]]]:
    """(installed {name: version}, requires {name: lines}) after pip install torch==X."""
    torch = metadata(f"torch-{torch_version}")
    installed = {"torch": torch["version"]}
    requires = {"torch": torch["requires_dist"]}
    for name, (spec, extras) in resolve(torch["requires_dist"]).items():
        exact = re.match(r"^==([0-9][0-9A-Za-z.]*)$", spec)
        if name == "cuda-toolkit":
            toolkit = metadata(f"cuda-toolkit-{exact.group(1)}")
            installed[name] = toolkit["version"]
            requires[name] = toolkit["requires_dist"]
            wanted = {e.strip() for e in extras.split(",")}
            for dep, (dep_spec, _) in resolve(toolkit["requires_dist"], wanted).items():
                pinned = re.match(r"^==([0-9.]+?)(?:\.\*)?$", dep_spec)
                if pinned:  # nvidia-nvjitlink<14,>=13.0.88 is resolved by its exact pin elsewhere
                    installed[dep] = pinned.group(1)
        elif name.startswith("nvidia-") and exact:
            installed[name] = exact.group(1)
    return installed, requires


def facts_for(torch_version: str, cuda: str, with_requires: bool = True) -> dict:
    """The real H200's facts (SGLang 0.5.17 installed, fixtures/h200_sglang_0517) with its
    torch 2.11.0 CUDA stack swapped for this torch's."""
    facts = load_h200_state("installed")
    h200_stack, h200_requires = stock_stack("2.11.0")
    facts["packages"] = {n: v for n, v in facts["packages"].items() if n not in h200_stack}
    for name in h200_requires:
        facts["requires"].pop(name)
    installed, requires = stock_stack(torch_version)
    facts["packages"] = {**facts["packages"], **installed}
    facts["torch"]["version"], facts["torch"]["cuda"] = installed["torch"], cuda
    if with_requires:
        facts["requires"] = {**facts["requires"], **requires}
    return facts


# torch.version.cuda of each build, from its pins: cuda-toolkit 13.0.x, or nvidia-cuda-runtime-cu12
# 12.8.90 for 2.9.1 (PyPI's default build of 2.9.1 is cu128).
STOCK = [("2.11.0", "13.0"), ("2.13.0", "13.0"), ("2.14.1", "13.0"), ("2.9.1", "12.8")]


def test_the_h200_holds_the_stack_torch_2_11_metadata_gives():
    # What `pip install` put on the H200 is what the wheels' METADATA says, pin for pin.
    facts = load_h200_state("installed")
    installed, requires = stock_stack("2.11.0")
    cuda = {n: v for n, v in facts["packages"].items() if n in installed}
    assert cuda == installed
    assert {n: facts["requires"][n] for n in requires} == requires
    verdict = check_cuda_packages(facts)
    assert verdict.status is Status.PASS, verdict
    assert verdict.detail.startswith("15 CUDA package(s) all belong to CUDA 13")


def test_the_stacks_hold_what_pip_installs():
    installed, _ = stock_stack("2.11.0")
    # The libraries the H200 report listed as "CUDA 12" are CUDA 13.0's own.
    assert installed["nvidia-cufft"] == "12.0.0.61"
    assert installed["nvidia-cusolver"] == "12.0.4.66"
    assert installed["nvidia-cusparse"] == "12.6.3.3"
    assert installed["nvidia-curand"] == "10.4.0.35"
    assert installed["nvidia-cublas"] == "13.1.0.3"
    assert installed["nvidia-cudnn-cu13"] == "9.19.0.56"
    cu128, _ = stock_stack("2.9.1")
    assert cu128["nvidia-cublas-cu12"] == "12.8.4.1" and "cuda-toolkit" not in cu128


@pytest.mark.parametrize("torch_version, cuda", STOCK)
@pytest.mark.parametrize("with_requires", [True, False])
def test_a_stock_torch_stack_passes(torch_version, cuda, with_requires):
    # with_requires=False: facts from a collector that did not read torch's Requires-Dist;
    # NVIDIA's component table alone must then place every wheel.
    verdict = check_cuda_packages(facts_for(torch_version, cuda, with_requires))
    assert verdict.status is Status.PASS, verdict
    assert f"CUDA {cuda.split('.')[0]}" in verdict.detail
    if with_requires:
        assert "torch's own pins" in verdict.detail


def test_torch_own_pins_come_from_torch_and_cuda_toolkit():
    pins = torch_own_pins(facts_for("2.11.0", "13.0"))
    assert pins["nvidia-cudnn-cu13"] == "9.19.0.56"
    assert pins["nvidia-cusparse"] == "12.6.3.3"
    assert pins["nvidia-cublas"] == "13.1.0.3"
    # Extras torch does not ask for (nvcc, npp, ...) are not its pins.
    assert "nvidia-cuda-nvcc" not in pins and "nvidia-npp" not in pins


def test_the_component_table_places_both_families():
    cu128, _ = stock_stack("2.9.1")
    cu130, _ = stock_stack("2.14.1")
    for name in ("cufft", "curand", "cusolver", "cusparse"):
        assert component_cuda_major(f"nvidia-{name}", cu130[f"nvidia-{name}"]) == 13
        assert component_cuda_major(f"nvidia-{name}", cu128[f"nvidia-{name}-cu12"]) == 12
    assert component_cuda_major("nvidia-ml-py", "12.575.51") is None
    assert component_cuda_major("nvidia-cufile", cu130["nvidia-cufile"]) is None


def test_cu12_cublas_next_to_a_cu130_torch_fails_and_names_the_fix():
    facts = facts_for("2.11.0", "13.0")
    cu128, _ = stock_stack("2.9.1")
    facts["packages"]["nvidia-cublas-cu12"] = cu128["nvidia-cublas-cu12"]
    verdict = check_cuda_packages(facts)
    assert verdict.status is Status.FAIL
    assert "built for CUDA 13" in verdict.detail
    assert "nvidia-cublas-cu12==12.8.4.1 (-cu12 suffix)" in verdict.detail
    # Only the stray goes; torch's own cuBLAS is put back at torch's pin.
    assert "-m pip uninstall -y nvidia-cublas-cu12 &&" in verdict.fix
    assert "--force-reinstall --no-deps 'nvidia-cublas==13.1.0.3'" in verdict.fix
    for own in ("nvidia-cufft", "nvidia-cusolver", "nvidia-cusparse", "nvidia-curand"):
        assert own not in verdict.detail and f" {own} " not in verdict.fix


def test_cu12_cudnn_with_a_cu130_torch_fails_with_torchs_cudnn_as_the_fix():
    facts = facts_for("2.11.0", "13.0")
    cu128, _ = stock_stack("2.9.1")
    facts["packages"]["nvidia-cudnn-cu12"] = cu128["nvidia-cudnn-cu12"]  # 9.10.2.21
    verdict = check_cuda_packages(facts)
    assert verdict.status is Status.FAIL
    assert "nvidia-cudnn-cu12==9.10.2.21" in verdict.detail
    assert "uninstall -y nvidia-cudnn-cu12 " in verdict.fix
    assert "'nvidia-cudnn-cu13==9.19.0.56'" in verdict.fix
    assert "uninstall -y nvidia-cudnn-cu13" not in verdict.fix


def test_a_package_that_needs_the_stray_is_named():
    facts = facts_for("2.11.0", "13.0")
    cu128, requires128 = stock_stack("2.9.1")
    # torch 2.9.1's own metadata requires nvidia-cudnn-cu12: as if its dist-info were left over.
    facts["packages"]["nvidia-cudnn-cu12"] = cu128["nvidia-cudnn-cu12"]
    facts["requires"]["torchlike-cu12"] = requires128["torch"]
    verdict = check_cuda_packages(facts)
    assert "required by torchlike-cu12" in verdict.detail
    assert "then install torchlike-cu12 built for CUDA 13" in verdict.fix


def test_cu128_torch_with_a_cuda_13_library_fails():
    facts = facts_for("2.9.1", "12.8")
    cu130, _ = stock_stack("2.11.0")
    facts["packages"]["nvidia-cufft"] = cu130["nvidia-cufft"]  # 12.0.0.61, CUDA 13.0's cuFFT
    verdict = check_cuda_packages(facts)
    assert verdict.status is Status.FAIL
    assert "nvidia-cufft==12.0.0.61 (NVIDIA's component table)" in verdict.detail
    assert "'nvidia-cufft-cu12==11.3.3.83'" in verdict.fix
