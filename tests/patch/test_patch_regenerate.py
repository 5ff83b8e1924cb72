"""The maintainers' command that adds a release, on real wheels."""

from __future__ import annotations

import json
import shutil

import pytest

from ddtree_cli.patching import engine, regenerate, series, snapshot
from tests.patch.conftest import RELEASES

pytestmark = [pytest.mark.sglang, pytest.mark.slow]


def _table(tmp_path):
    table = tmp_path / "releases.json"
    table.write_text(json.dumps({"0.5.13": RELEASES["0.5.13"]}))
    return table


def _work(pristine_root, tmp_path, version):
    """A work folder whose pristine/ is the cached extracted wheel (what regenerate makes)."""
    work = tmp_path / "work"
    shutil.copytree(pristine_root(version), work / "pristine", symlinks=True)
    return work


def test_a_release_with_a_known_series_files_is_recorded_under_that_series(pristine_root, tmp_path):
    table, out = _table(tmp_path), tmp_path / "series-out"
    where, todo = regenerate.regenerate(
        "0.5.13.post1", _work(pristine_root, tmp_path, "0.5.13.post1"), out=out, table=table
    )
    assert todo == [] and where.name == "0.5.13" and not out.exists()
    assert json.loads(table.read_text())["0.5.13.post1"] == {"layout": "v1", "series": "0.5.13"}


def test_porting_by_anchor_writes_the_series_in_one_command(pristine_root, tmp_path):
    # 0.5.15.post1 differs from 0.5.15 in files the series touches, yet every 0.5.15 hunk
    # finds its anchor: the shipped 0.5.15.post1 series came out of this very call.
    table, out = _table(tmp_path), tmp_path / "series-out"
    where, todo = regenerate.regenerate(
        "0.5.15.post1", _work(pristine_root, tmp_path, "0.5.15.post1"),
        out=out, table=table, base="0.5.15",
    )  # fmt: skip
    assert todo == [] and where == out
    shipped = series.series_dir_on_disk("0.5.15.post1")
    for name in ("release.patch", "series.json"):
        assert (out / name).read_text() == (shipped / name).read_text(), name
    assert json.loads(table.read_text())["0.5.15.post1"]["series"] == "0.5.15.post1"


def test_hunks_without_an_anchor_are_listed_and_nothing_is_written(pristine_root, tmp_path):
    table, out = _table(tmp_path), tmp_path / "series-out"
    before = table.read_text()
    edited, todo = regenerate.regenerate(
        "0.5.18", _work(pristine_root, tmp_path, "0.5.18"), out=out, table=table, base="0.5.17"
    )
    assert todo == [
        "ported from series 0.5.17; still to do by hand:",
        "sglang/srt/managers/tokenizer_manager.py: hunk 1 (anchor not found)",
        "sglang/srt/speculative/dflash_worker_v2.py: hunk 3 (anchor not found)",
        "sglang/srt/speculative/spec_utils.py: hunk 1 (anchor not found)",
    ]
    assert not out.exists() and table.read_text() == before
    # The edited tree has the family files and every hunk that did apply.
    assert (edited / "sglang/srt/speculative/ddtree_worker_v2.py").is_file()
    assert "DDTREE = auto()" in (edited / "sglang/srt/speculative/spec_info.py").read_text()


def test_a_finished_tree_gives_back_the_shipped_series(pristine_root, tmp_path):
    work = _work(pristine_root, tmp_path, "0.5.17")
    edited = tmp_path / "edited"
    shutil.copytree(work / "pristine", edited, symlinks=True)
    engine.apply(snapshot.detect(edited))
    shutil.rmtree(edited / ".ddtree")
    out = tmp_path / "series-out"
    where, todo = regenerate.regenerate("0.5.17", work, edited, out=out, table=_table(tmp_path))
    assert todo == [] and where == out
    shipped = series.series_dir_on_disk("0.5.17")
    for name in ("release.patch", "series.json"):
        assert (out / name).read_text() == (shipped / name).read_text(), name
