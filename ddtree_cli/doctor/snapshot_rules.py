"""Rules that compare the host with the snapshot to be served: the serving Python's version
and ABI against the snapshot's compiled modules, the installed sglang against the snapshot's
version, and whether DDTREE is applied to the snapshot folder."""

from __future__ import annotations

import re

from ddtree_cli.doctor.parsing import base_version, pip_install, python_of_tag, version_tuple
from ddtree_cli.doctor.snapshot_abi import SnapshotABI
from ddtree_cli.doctor.verdict import Verdict, failed, passed, skipped, warned
from ddtree_cli.errors import DdtreeError


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
            f"serve from a Python {python_of_tag(tags[0])} venv, or use the sglang wheel "
            f"built for {tag}",
        )
    if wheel_py and tag not in wheel_py:
        return failed(
            "python.abi",
            f"the snapshot's wheel is tagged {', '.join(sorted(wheel_py))} but the host runs {tag}",
            f"serve from a Python {python_of_tag(sorted(wheel_py)[0])} venv, or use the "
            f"sglang wheel built for {tag}",
        )
    count = len(snapshot.compiled)
    return passed(
        "python.abi",
        f"{count} compiled module(s) match {tag}"
        if count
        else f"no compiled modules in the snapshot; {tag} is fine",
    )


def check_sglang_vs_snapshot(facts: dict, snapshot: SnapshotABI | None = None) -> Verdict:
    if snapshot is None or not snapshot.version:
        return skipped("sglang.version", "no --snapshot given")
    installed = (facts.get("packages") or {}).get("sglang")
    if installed is None:
        return failed(
            "sglang.version",
            f"sglang is not installed; the snapshot is {snapshot.version}",
            f"{pip_install(facts)} 'sglang=={snapshot.version}' (installs the kernels it pins)",
        )
    if base_version(installed) != base_version(snapshot.version):
        return failed(
            "sglang.version",
            f"installed sglang {installed} but the snapshot is {snapshot.version}: its "
            "pinned torch/kernels belong to another release",
            f"{pip_install(facts)} 'sglang=={snapshot.version}'",
        )
    return passed("sglang.version", f"installed sglang {installed} = snapshot {snapshot.version}")


def check_patch_state(snapshot_path: str) -> Verdict:
    """Is DDTREE in the snapshot to be served? (applied / pristine / drifted / outdated, by
    `patch`)."""
    from pathlib import Path

    from ddtree_cli.patching import engine
    from ddtree_cli.patching.snapshot import detect

    try:
        result = engine.check(detect(Path(snapshot_path)))
    except DdtreeError as exc:
        return failed("snapshot.patch", str(exc), exc.hint or "")
    state = result.state.value
    where = f"{snapshot_path} (SGLang {result.snapshot.version})"
    if state == "applied":
        return passed("snapshot.patch", f"DDTREE applied to {where}")
    if state == "pristine":
        return failed(
            "snapshot.patch",
            f"{where} is pristine: no DDTREE in it",
            f"ddtree patch {snapshot_path}",
        )
    if state == "outdated":
        older = [f.path for f in result.files if f.state.value == "outdated"]
        return warned(
            "snapshot.patch",
            f"{where} carries DDTREE as another version of ddtree patched it ("
            + ", ".join(older[:3])
            + (" …" if len(older) > 3 else "")
            + " differ from this version's series)",
            f"ddtree patch {snapshot_path}",
        )
    drifted = [f"{f.path}: {f.detail}" for f in result.files if f.state.value == "drifted"]
    return failed(
        "snapshot.patch",
        f"{where} has drifted: " + "; ".join(drifted[:3]) + (" …" if len(drifted) > 3 else ""),
        f"ddtree patch {snapshot_path} --revert (or start from a fresh copy), then ddtree patch",
    )
