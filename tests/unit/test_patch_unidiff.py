"""The unified-diff reader/applier used for patch series (no git needed)."""

from __future__ import annotations

import pytest

from ddtree_cli.patching import unidiff

OLD = "".join(f"line {i}\n" for i in range(1, 21))
NEW = OLD.replace("line 5\n", "line 5\ninserted\n").replace("line 15\n", "changed 15\n")


def test_make_parse_apply_round_trip():
    text = unidiff.make("pkg/a.py", OLD, NEW)
    assert text.startswith("diff --git a/pkg/a.py b/pkg/a.py\n--- a/pkg/a.py\n+++ b/pkg/a.py\n")
    (diff,) = unidiff.parse(text)
    assert diff.path == "pkg/a.py" and not diff.new_file and len(diff.hunks) == 2
    assert unidiff.apply(OLD, diff) == NEW
    assert unidiff.apply(NEW, unidiff.reverse(diff)) == OLD


def test_new_file_and_missing_final_newline():
    text = unidiff.make("pkg/new.py", None, "a\nb")
    assert "new file mode 100644" in text and "\\ No newline at end of file" in text
    (diff,) = unidiff.parse(text)
    assert diff.new_file and unidiff.apply("", diff) == "a\nb"


def test_strict_mode_needs_the_recorded_lines():
    (diff,) = unidiff.parse(unidiff.make("a.py", OLD, NEW))
    shifted = "header\n" + OLD
    with pytest.raises(unidiff.DiffError, match="hunk 1 does not match at line"):
        unidiff.apply(shifted, diff)
    assert unidiff.apply(shifted, diff, fuzzy=True) == "header\n" + NEW


def test_fuzzy_mode_refuses_missing_and_ambiguous_anchors():
    (diff,) = unidiff.parse(unidiff.make("a.py", OLD, NEW))
    with pytest.raises(unidiff.DiffError, match="anchor of hunk 1 not found"):
        unidiff.apply(OLD.replace("line 4\n", "other\n"), diff, fuzzy=True)
    twice = "x\n" * 30 + OLD + OLD
    with pytest.raises(unidiff.DiffError, match="ambiguous"):
        unidiff.apply(twice, diff, fuzzy=True)


def test_truncated_hunk_is_an_error():
    text = unidiff.make("a.py", OLD, NEW)
    with pytest.raises(unidiff.DiffError, match="truncated"):
        unidiff.parse(text.rsplit("\n", 3)[0] + "\n")


def test_fuzzy_mode_refuses_an_ambiguous_anchor_even_at_its_recorded_line():
    (diff,) = unidiff.parse(unidiff.make("a.py", OLD, NEW))
    doubled = OLD + OLD  # hunk 1's context sits at its recorded line and again below
    assert unidiff.apply(doubled, diff).startswith(NEW)  # strict: the recorded line wins
    with pytest.raises(unidiff.DiffError, match="anchor of hunk 1 is ambiguous"):
        unidiff.apply(doubled, diff, fuzzy=True)


def test_unmatched_hunks_lists_every_hunk_that_would_not_apply():
    (diff,) = unidiff.parse(unidiff.make("a.py", OLD, NEW))
    assert unidiff.unmatched_hunks("header\n" + OLD, diff) == []
    broken = OLD.replace("line 4\n", "other\n").replace("line 14\n", "other\n")
    assert unidiff.unmatched_hunks(broken, diff) == [
        "a.py: hunk 1 (anchor not found)",
        "a.py: hunk 2 (anchor not found)",
    ]
    assert unidiff.unmatched_hunks(OLD + OLD, diff) == [
        "a.py: hunk 1 (anchor is ambiguous)",
        "a.py: hunk 2 (anchor is ambiguous)",
    ]
