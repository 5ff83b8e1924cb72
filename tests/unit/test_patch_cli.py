"""`ddtree patch` argument handling and snapshot detection errors (no wheels needed)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from ddtree_cli.patching import compare, series


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ddtree_cli", "patch", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_help_lists_every_flag():
    out = run("--help")
    assert out.returncode == 0
    for flag in (
        "--check",
        "--dry-run",
        "--revert",
        "--export",
        "--fetch",
        "--into",
        "--force",
        "--json",
    ):
        assert flag in out.stdout


def test_conflicting_modes_are_a_usage_error(tmp_path):
    out = run(str(tmp_path), "--check", "--revert")
    assert out.returncode == 2 and "cannot be combined" in out.stderr
    out = run(str(tmp_path), "--into", str(tmp_path / "x"))
    assert out.returncode == 2 and "--into only goes with --fetch" in out.stderr


def test_folder_without_sglang_is_refused_in_one_line(tmp_path):
    out = run(str(tmp_path), "--json")
    assert out.returncode == 3 and out.stdout == ""  # an input that cannot be used
    assert "no sglang package found" in out.stderr and "Traceback" not in out.stderr
    out = run(str(tmp_path / "missing"))
    assert out.returncode == 3 and "does not exist" in " ".join(out.stderr.split())


def test_package_without_dflash_is_refused(tmp_path):
    package = tmp_path / "sglang"
    (package / "srt" / "speculative").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "_version.py").write_text("__version__ = version = '0.5.10'\n")
    out = run(str(tmp_path))
    assert out.returncode == 3 and "has no DFlash worker" in " ".join(out.stderr.split())


def test_bad_fetch_version_is_refused(tmp_path):
    out = run("--fetch", "latest; rm -rf /", "--into", str(tmp_path / "x"))
    assert out.returncode == 1 and "not a version" in out.stderr
    assert not (tmp_path / "x").exists()


def test_series_are_shipped_and_consistent():
    shipped = series.supported_versions()
    assert shipped[0] == "0.5.13" and shipped[-1] == "0.5.23"
    for version in shipped:
        s = series.load(version)
        assert s.version == version and s.layout == ("v1" if version == "0.5.13" else "v2")
        assert series.VENDORED_TREE_PATH in s.touched
        assert series.VENDORED_POLICY_PATH in s.touched  # budget auto's policy, carried too
        assert all(len(h) == 64 for h in s.pristine.values())
        assert set(s.diffs) == set(s.pristine)  # hunks only on files the release ships
    # Shipped as package data, so an installed ddtree finds them too.
    root = Path(series.__file__).parent / "series"
    assert sorted(p.name for p in root.iterdir() if (p / "series.json").is_file()) == shipped


def test_added_files_are_written_once_per_layout_family():
    root = Path(series.__file__).parent / "series"
    for release_patch in root.glob("*/release.patch"):
        assert "new file mode" not in release_patch.read_text(), release_patch
    v2 = [series.load(v) for v in series.supported_versions() if series.load(v).layout == "v2"]
    family = series.family_files("v2")
    assert "sglang/srt/speculative/ddtree_worker_v2.py" in family
    assert "sglang/srt/speculative/ddtree_utils.py" in family  # from common/, for v1 too
    assert "sglang/srt/speculative/ddtree_utils.py" in series.family_files("v1")
    for s in v2:
        assert set(s.added) == set(family)


def test_compare_shows_only_what_differs_between_two_releases():
    assert compare.compare("0.5.15", "0.5.15.post1") == [
        "series 0.5.15 (v2) -> series 0.5.15.post1 (v2)"
    ]
    report = compare.compare("0.5.19", "0.5.20")
    # 0.5.20 moved the speculative flags from server_args.py to arg_groups/fields/spec.py
    assert "only 0.5.19: sglang/srt/server_args.py" in report
    assert "only 0.5.20: sglang/srt/arg_groups/fields/spec.py" in report
    assert "sglang/srt/speculative/dflash_worker_v2.py:" in report
    assert not any("spec_registry.py" in line for line in report)  # the same edit in both


def test_compare_cli_refuses_an_unknown_release_in_one_line(capsys):
    assert compare.main(["0.5.19", "9.9"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: SGLang 9.9 is not supported") and err.count("\n") == 1
    assert compare.main(["--help"]) == 0
    assert "python -m ddtree_cli.patching.compare" in capsys.readouterr().out
    assert compare.main(["0.5.19"]) == 2
