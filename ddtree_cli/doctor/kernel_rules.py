"""Rules over the kernels SGLang loads: import probes of sgl_kernel, flashinfer and sglang,
the flashinfer packages and JIT cache, sglang's pins of torch and the kernel wheels, and the
attention backend the unit asks for against the GPU's compute capability."""

from __future__ import annotations

import re

from ddtree_cli.doctor.parsing import (
    base_version,
    capability_tuple,
    pip_install,
    sglang_pins,
    torch_cuda_major,
    version_tuple,
)
from ddtree_cli.doctor.verdict import Verdict, failed, passed, skipped, warned

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
                f"{pip_install(facts)} 'sglang==VERSION' (your snapshot's version; --snapshot checks it)",
            )
        return skipped(check_id, f"{module} is not installed")
    if probe.get("status") == "ok":
        return passed(check_id, f"import {module} works")
    error = probe.get("error") or ""
    kind = probe.get("error_kind")
    pins = sglang_pins(facts)
    packages = facts.get("packages") or {}
    dist = _PROBE_PACKAGE.get(module, module)
    if module == "sgl_kernel" and "sgl-kernel" in packages and "sglang-kernel" not in packages:
        dist = "sgl-kernel"
    torch_version = (facts.get("torch") or {}).get("version")
    if kind == "undefined_symbol":
        symbol = re.search(r"undefined symbol: (\S+)", error)
        # Reinstall only what differs from sglang's pins (the kernel, as a rule): reinstalling
        # a torch that already matches would fetch gigabytes and fix nothing. --no-deps keeps
        # pip from pulling another torch in with the kernel.
        pinned = [n for n in ("torch", dist) if n in pins]
        wrong = [n for n in pinned if base_version(packages.get(n)) != base_version(pins[n])]
        chosen = wrong or [n for n in pinned if n == dist]
        fix = (
            f"{pip_install(facts)} --force-reinstall --no-deps "
            + " ".join(f"'{n}=={pins[n]}'" for n in chosen)
            + f"  (what sglang {packages.get('sglang', '')} pins)"
            if chosen
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
        check_id,
        f"import {module} failed: {last}",
        f"{pip_install(facts)} --force-reinstall {spec}",
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
            f"{pip_install(facts)} "
            + " ".join(f"'{n}=={target}'" for n in strays)
            + " (cubin and jit-cache come from the FlashInfer wheel index for your CUDA)",
        )
    return passed("flashinfer.versions", listing)


def check_jit_cache(facts: dict) -> Verdict:
    """Kernels FlashInfer JIT-compiled earlier must link the libcudart of torch's CUDA major:
    a cache built by another nvcc is reused silently and fails at launch."""
    cache = facts.get("jit_cache") or {}
    if not cache.get("dirs"):
        return skipped("flashinfer.jit_cache", "no FlashInfer JIT cache on this host")
    major = torch_cuda_major(facts)
    if major is None:
        return skipped("flashinfer.jit_cache", "torch has no CUDA build to compare with")
    linked = cache.get("cudart") or {}
    wrong = {lib: e for lib, e in linked.items() if lib != f"libcudart.so.{major}"}
    dirs = " ".join(cache["dirs"])
    if wrong:
        lib, entry = sorted(wrong.items())[0]
        return failed(
            "flashinfer.jit_cache",
            f"{entry['count']} cached kernel(s) link {lib} but torch uses CUDA {major} "
            f"(e.g. {entry['example']})",
            f"rm -rf {dirs}  (FlashInfer rebuilds what it needs at the next start)",
        )
    return passed(
        "flashinfer.jit_cache",
        f"{cache.get('files', 0)} cached kernel(s) in {dirs}, none built for another CUDA",
    )


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
    pins = sglang_pins(facts)
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
            f"{pip_install(facts)} " + " ".join(f"'{n}=={v}'" for n, v, _ in wrong),
        )
    if absent:
        return warned(
            "sglang.pins",
            f"sglang {packages['sglang']} pins {', '.join(f'{n}=={v}' for n, v in absent)}, "
            "not installed",
            f"{pip_install(facts)} " + " ".join(f"'{n}=={v}'" for n, v in absent),
        )
    return passed(
        "sglang.pins",
        f"installed versions match sglang {packages['sglang']}'s pins "
        f"({', '.join(f'{n}=={v}' for n, v in sorted(wanted.items()))})",
    )


# Attention backends that only run on some compute capabilities (major, minor) ranges.
_BACKEND_CAPS = {
    "fa3": ((8, 0), (9, 0), "SM80-SM90"),
    "trtllm_mla": ((10, 0), (10, 3), "SM100/SM103"),
}


def check_attention_backend(facts: dict) -> Verdict:
    args = (facts.get("systemd") or {}).get("server_args") or {}
    chosen = {flag: args[flag] for flag in args if "attention-backend" in flag}
    if not chosen:
        return skipped("sglang.attention_backend", "no --attention-backend in the unit's ExecStart")
    caps = {
        capability_tuple(g.get("compute_cap"))
        for g in (facts.get("nvidia_smi") or {}).get("gpus") or []
    } - {None}
    if not caps:
        return skipped("sglang.attention_backend", "no GPU compute capability known")
    for flag, backend in sorted(chosen.items()):
        if backend not in _BACKEND_CAPS:
            continue
        low, high, label = _BACKEND_CAPS[backend]
        wrong = sorted(c for c in caps if not low <= c <= high)
        if wrong:
            sm = ", ".join(f"sm_{a}{b}" for a, b in wrong)
            return failed(
                "sglang.attention_backend",
                f"{flag} {backend} supports {label} only; this host has {sm}",
                f"use {flag} flashinfer (or triton) in the unit's ExecStart",
            )
    listing = ", ".join(f"{f} {b}" for f, b in sorted(chosen.items()))
    return passed("sglang.attention_backend", f"{listing} runs on this GPU")
