"""benchmarks/sglang_h200/prepare.py: a cached snapshot patched by another series is redone.

Uses the real 0.5.13 wheel (the patch tests' cache). A snapshot whose patched files no longer
match the series (as after the series changed) must be extracted and patched afresh, not
packed as it is and not refused.
"""

from __future__ import annotations

import pytest

from ddtree_cli.errors import DdtreeError
from ddtree_cli.patching import fetch
from tests.conftest import require
from tests.sglang_h200 import load_script

pytestmark = [pytest.mark.sglang, pytest.mark.slow]


def test_a_snapshot_from_another_series_is_patched_afresh(tmp_path):
    try:
        wheel = fetch.download_wheel("0.5.13")
    except DdtreeError as exc:
        require(False, f"cannot download sglang 0.5.13: {exc}")
    prepare = load_script("prepare")
    root = prepare.patched_snapshot(wheel, tmp_path)
    assert prepare._patch_state(root) == "applied"
    worker = root / "sglang" / "srt" / "speculative" / "ddtree_worker.py"
    patched = worker.read_bytes()
    worker.write_bytes(patched.replace(b"speculative_dflash_block_size", b"stale_name"))
    assert prepare._patch_state(root) == "drifted"

    assert prepare.patched_snapshot(wheel, tmp_path) == root
    assert prepare._patch_state(root) == "applied"
    assert worker.read_bytes() == patched
