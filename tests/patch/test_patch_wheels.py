"""`ddtree patch` on real SGLang release wheels (0.5.13: v1 layout, 0.5.23: v2 layout)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from ddtree_cli.errors import DdtreeError
from ddtree_cli.patching import engine, fetch, series, snapshot
from tests.conftest import require
from tests.patch.conftest import VERSIONS, tree_digest

pytestmark = [pytest.mark.sglang, pytest.mark.slow]


def run_cli(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ddtree_cli", "patch", *args],
        capture_output=True, text=True, timeout=600, cwd=cwd,
    )  # fmt: skip


def git(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@example.com",
           "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@example.com"}  # fmt: skip
    return subprocess.run(
        ["git", *args], cwd=cwd, env=env, capture_output=True, text=True, check=True
    )


def require_git() -> None:
    require(shutil.which("git") is not None, "git is not installed")


@pytest.mark.parametrize("version", VERSIONS)
def test_apply_check_reapply_revert_round_trip(version, snapshot_copy):
    root = snapshot_copy(version)
    before = tree_digest(root)
    snap = snapshot.detect(root)
    assert (snap.version, snap.layout.value) == (version, "v1" if version == "0.5.13" else "v2")

    assert run_cli(str(root), "--check").returncode == 5  # pristine is not "applied"
    applied = run_cli(str(root), "--json")
    assert applied.returncode == 0, applied.stderr
    result = json.loads(applied.stdout)
    touched = set(series.load(version).touched)
    assert set(result["changed"]) == touched
    assert set(result["compiled"]) == touched  # every touched file is Python and compiled
    for rel in touched:  # compile what is on disk, independently of the tool
        compile((root / rel).read_bytes(), rel, "exec", dont_inherit=True)
    assert (root / series.VENDORED_TREE_PATH).read_bytes() == series.vendored_tree_source()

    check = run_cli(str(root), "--check", "--json")
    assert check.returncode == 0, check.stderr
    assert json.loads(check.stdout)["state"] == "applied"

    after_apply = tree_digest(root)
    again = run_cli(str(root), "--json")
    assert again.returncode == 0 and json.loads(again.stdout)["already_applied"] is True
    assert tree_digest(root) == after_apply  # re-applying is a no-op

    reverted = run_cli(str(root), "--revert")
    assert reverted.returncode == 0, reverted.stderr
    assert tree_digest(root) == before  # byte for byte, state folder gone
    assert not (root / ".ddtree").exists()


@pytest.mark.parametrize("version", VERSIONS)
def test_drifted_file_is_refused_and_nothing_changes(version, snapshot_copy):
    root = snapshot_copy(version)
    target = root / "sglang/srt/speculative/spec_info.py"
    target.write_text(target.read_text().replace("DFLASH = auto()", "DFLASH = auto()  # local"))
    before = tree_digest(root)

    out = run_cli(str(root), "--check", "--json")
    assert out.returncode == 5 and json.loads(out.stdout)["state"] == "drifted"
    out = run_cli(str(root))
    assert out.returncode != 0
    message = " ".join(out.stderr.split())  # Rich wraps long lines on a pipe
    assert "does not match SGLang" in message and "spec_info.py" in message
    assert "Traceback" not in out.stderr
    assert tree_digest(root) == before


def _set_version(root: Path, version: str) -> None:
    generated = root / "sglang" / "_version.py"
    text = generated.read_text()
    old = snapshot.detect(root).version
    generated.write_text(text.replace(repr(old), repr(version)).replace(f'"{old}"', f'"{version}"'))


def test_unknown_version_is_refused_with_the_supported_list(snapshot_copy):
    root = snapshot_copy("0.5.23")
    _set_version(root, "0.5.99")
    before = tree_digest(root)
    out = run_cli(str(root))
    assert out.returncode != 0
    message = " ".join(out.stderr.split())
    assert "0.5.99 is not supported" in message
    for version in VERSIONS:
        assert version in message
    assert tree_digest(root) == before


def test_force_matches_anchors_on_an_unknown_version(snapshot_copy):
    root = snapshot_copy("0.5.23")
    _set_version(root, "0.5.99")
    # Shift every hunk of one file: strict line numbers no longer fit, anchors still do.
    spec_info = root / "sglang/srt/speculative/spec_info.py"
    spec_info.write_text("# local header\n# another line\n" + spec_info.read_text())
    result = engine.apply(snapshot.detect(root), force=True)
    assert result.forced and result.series_version == "0.5.23"
    assert "    DDTREE = auto()\n" in spec_info.read_text()
    assert engine.check(snapshot.detect(root), force=True).state is engine.State.APPLIED
    engine.revert(snapshot.detect(root))
    assert spec_info.read_text().startswith("# local header\n")


def test_force_still_refuses_a_missing_anchor(snapshot_copy):
    root = snapshot_copy("0.5.23")
    _set_version(root, "0.5.99")
    spec_registry = root / "sglang/srt/speculative/spec_registry.py"
    spec_registry.write_text(spec_registry.read_text().replace("def is_dflash_family", "def x"))
    before = tree_digest(root)
    with pytest.raises(DdtreeError, match="spec_registry.py: anchor of hunk 1 not found"):
        engine.apply(snapshot.detect(root), force=True)
    assert tree_digest(root) == before


def test_dry_run_prints_the_diff_and_writes_nothing(snapshot_copy):
    root = snapshot_copy("0.5.13")
    before = tree_digest(root)
    out = run_cli(str(root), "--dry-run", "--json")
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert "+    DDTREE = auto()" in data["diff"]
    assert "+++ b/sglang/srt/speculative/ddtree_worker.py" in data["diff"]
    plain = run_cli(str(root), "--dry-run")
    assert plain.returncode == 0 and "diff --git a/sglang/srt/speculative/spec_info.py" in plain.stdout
    assert tree_digest(root) == before


@pytest.mark.parametrize("version", VERSIONS)
def test_export_applies_with_git_apply(version, snapshot_copy, tmp_path):
    require_git()
    ours = snapshot_copy(version, "ours")
    theirs = snapshot_copy(version, "theirs")
    patch_file = tmp_path / "ddtree.patch"
    assert run_cli(str(ours), "--export", str(patch_file)).returncode == 0
    engine.apply(snapshot.detect(ours))
    git("apply", "--check", str(patch_file), cwd=theirs)
    git("apply", str(patch_file), cwd=theirs)
    for rel in series.load(version).touched:
        assert (theirs / rel).read_bytes() == (ours / rel).read_bytes(), rel
    # A snapshot patched by `git apply` is recognised as applied, and re-applying is a no-op.
    assert engine.check(snapshot.detect(theirs)).state is engine.State.APPLIED
    assert engine.apply(snapshot.detect(theirs)).already_applied


def test_git_checkout_layout(pristine_root, tmp_path):
    require_git()
    checkout = tmp_path / "sglang-checkout"
    shutil.copytree(pristine_root("0.5.23") / "sglang", checkout / "python" / "sglang")
    (checkout / "python" / "sglang" / "_version.py").unlink()  # a checkout has no build file
    git("init", "-q", cwd=checkout)
    git("add", "-A", cwd=checkout)
    git("commit", "-qm", "release", cwd=checkout)
    git("tag", "v0.5.23", cwd=checkout)

    snap = snapshot.detect(checkout)
    assert snap.kind is snapshot.SnapshotKind.GIT and snap.version == "0.5.23"
    assert snapshot.detect(checkout / "python" / "sglang").root == snap.root
    patch_file = tmp_path / "checkout.patch"
    out = run_cli(str(checkout), "--export", str(patch_file))
    assert out.returncode == 0, out.stderr
    assert "+++ b/python/sglang/srt/speculative/spec_info.py" in patch_file.read_text()
    git("apply", "--check", str(patch_file), cwd=checkout)  # from the checkout root

    assert run_cli(str(checkout)).returncode == 0
    status = git("status", "--porcelain", cwd=checkout).stdout
    assert " M python/sglang/srt/speculative/spec_info.py" in status
    assert run_cli(str(checkout / "python" / "sglang"), "--check").returncode == 0
    assert run_cli(str(checkout), "--revert").returncode == 0
    assert git("status", "--porcelain", cwd=checkout).stdout == ""


def test_installed_package_layout(tmp_path):
    wheel = fetch.cached_wheel("0.5.13") or fetch.download_wheel("0.5.13")
    site = tmp_path / "site-packages"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-compile",
         "--disable-pip-version-check", "--target", str(site), str(wheel)],
        check=True, capture_output=True, timeout=600,
    )  # fmt: skip
    package = site / "sglang"
    (package / "_version.py").unlink()  # the version must then come from the dist-info
    before = tree_digest(site)
    snap = snapshot.detect(package)
    assert (snap.version, snap.root) == ("0.5.13", site)
    assert run_cli(str(package)).returncode == 0
    assert run_cli(str(package), "--check").returncode == 0
    assert run_cli(str(package), "--revert").returncode == 0
    assert tree_digest(site) == before


@pytest.mark.parametrize("failure", [OSError("disk full"), KeyboardInterrupt()])
def test_failure_mid_apply_leaves_nothing_changed(failure, snapshot_copy, monkeypatch):
    root = snapshot_copy("0.5.23")
    before = tree_digest(root)
    real_replace = os.replace
    calls = {"n": 0}

    def failing_replace(src, dst):
        calls["n"] += 1
        if calls["n"] == 5:  # after four files are already in place
            raise failure
        return real_replace(src, dst)

    monkeypatch.setattr(engine.os, "replace", failing_replace)
    with pytest.raises(type(failure)):
        engine.apply(snapshot.detect(root))
    monkeypatch.undo()
    assert calls["n"] >= 5
    assert tree_digest(root) == before


def test_fetch_extracts_a_snapshot(pristine_root, tmp_path):
    pristine_root("0.5.13")  # make sure the wheel is cached
    into = tmp_path / "fetched"
    out = run_cli("--fetch", "0.5.13", "--into", str(into), "--json")
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["snapshot"]["version"] == "0.5.13" and data["supported"] is True
    assert tree_digest(into) == tree_digest(pristine_root("0.5.13"))
    again = run_cli("--fetch", "0.5.13", "--into", str(into))
    assert again.returncode != 0 and "not empty" in " ".join(again.stderr.split())
