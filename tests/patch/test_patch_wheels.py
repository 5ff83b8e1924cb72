"""`ddtree patch` on real SGLang release wheels: every release in tests/patch/releases.json.

Each is patched from an extracted wheel, an installed package folder and a git checkout's
layout, exported for `git apply`, fetched with `--fetch`, and recognised by content."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from ddtree_cli import budget_policy
from ddtree_cli.doctor.snapshot_rules import check_patch_state
from ddtree_cli.patching import engine, fetch, series, snapshot
from tests.conftest import require
from tests.patch.conftest import RELEASES, VERSIONS, tree_digest

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


def test_every_shipped_series_is_in_the_release_table():
    for version in series.supported_versions():
        assert RELEASES[version]["series"] == version
        assert RELEASES[version]["layout"] == series.load(version).layout
    assert {entry["series"] for entry in RELEASES.values()} == set(series.supported_versions())


@pytest.mark.parametrize("version", VERSIONS)
def test_apply_check_reapply_revert_round_trip(version, snapshot_copy):
    expected = RELEASES[version]
    root = snapshot_copy(version)
    before = tree_digest(root)
    snap = snapshot.detect(root)
    assert (snap.version, snap.layout.value) == (version, expected["layout"])

    pristine = run_cli(str(root), "--check", "--json")
    assert pristine.returncode == 5  # pristine is not "applied"
    report = json.loads(pristine.stdout)
    assert report["state"] == "pristine" and report["series"] == expected["series"]
    assert report["match"]["how"] == "content"  # recognised by its files
    applied = run_cli(str(root), "--json")
    assert applied.returncode == 0, applied.stderr
    result = json.loads(applied.stdout)
    assert result["series"] == expected["series"] and result["forced"] is False
    touched = set(series.load(expected["series"]).touched)
    assert set(result["changed"]) == touched
    assert set(result["compiled"]) == touched  # every touched file is Python and compiled
    for rel in touched:  # compile what is on disk, independently of the tool
        compile((root / rel).read_bytes(), rel, "exec", dont_inherit=True)
    assert (root / series.VENDORED_TREE_PATH).read_bytes() == series.vendored_tree_source()
    policy = root / series.VENDORED_POLICY_PATH  # ddtree_cli/budget_policy.py, byte for byte
    assert policy.read_bytes() == Path(budget_policy.__file__).read_bytes()

    check = run_cli(str(root), "--check", "--json")
    assert check.returncode == 0, check.stderr
    report = json.loads(check.stdout)
    assert report["state"] == "applied" and report["series"] == expected["series"]
    assert report["match"]["how"] == "recorded" and report["forced"] is False

    after_apply = tree_digest(root)
    again = run_cli(str(root), "--json")
    assert again.returncode == 0 and json.loads(again.stdout)["already_applied"] is True
    assert tree_digest(root) == after_apply  # re-applying is a no-op

    reverted = run_cli(str(root), "--revert")
    assert reverted.returncode == 0, reverted.stderr
    assert tree_digest(root) == before  # byte for byte, state folder gone
    assert not (root / ".ddtree").exists()


def test_a_release_is_recognised_by_content_not_by_its_version(snapshot_copy):
    # 0.5.13.post1 ships every file the 0.5.13 series touches byte for byte.
    out = run_cli(str(snapshot_copy("0.5.13.post1")), "--check", "--json")
    report = json.loads(out.stdout)
    assert report["snapshot"]["version"] == "0.5.13.post1" and report["series"] == "0.5.13"
    assert report["match"]["how"] == "content"
    assert "byte-identical to 0.5.13's" in report["match"]["why"]
    # A release under a version string nobody knows is still recognised by its files.
    root = snapshot_copy("0.5.17", "renamed")
    _set_version(root, "0.5.17.dev9")
    report = json.loads(run_cli(str(root), "--check", "--json").stdout)
    assert (report["series"], report["match"]["how"]) == ("0.5.17", "content")


@pytest.mark.parametrize("version", sorted(series.supported_versions()))
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


def _unknown_content(snapshot_copy, base: str = "0.5.23") -> Path:
    """A release under an unknown version whose spec_info.py no release shipped: two
    local lines on top shift every hunk, whose anchors still fit."""
    root = snapshot_copy(base)
    _set_version(root, "0.5.99")
    spec_info = root / "sglang/srt/speculative/spec_info.py"
    spec_info.write_text("# local header\n# another line\n" + spec_info.read_text())
    return root


def test_unknown_content_is_refused_with_the_nearest_series_and_nothing_changes(snapshot_copy):
    root = _unknown_content(snapshot_copy)
    before = tree_digest(root)
    out = run_cli(str(root))
    assert out.returncode == 1 and "Traceback" not in out.stderr
    message = " ".join(out.stderr.split())
    assert "0.5.99" in message and "matches no supported release by content" in message
    assert "nearest series 0.5.23: all 31 of its hunks find a unique anchor" in message
    assert "--force applies that series" in message
    assert run_cli(str(root), "--check").returncode == 1
    assert tree_digest(root) == before


def test_force_applies_when_every_anchor_is_unique_and_check_says_forced(snapshot_copy):
    root = _unknown_content(snapshot_copy)
    spec_info = root / "sglang/srt/speculative/spec_info.py"
    before = tree_digest(root)
    out = run_cli(str(root), "--force", "--json")
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["forced"] is True and result["series"] == "0.5.23"
    assert result["match"]["how"] == "forced"
    assert "    DDTREE = auto()\n" in spec_info.read_text()
    check = run_cli(str(root), "--check")
    assert check.returncode == 0
    assert "applied (forced, series 0.5.23)" in " ".join(check.stdout.split())
    report = json.loads(run_cli(str(root), "--check", "--json").stdout)
    assert report["state"] == "applied" and report["forced"] is True
    assert run_cli(str(root), "--revert").returncode == 0
    assert tree_digest(root) == before


def test_force_refuses_a_missing_anchor_and_names_the_hunks(snapshot_copy):
    root = _unknown_content(snapshot_copy)
    spec_registry = root / "sglang/srt/speculative/spec_registry.py"
    spec_registry.write_text(spec_registry.read_text().replace("def is_dflash_family", "def x"))
    before = tree_digest(root)
    for args in ((), ("--force",)):
        out = run_cli(str(root), *args)
        assert out.returncode == 1
        message = " ".join(out.stderr.split())
        assert "nearest series 0.5.23: 1 of its 31 hunks would not apply" in message
        assert "spec_registry.py: hunk 1 (anchor not found)" in message
    assert tree_digest(root) == before


def test_force_refuses_an_ambiguous_anchor(snapshot_copy):
    root = _unknown_content(snapshot_copy)
    spec_registry = root / "sglang/srt/speculative/spec_registry.py"
    text = spec_registry.read_text()
    anchor = series.load("0.5.23").diffs["sglang/srt/speculative/spec_registry.py"].hunks[0]
    spec_registry.write_text(text + "\n" + "".join(anchor.old_lines))  # its context, twice
    before = tree_digest(root)
    out = run_cli(str(root), "--force")
    assert out.returncode == 1
    assert "spec_registry.py: hunk 1 (anchor is ambiguous)" in " ".join(out.stderr.split())
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
    assert (
        plain.returncode == 0 and "diff --git a/sglang/srt/speculative/spec_info.py" in plain.stdout
    )
    assert tree_digest(root) == before


@pytest.mark.parametrize("version", VERSIONS)
def test_export_applies_with_git_apply(version, snapshot_copy, tmp_path):
    require_git()
    touched = series.load(RELEASES[version]["series"]).touched
    ours = snapshot_copy(version, "ours")
    theirs = snapshot_copy(version, "theirs")
    patch_file = tmp_path / "ddtree.patch"
    assert run_cli(str(ours), "--export", str(patch_file)).returncode == 0
    engine.apply(snapshot.detect(ours))
    git("apply", "--check", str(patch_file), cwd=theirs)
    git("apply", str(patch_file), cwd=theirs)
    for rel in touched:
        assert (theirs / rel).read_bytes() == (ours / rel).read_bytes(), rel
    # A snapshot patched by `git apply` is recognised as applied, and re-applying is a no-op.
    assert engine.check(snapshot.detect(theirs)).state is engine.State.APPLIED
    assert engine.apply(snapshot.detect(theirs)).already_applied
    # ... and reverting it without a state folder reverses the diffs to the release.
    reverted = engine.revert(snapshot.detect(theirs))
    assert not reverted.nothing_to_do
    assert tree_digest(theirs) == tree_digest(snapshot_copy(version, "pristine"))


# What an sglang checkout has next to python/sglang/ (its real pyproject is much longer; the
# tool reads neither). The checkout is built from the wheel's files: upstream tags are not
# reachable from the test machines, and the wheel's python files are the tag's.
CHECKOUT_PYPROJECT = """[build-system]
requires = ["setuptools>=61.0", "setuptools-scm>=8.0", "wheel"]
build-backend = "setuptools.build_meta"

[project]
name = "sglang"
dynamic = ["version"]
requires-python = ">=3.10"

[tool.setuptools_scm]
root = ".."
version_file = "sglang/_version.py"
"""


@pytest.mark.parametrize("version", VERSIONS)
def test_git_checkout_layout(version, pristine_root, tmp_path):
    require_git()
    checkout = tmp_path / "sglang-checkout"
    shutil.copytree(pristine_root(version) / "sglang", checkout / "python" / "sglang")
    (checkout / "python" / "sglang" / "_version.py").unlink()  # generated at build time
    (checkout / "python" / "pyproject.toml").write_text(CHECKOUT_PYPROJECT)
    (checkout / ".gitignore").write_text("python/sglang/_version.py\n")
    git("init", "-q", cwd=checkout)
    git("add", "-A", cwd=checkout)
    git("commit", "-qm", "release", cwd=checkout)
    git("tag", f"v{version}", cwd=checkout)

    snap = snapshot.detect(checkout)
    assert snap.kind is snapshot.SnapshotKind.GIT and snap.version == version
    assert snapshot.detect(checkout / "python" / "sglang").root == snap.root
    patch_file = tmp_path / "checkout.patch"
    out = run_cli(str(checkout), "--export", str(patch_file))
    assert out.returncode == 0, out.stderr
    assert "+++ b/python/sglang/srt/speculative/spec_info.py" in patch_file.read_text()
    git("apply", "--check", str(patch_file), cwd=checkout)  # from the checkout root

    applied = run_cli(str(checkout), "--json")
    assert applied.returncode == 0, applied.stderr
    assert json.loads(applied.stdout)["series"] == RELEASES[version]["series"]
    status = git("status", "--porcelain", cwd=checkout).stdout
    assert " M python/sglang/srt/speculative/spec_info.py" in status
    assert run_cli(str(checkout / "python" / "sglang"), "--check").returncode == 0
    assert run_cli(str(checkout), "--revert").returncode == 0
    assert git("status", "--porcelain", cwd=checkout).stdout == ""


@pytest.mark.parametrize("version", VERSIONS)
def test_installed_package_layout(version, pristine_root, tmp_path):
    pristine_root(version)  # downloads the wheel, or skips with the reason
    wheel = fetch.cached_wheel(version)
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
    assert (snap.version, snap.root) == (version, site)
    applied = run_cli(str(package), "--json")
    assert applied.returncode == 0, applied.stderr
    assert json.loads(applied.stdout)["series"] == RELEASES[version]["series"]
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


@pytest.mark.parametrize("version", VERSIONS)
def test_fetch_extracts_a_snapshot(version, pristine_root, tmp_path):
    pristine_root(version)  # make sure the wheel is cached
    into = tmp_path / "fetched"
    out = run_cli("--fetch", version, "--into", str(into), "--json")
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["snapshot"]["version"] == version and data["supported"] is True
    assert data["match"]["series"] == RELEASES[version]["series"]
    assert tree_digest(into) == tree_digest(pristine_root(version))
    again = run_cli("--fetch", version, "--into", str(into))
    assert again.returncode != 0 and "not empty" in " ".join(again.stderr.split())


def _as_patched_by_an_older_series(root: Path) -> None:
    """Make a snapshot patched by this ddtree look as one patched by an earlier version of
    its series would: another worker (a different constant) and one added file fewer, with
    the state folder recording exactly those files, as that ddtree wrote it."""
    state = root / ".ddtree" / "manifest.json"
    manifest = json.loads(state.read_text())
    rel_worker = "sglang/srt/speculative/ddtree_worker.py"
    worker = root / rel_worker
    text = worker.read_bytes()
    assert b"OBSERVE_EVERY = " in text
    older = text.replace(b"OBSERVE_EVERY = ", b"OBSERVE_EVERY = 1 + ", 1)
    worker.write_bytes(older)
    manifest["files"][rel_worker]["after"] = series.sha256(older)
    rel_timing = "sglang/srt/speculative/ddtree_round_timing.py"
    (root / rel_timing).unlink()
    del manifest["files"][rel_timing]
    state.write_text(json.dumps(manifest, indent=2) + "\n")


def test_a_snapshot_patched_by_another_version_of_the_series_is_outdated_and_updated(
    snapshot_copy,
):
    root = snapshot_copy("0.5.13")
    pristine = tree_digest(root)
    assert run_cli(str(root)).returncode == 0
    fresh = tree_digest(root)
    fresh_manifest = json.loads((root / ".ddtree" / "manifest.json").read_text())
    _as_patched_by_an_older_series(root)
    older = tree_digest(root)

    out = run_cli(str(root), "--check", "--json")
    assert out.returncode == 5, out.stderr
    report = json.loads(out.stdout)
    assert report["state"] == "outdated", report
    assert {f["path"] for f in report["files"] if f["state"] == "outdated"} == {
        "sglang/srt/speculative/ddtree_worker.py",
        "sglang/srt/speculative/ddtree_round_timing.py",
    }
    verdict = check_patch_state(str(root))  # doctor: a warning, with the command that fixes it
    assert (verdict.status, verdict.fix) == ("warn", f"ddtree patch {root}"), verdict
    assert "ddtree_worker.py" in verdict.detail
    out = run_cli(str(root), "--dry-run", "--json")
    assert out.returncode == 0 and tree_digest(root) == older
    assert set(json.loads(out.stdout)["files"]) == {
        "sglang/srt/speculative/ddtree_worker.py",
        "sglang/srt/speculative/ddtree_round_timing.py",
    }

    out = run_cli(str(root), "--json")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["updated"] is True
    # Exactly what a fresh patch of the release writes, state folder included, so that
    # --revert still restores the release.
    assert tree_digest(root) == fresh
    assert json.loads((root / ".ddtree" / "manifest.json").read_text()) == fresh_manifest
    assert run_cli(str(root), "--check").returncode == 0
    assert run_cli(str(root), "--revert").returncode == 0
    assert tree_digest(root) == pristine


def test_an_update_cut_at_the_state_swap_leaves_the_older_patch(snapshot_copy, monkeypatch):
    root = snapshot_copy("0.5.13")
    engine.apply(snapshot.detect(root))
    _as_patched_by_an_older_series(root)
    older = tree_digest(root)
    real_replace = os.replace

    def failing_replace(src, dst):
        if Path(dst).name == ".ddtree" and ".ddtree-state-" in Path(src).name:
            raise OSError("disk full")
        return real_replace(src, dst)

    monkeypatch.setattr(engine.os, "replace", failing_replace)
    with pytest.raises(OSError):
        engine.apply(snapshot.detect(root))
    monkeypatch.undo()
    assert tree_digest(root) == older
    assert engine.check(snapshot.detect(root)).state is engine.State.OUTDATED
    # A file edited since (not by ddtree) is drift, whatever the series: never overwritten.
    worker = root / "sglang/srt/speculative/ddtree_worker.py"
    worker.write_bytes(worker.read_bytes() + b"# local\n")
    assert engine.check(snapshot.detect(root)).state is engine.State.DRIFTED
