"""The client's own load: when it warns that it may have coloured a measurement."""

from __future__ import annotations

import pytest

from ddtree_cli.bench.monitor import load_warning, summarize_load


def test_client_load_warnings():
    assert load_warning(0.2, 1.0) is None
    assert "may be the bottleneck" in load_warning(0.95, 1.0)
    assert "25.0 ms late" in load_warning(0.2, 25.0)
    load = summarize_load(cpu_s=0.5, wall_s=1.0, lags_s=[0.001] * 99 + [0.05])
    assert load.cpu_fraction == 0.5 and load.lag_max_ms == pytest.approx(50.0)
