"""Compatibility rules over host facts: pure functions, no I/O.

Each ``check_*`` takes the facts dict that :mod:`ddtree_cli.remote.facts` produces (and,
where it matters, a :class:`SnapshotABI` describing the SGLang snapshot to be served) and
returns one :class:`~ddtree_cli.verdict.Verdict` with the exact fix. ``deploy``'s
preflight and ``doctor`` both run them; :data:`ABI_CHECKS` lists them in order.

Rules that depend on something absent say so: with no NVIDIA driver only ``gpu.driver``
fails, and the GPU rules behind it skip with that reason, so the root cause stands out.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field

from ddtree_cli.verdict import Verdict, failed, passed, skipped, warned

# Minimum Linux driver per CUDA major (NVIDIA's CUDA toolkit release notes, "CUDA Toolkit
# and Corresponding Driver Versions"; minor-version compatibility within a major).
MIN_DRIVER_FOR_CUDA_MAJOR: dict[int, tuple[int, ...]] = {
    11: (450, 80, 2),
    12: (525, 60, 13),
    13: (580, 65, 6),
}

# First CUDA release whose toolchain builds SASS for a compute capability; used to name the
# torch build (and nvcc) a GPU needs.
MIN_CUDA_FOR_CAPABILITY: dict[tuple[int, int], tuple[int, int]] = {
    (8, 0): (11, 0),
    (8, 6): (11, 1),
    (8, 9): (11, 8),
    (9, 0): (11, 8),
    (10, 0): (12, 8),
    (10, 3): (12, 9),
    (12, 0): (12, 8),
    (12, 1): (12, 9),
}

TORCH_INDEX = "https://download.pytorch.org/whl"

# Unsuffixed NVIDIA wheels whose own major version is the CUDA major (CUDA 13 dropped the
# -cu13 suffix for these: nvidia-cublas 13.x). Others (nvidia-ml-py, nvidia-nccl, cudnn)
# number themselves independently and say nothing about the CUDA major.
_CUDA_VERSIONED_UNSUFFIXED = re.compile(
    r"^nvidia-(cublas|cuda-[a-z-]+|nvjitlink|nvtx|cufft|curand|cusolver|cusparse|npp|nvjpeg)$"
)


@dataclass(frozen=True)
class SnapshotABI:
    """What the snapshot to be served needs from the interpreter."""

    version: str | None = None
    requires_python: str | None = None  # e.g. ">=3.11", from the snapshot's dist-info
    # (path relative to the snapshot, tag): tag is "cp311", "cp313t" or "abi3".
    compiled: list[tuple[str, str]] = field(default_factory=list)
    wheel_tags: list[str] = field(default_factory=list)  # "cp311-cp311-manylinux_2_34_x86_64"


# --- small parsers -------------------------------------------------------------------


def version_tuple(version: str | None) -> tuple[int, ...]:
    """Leading numeric release of a version string: "2.11.0+cu130" -> (2, 11, 0)."""
    if not version:
        return ()
    parts = []
    for piece in re.split(r"[.+\-]", version):
        if not piece.isdigit():
            break
        parts.append(int(piece))
    return tuple(parts)


def base_version(version: str | None) -> str:
    return (version or "").split("+", 1)[0]


def local_cuda_major(version: str | None) -> int | None:
    """CUDA major from a local version tag: "+cu130" -> 13, "+cu128" -> 12, "+cpu" -> None."""
    match = re.search(r"\+cu(\d+)", version or "")
    if not match:
        return None
    digits = match.group(1)
    return int(digits[:-1]) if len(digits) >= 3 else int(digits)


def torch_cuda_major(facts: dict) -> int | None:
    torch = facts.get("torch") or {}
    cuda = version_tuple(torch.get("cuda"))
    return cuda[0] if cuda else local_cuda_major(torch.get("version"))


def capability_tuple(cap: str | None) -> tuple[int, int] | None:
    parts = version_tuple(cap)
    return (parts[0], parts[1]) if len(parts) >= 2 else None


def _sm(cap: tuple[int, int]) -> str:
    return f"sm_{cap[0]}{cap[1]}"


def _arch_entries(arch_list: list[str]) -> list[tuple[str, tuple[int, int]]]:
    """("sm"|"compute", (major, minor)) per arch-list entry; "sm_90a" counts as sm_90."""
    entries = []
    for item in arch_list:
        match = re.match(r"^(sm|compute)_(\d+)(\d)[a-z]?$", item)
        if match:
            entries.append((match.group(1), (int(match.group(2)), int(match.group(3)))))
    return entries


def _pins(requires: list[str]) -> dict[str, str]:
    """Exact pins ("name==version") from Requires-Dist lines, skipping optional extras."""
    pins = {}
    for line in requires:
        requirement, _, marker = line.partition(";")
        if "extra ==" in marker:
            continue
        match = re.match(r"^\s*([A-Za-z0-9_.\-]+)(\[[^\]]*\])?\s*==\s*([^\s,;]+)\s*$", requirement)
        if match:
            pins[_normalise(match.group(1))] = match.group(3)
    return pins


def _normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _python_of_tag(tag: str) -> str:
    """ "cp311" -> "3.11", "cp313t" -> "3.13t"."""
    match = re.match(r"^cp(\d)(\d+)(t?)$", tag)
    return f"{match.group(1)}.{match.group(2)}{match.group(3)}" if match else tag


def _no_driver(facts: dict) -> str | None:
    smi = facts.get("nvidia_smi") or {}
    if not smi.get("present"):
        return "no NVIDIA driver (nvidia-smi not found)"
    if not smi.get("driver_version"):
        return "nvidia-smi did not report a driver: " + (smi.get("error") or "no output")
    return None


def _torch_missing(facts: dict) -> str | None:
    torch = facts.get("torch") or {}
    if torch.get("installed") is False:
        return "torch is not installed"
    if not torch.get("version"):
        return "torch could not be imported: " + (torch.get("error") or "unknown error")
    return None


def _driver_label(smi: dict) -> str:
    cuda = smi.get("cuda_version")
    return f"{smi.get('driver_version')} (CUDA {cuda})" if cuda else str(smi.get("driver_version"))


def _pip(facts: dict) -> str:
    return f"{(facts.get('python') or {}).get('executable') or 'python3'} -m pip install"


def _sglang_pins(facts: dict) -> dict[str, str]:
    return _pins((facts.get("requires") or {}).get("sglang") or [])


# --- rules ---------------------------------------------------------------------------


def check_python_version(facts: dict, snapshot: SnapshotABI | None = None) -> Verdict:
    python = facts.get("python") or {}
    if not python.get("found"):
        return failed(
            "python.version",
            f"cannot run {python.get('executable')}: {python.get('error')}",
            "pass --python with the path of the venv's python that serves SGLang",
        )
    need = ">=3.10"
    if snapshot and snapshot.requires_python:
        need = snapshot.requires_python
    lower = re.search(r">=\s*([0-9.]+)", need)
    minimum = version_tuple(lower.group(1)) if lower else ()
    have = version_tuple(python.get("version"))
    if minimum and have[: len(minimum)] < minimum:
        return failed(
            "python.version",
            f"Python {python.get('version')}; SGLang needs {need}",
            f"create the venv with python{'.'.join(map(str, minimum))} or newer",
        )
    return passed("python.version", f"Python {python.get('version')} ({python.get('abi_tag')})")


def check_python_abi(facts: dict, snapshot: SnapshotABI | None = None) -> Verdict:
    """Compiled modules in the snapshot must match the serving interpreter's ABI tag."""
    if snapshot is None:
        return skipped("python.abi", "no --snapshot given")
    python = facts.get("python") or {}
    if not python.get("found"):
        return skipped("python.abi", "the serving interpreter could not be run")
    tag = python.get("abi_tag")
    wrong = [(path, t) for path, t in snapshot.compiled if t != "abi3" and t != tag]
    wheel_py = {w.split("-")[0] for w in snapshot.wheel_tags if w.split("-")[0].startswith("cp")}
    if wrong:
        tags = sorted({t for _, t in wrong})
        example = wrong[0][0]
        return failed(
            "python.abi",
            f"{len(wrong)} compiled module(s) in the snapshot are built for {', '.join(tags)} "
            f"but the host runs {tag} (e.g. {example})",
            f"serve from a Python {_python_of_tag(tags[0])} venv, or use the sglang wheel "
            f"built for {tag}",
        )
    if wheel_py and tag not in wheel_py:
        return failed(
            "python.abi",
            f"the snapshot's wheel is tagged {', '.join(sorted(wheel_py))} but the host runs {tag}",
            f"serve from a Python {_python_of_tag(sorted(wheel_py)[0])} venv, or use the "
            f"sglang wheel built for {tag}",
        )
    count = len(snapshot.compiled)
    return passed(
        "python.abi",
        f"{count} compiled module(s) match {tag}"
        if count
        else f"no compiled modules in the snapshot; {tag} is fine",
    )


def check_torch_installed(facts: dict) -> Verdict:
    torch = facts.get("torch") or {}
    pin = _sglang_pins(facts).get("torch")
    spec = f"torch=={pin}" if pin else "torch"
    if torch.get("installed") is False:
        return failed("torch.installed", "torch is not installed", f"{_pip(facts)} '{spec}'")
    if torch.get("installed") is None or not torch.get("version"):
        return failed(
            "torch.installed",
            f"importing torch failed: {torch.get('error') or 'unknown error'}",
            f"{_pip(facts)} --force-reinstall '{spec}'",
        )
    return passed("torch.installed", f"torch {torch['version']}")


def check_torch_cuda_build(facts: dict) -> Verdict:
    missing = _torch_missing(facts)
    if missing:
        return skipped("torch.cuda_build", missing)
    torch = facts["torch"]
    if torch.get("hip"):
        return failed(
            "torch.cuda_build",
            f"torch {torch['version']} is a ROCm build; this stack needs CUDA",
            f"{_pip(facts)} 'torch=={base_version(torch['version'])}' "
            f"--index-url {TORCH_INDEX}/cu130",
        )
    if not torch.get("cuda"):
        return failed(
            "torch.cuda_build",
            f"torch {torch['version']} is a CPU-only build",
            f"{_pip(facts)} --force-reinstall 'torch=={base_version(torch['version'])}' "
            f"--index-url {TORCH_INDEX}/cu{_suggested_cuda_tag(facts)}",
        )
    return passed("torch.cuda_build", f"torch {torch['version']} built for CUDA {torch['cuda']}")


def _suggested_cuda_tag(facts: dict) -> str:
    """cu130 when the driver can run CUDA 13 (or is unknown), else cu128."""
    driver_cuda = version_tuple((facts.get("nvidia_smi") or {}).get("cuda_version"))
    return "128" if driver_cuda and driver_cuda < (13, 0) else "130"


def check_driver_present(facts: dict) -> Verdict:
    reason = _no_driver(facts)
    if reason:
        major = torch_cuda_major(facts) or 13
        minimum = ".".join(map(str, MIN_DRIVER_FOR_CUDA_MAJOR.get(major, (580,))[:2]))
        return failed(
            "gpu.driver",
            reason,
            f"install the NVIDIA driver (>= {minimum} for CUDA {major}) and reboot; "
            "check with nvidia-smi",
        )
    smi = facts["nvidia_smi"]
    gpus = smi.get("gpus") or []
    if not gpus:
        return failed(
            "gpu.driver",
            f"driver {smi['driver_version']} sees no GPU",
            "check that the GPUs are attached (lspci | grep -i nvidia) and the module is "
            "loaded (nvidia-smi -L)",
        )
    names = sorted({g.get("name") or "?" for g in gpus})
    return passed(
        "gpu.driver",
        f"driver {_driver_label(smi)}, {len(gpus)} × {', '.join(names)}",
    )


def check_driver_vs_torch(facts: dict) -> Verdict:
    reason = _no_driver(facts) or _torch_missing(facts)
    if reason:
        return skipped("gpu.driver_cuda", reason)
    torch = facts["torch"]
    needed = version_tuple(torch.get("cuda"))
    if not needed:
        return skipped("gpu.driver_cuda", f"torch {torch['version']} has no CUDA build")
    smi = facts["nvidia_smi"]
    driver = version_tuple(smi.get("driver_version"))
    minimum = MIN_DRIVER_FOR_CUDA_MAJOR.get(needed[0])
    driver_cuda = version_tuple(smi.get("cuda_version"))
    too_old = (driver_cuda and driver_cuda[0] < needed[0]) or (
        not driver_cuda and minimum and driver < minimum
    )
    if too_old:
        alt = "cu128" if needed[0] >= 13 else "an older CUDA"
        return failed(
            "gpu.driver_cuda",
            f"driver {smi['driver_version']} supports CUDA {smi.get('cuda_version') or '?'}, "
            f"torch {torch['version']} needs CUDA {torch['cuda']}",
            f"upgrade the NVIDIA driver to >= {'.'.join(map(str, (minimum or (0,))[:2]))} or "
            f"install a {alt} build of torch ({TORCH_INDEX}/{alt if alt.startswith('cu') else ''})",
        )
    if driver_cuda and driver_cuda < needed:
        return warned(
            "gpu.driver_cuda",
            f"driver supports CUDA {smi['cuda_version']} < torch's {torch['cuda']}: runs by "
            "minor-version compatibility, but PTX JIT (Triton, FlashInfer) may fail",
            f"upgrade the NVIDIA driver to one that reports CUDA >= {torch['cuda']}",
        )
    return passed(
        "gpu.driver_cuda",
        f"driver {_driver_label(smi)} >= torch CUDA {torch['cuda']}",
    )


def check_cuda_available(facts: dict) -> Verdict:
    reason = _no_driver(facts) or _torch_missing(facts)
    if reason:
        return skipped("torch.cuda_available", reason)
    torch = facts["torch"]
    if not torch.get("cuda"):
        return skipped("torch.cuda_available", f"torch {torch['version']} has no CUDA build")
    if torch.get("cuda_available"):
        return passed("torch.cuda_available", f"torch sees {torch.get('device_count')} GPU(s)")
    said = " ".join(torch.get("warnings") or [])[:300]
    return failed(
        "torch.cuda_available",
        "torch.cuda.is_available() is False"
        + (f": {said}" if said else "")
        + " (SGLang would fall back to 'Auto-configed device: cpu')",
        "fix gpu.driver_cuda first; otherwise check /dev/nvidia* permissions and "
        "CUDA_VISIBLE_DEVICES",
    )


def check_gpu_arch(facts: dict) -> Verdict:
    """Every GPU's compute capability must have SASS (or older PTX) in torch's arch list."""
    reason = _no_driver(facts) or _torch_missing(facts)
    if reason:
        return skipped("gpu.arch", reason)
    torch = facts["torch"]
    if not torch.get("cuda"):
        return skipped("gpu.arch", f"torch {torch['version']} has no CUDA build")
    arch_list = torch.get("arch_list") or []
    if not arch_list:
        return skipped("gpu.arch", "torch did not report its arch list")
    entries = _arch_entries(arch_list)
    caps = {}
    for gpu in facts["nvidia_smi"].get("gpus") or []:
        cap = capability_tuple(gpu.get("compute_cap"))
        if cap:
            caps.setdefault(cap, gpu.get("name") or "?")
    if not caps:
        return skipped("gpu.arch", "nvidia-smi did not report compute capabilities")
    jit_only, missing = [], []
    for cap, name in sorted(caps.items()):
        # SASS runs on the same major at an equal or higher minor; PTX JITs forward.
        if any(k == "sm" and c[0] == cap[0] and c[1] <= cap[1] for k, c in entries):
            continue
        if any(k == "compute" and c <= cap for k, c in entries):
            jit_only.append(f"{name} ({_sm(cap)})")
        else:
            missing.append((cap, name))
    if missing:
        cap, name = missing[0]
        need = MIN_CUDA_FOR_CAPABILITY.get(cap)
        build = f"cu{need[0]}{need[1]}" if need else "a newer CUDA"
        return failed(
            "gpu.arch",
            f"{name} is {_sm(cap)}; torch {torch['version']} supports {' '.join(arch_list)}",
            f"install a torch build with {_sm(cap)} ({build} or newer): "
            f"{_pip(facts)} --force-reinstall 'torch=={base_version(torch['version'])}' "
            f"--index-url {TORCH_INDEX}/cu{_suggested_cuda_tag(facts)}",
        )
    if jit_only:
        return warned(
            "gpu.arch",
            f"only PTX for {', '.join(jit_only)}: kernels JIT-compile at first use (slow start)",
            "install a torch build with SASS for that architecture",
        )
    return passed("gpu.arch", f"{', '.join(_sm(c) for c in sorted(caps))} in torch's arch list")


def check_nvcc(facts: dict) -> Verdict:
    """FlashInfer/DeepGEMM JIT with a host nvcc of another CUDA major caches broken kernels."""
    major = torch_cuda_major(facts)
    missing = _torch_missing(facts)
    if missing or major is None:
        return skipped("cuda.nvcc", missing or "torch has no CUDA build")
    nvcc = facts.get("nvcc") or {}
    if not nvcc.get("present"):
        return warned(
            "cuda.nvcc",
            "nvcc not found: JIT kernels (FlashInfer, DeepGEMM) cannot be built on this host",
            f"install the CUDA {major} toolkit and set CUDA_HOME, or install flashinfer-jit-cache",
        )
    release = version_tuple(nvcc.get("release"))
    if not release:
        return warned("cuda.nvcc", f"could not read nvcc's release ({nvcc.get('path')})")
    if release[0] != major:
        return failed(
            "cuda.nvcc",
            f"nvcc {nvcc['release']} ({nvcc['path']}) but torch is built for CUDA {major}: "
            "JIT-built kernels then fail with cudaErrorInsufficientDriver",
            f"set CUDA_HOME to a CUDA {major}.x toolkit, then rm -rf ~/.cache/flashinfer",
        )
    caps = [
        capability_tuple(g.get("compute_cap"))
        for g in (facts.get("nvidia_smi") or {}).get("gpus") or []
    ]
    for cap in caps:
        need = MIN_CUDA_FOR_CAPABILITY.get(cap) if cap else None
        if need and release < need:
            return failed(
                "cuda.nvcc",
                f"nvcc {nvcc['release']} cannot build for {_sm(cap)} (needs {need[0]}.{need[1]}+)",
                f"install CUDA toolkit >= {need[0]}.{need[1]} and point CUDA_HOME at it",
            )
    return passed("cuda.nvcc", f"nvcc {nvcc['release']} matches torch's CUDA {major}")


def cuda_majors_of_packages(packages: dict[str, str]) -> dict[int, list[str]]:
    """CUDA major -> the installed packages that are built for it."""
    majors: dict[int, list[str]] = {}
    for name, version in sorted(packages.items()):
        major = None
        suffix = re.search(r"-cu(\d+)$", name)
        if name.startswith("nvidia-") and suffix:
            major = int(suffix.group(1))
        elif _CUDA_VERSIONED_UNSUFFIXED.match(name):
            first = version_tuple(version)[:1]
            major = first[0] if first and 11 <= first[0] <= 14 else None
        else:
            major = local_cuda_major(version)
        if major is not None:
            majors.setdefault(major, []).append(f"{name}=={version}")
    return majors


def check_cuda_packages(facts: dict) -> Verdict:
    packages = dict(facts.get("packages") or {})
    majors = cuda_majors_of_packages(packages)
    torch_major = torch_cuda_major(facts)
    if torch_major is not None:
        majors.setdefault(torch_major, [])
        torch_entry = f"torch=={(facts.get('torch') or {}).get('version')}"
        if torch_entry not in majors[torch_major]:
            majors[torch_major].append(torch_entry)
    if not majors:
        return skipped("cuda.packages", "no CUDA-tagged packages installed")
    if len(majors) > 1:
        keep = torch_major if torch_major is not None else max(majors)
        strays = [p for m, ps in majors.items() if m != keep for p in ps]
        detail = "; ".join(
            f"CUDA {m}: {', '.join(ps[:3])}{' …' if len(ps) > 3 else ''}"
            for m, ps in sorted(majors.items())
        )
        names = " ".join(p.split("==")[0] for p in strays[:6])
        return failed(
            "cuda.packages",
            f"packages built for different CUDA majors ({detail})",
            f"{_pip(facts).replace(' install', ' uninstall -y')} {names}, then reinstall "
            f"them for CUDA {keep}",
        )
    (major,) = majors
    return passed("cuda.packages", f"every CUDA-tagged package is built for CUDA {major}")


_PROBE_PACKAGE = {
    "sgl_kernel": "sglang-kernel",
    "flashinfer": "flashinfer-python",
    "sglang": "sglang",
}


def check_probe(facts: dict, module: str) -> Verdict:
    check_id = f"kernels.{module}"
    probe = (facts.get("probes") or {}).get(module)
    if probe is None:
        return skipped(check_id, "import probes were not run")
    if probe.get("status") == "missing":
        if module == "sglang":
            return warned(
                check_id,
                "sglang is not installed in the serving venv",
                f"{_pip(facts)} 'sglang==VERSION' (your snapshot's version; --snapshot checks it)",
            )
        return skipped(check_id, f"{module} is not installed")
    if probe.get("status") == "ok":
        return passed(check_id, f"import {module} works")
    error = probe.get("error") or ""
    kind = probe.get("error_kind")
    pins = _sglang_pins(facts)
    packages = facts.get("packages") or {}
    dist = _PROBE_PACKAGE.get(module, module)
    if module == "sgl_kernel" and "sgl-kernel" in packages and "sglang-kernel" not in packages:
        dist = "sgl-kernel"
    torch_version = (facts.get("torch") or {}).get("version")
    if kind == "undefined_symbol":
        symbol = re.search(r"undefined symbol: (\S+)", error)
        pair = " ".join(f"'{n}=={pins[n]}'" for n in ("torch", dist) if n in pins)
        fix = (
            f"{_pip(facts)} --force-reinstall {pair}  (the pair sglang "
            f"{packages.get('sglang', '')} pins)"
            if pair
            else f"reinstall {dist} built for torch {torch_version}"
        )
        return failed(
            check_id,
            f"{dist} {packages.get(dist, '')} was built for another torch than "
            f"{torch_version}: undefined symbol {symbol.group(1) if symbol else ''}".strip(),
            fix,
        )
    if kind in ("common_ops", "missing_library"):
        return failed(
            check_id,
            f"import {module} cannot load its CUDA libraries: {error.splitlines()[-1]}",
            f"make every CUDA package match torch's CUDA {torch_cuda_major(facts)} "
            f"(see cuda.packages); reinstall {dist} for that CUDA",
        )
    if kind == "flashinfer_version":
        return failed(
            check_id,
            error.splitlines()[-1],
            "align flashinfer-python, "
            "flashinfer-cubin and flashinfer-jit-cache (see flashinfer.versions)",
        )
    if kind == "timeout":
        return warned(check_id, f"import {module} did not finish in time", "")
    pinned = pins.get(dist)
    spec = f"'{dist}=={pinned}'" if pinned else f"'{dist}'"
    last = error.splitlines()[-1] if error else kind
    return failed(
        check_id, f"import {module} failed: {last}", f"{_pip(facts)} --force-reinstall {spec}"
    )


def check_flashinfer_versions(facts: dict) -> Verdict:
    packages = facts.get("packages") or {}
    parts = {
        n: packages[n]
        for n in ("flashinfer-python", "flashinfer-cubin", "flashinfer-jit-cache")
        if n in packages
    }
    if not parts:
        return skipped("flashinfer.versions", "flashinfer is not installed")
    bases = {base_version(v) for v in parts.values()}
    listing = ", ".join(f"{n} {v}" for n, v in parts.items())
    if len(bases) > 1:
        target = parts.get("flashinfer-python") or max(parts.values(), key=version_tuple)
        target = base_version(target)
        strays = [n for n, v in parts.items() if base_version(v) != target]
        return failed(
            "flashinfer.versions",
            f"versions differ: {listing}",
            f"{_pip(facts)} "
            + " ".join(f"'{n}=={target}'" for n in strays)
            + " (cubin and jit-cache come from the FlashInfer wheel index for your CUDA)",
        )
    return passed("flashinfer.versions", listing)


def check_flashinfer_version_check_env(facts: dict) -> Verdict:
    value = (facts.get("env") or {}).get("FLASHINFER_DISABLE_VERSION_CHECK")
    if value in (None, "", "0"):
        return passed("flashinfer.version_check", "FLASHINFER_DISABLE_VERSION_CHECK is not set")
    return warned(
        "flashinfer.version_check",
        f"FLASHINFER_DISABLE_VERSION_CHECK={value} hides flashinfer/cubin mismatches, which "
        "then surface as illegal memory accesses",
        "unset FLASHINFER_DISABLE_VERSION_CHECK (shell profile or the unit's Environment=) "
        "and align the flashinfer packages instead",
    )


# The pins whose mismatch breaks at import or at kernel launch (compiled against torch's ABI).
_ABI_PINNED = ("torch", "sglang-kernel", "sgl-kernel", "flashinfer-python", "flashinfer-cubin")


def check_sglang_pins(facts: dict) -> Verdict:
    """Installed torch/kernels must equal what sglang pins: the kernel wheels declare no torch
    requirement of their own, so pip happily pairs them with another torch."""
    packages = facts.get("packages") or {}
    if "sglang" not in packages:
        return skipped("sglang.pins", "sglang is not installed in the serving venv")
    pins = _sglang_pins(facts)
    wanted = {n: v for n, v in pins.items() if n in _ABI_PINNED}
    if not wanted:
        if not (facts.get("requires") or {}).get("sglang"):
            return skipped("sglang.pins", "sglang's requirements (Requires-Dist) were not read")
        return skipped("sglang.pins", f"sglang {packages['sglang']} pins none of torch/kernels")
    wrong = [
        (n, v, packages[n])
        for n, v in sorted(wanted.items())
        if n in packages and base_version(packages[n]) != base_version(v)
    ]
    absent = [(n, v) for n, v in sorted(wanted.items()) if n not in packages]
    if wrong:
        detail = ", ".join(f"{n} {h} (pinned {v})" for n, v, h in wrong)
        return failed(
            "sglang.pins",
            f"sglang {packages['sglang']} pins other versions: {detail}",
            f"{_pip(facts)} " + " ".join(f"'{n}=={v}'" for n, v, _ in wrong),
        )
    if absent:
        return warned(
            "sglang.pins",
            f"sglang {packages['sglang']} pins {', '.join(f'{n}=={v}' for n, v in absent)}, "
            "not installed",
            f"{_pip(facts)} " + " ".join(f"'{n}=={v}'" for n, v in absent),
        )
    return passed(
        "sglang.pins",
        f"installed versions match sglang {packages['sglang']}'s pins "
        f"({', '.join(f'{n}=={v}' for n, v in sorted(wanted.items()))})",
    )


def check_sglang_vs_snapshot(facts: dict, snapshot: SnapshotABI | None = None) -> Verdict:
    if snapshot is None or not snapshot.version:
        return skipped("sglang.version", "no --snapshot given")
    installed = (facts.get("packages") or {}).get("sglang")
    if installed is None:
        return failed(
            "sglang.version",
            f"sglang is not installed; the snapshot is {snapshot.version}",
            f"{_pip(facts)} 'sglang=={snapshot.version}' (installs the kernels it pins)",
        )
    if base_version(installed) != base_version(snapshot.version):
        return failed(
            "sglang.version",
            f"installed sglang {installed} but the snapshot is {snapshot.version}: its "
            "pinned torch/kernels belong to another release",
            f"{_pip(facts)} 'sglang=={snapshot.version}'",
        )
    return passed("sglang.version", f"installed sglang {installed} = snapshot {snapshot.version}")


def _probe_check(module: str) -> Callable[[dict], Verdict]:
    def rule(facts: dict) -> Verdict:
        return check_probe(facts, module)

    rule.__name__ = f"check_probe_{module}"
    return rule


# Rules over facts alone, in display order; snapshot rules take (facts, snapshot).
ABI_CHECKS: list[Callable[[dict], Verdict]] = [
    check_torch_installed,
    check_torch_cuda_build,
    check_driver_present,
    check_driver_vs_torch,
    check_cuda_available,
    check_gpu_arch,
    check_nvcc,
    check_cuda_packages,
    check_flashinfer_versions,
    check_flashinfer_version_check_env,
    check_sglang_pins,
    _probe_check("sgl_kernel"),
    _probe_check("flashinfer"),
    _probe_check("sglang"),
]
SNAPSHOT_CHECKS: list[Callable[[dict, SnapshotABI | None], Verdict]] = [
    check_python_version,
    check_python_abi,
    check_sglang_vs_snapshot,
]


def run_abi_checks(facts: dict, snapshot: SnapshotABI | None = None) -> list[Verdict]:
    """Every compatibility rule, in order: python first, then torch/GPU, then packages."""
    first = [rule(facts, snapshot) for rule in SNAPSHOT_CHECKS[:2]]
    return first + [rule(facts) for rule in ABI_CHECKS] + [SNAPSHOT_CHECKS[2](facts, snapshot)]
