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


def test_a_ctrl_c_while_the_monitor_stops_is_not_lost():
    """Ctrl-C cancels the bench's main task wherever it waits. If that is in
    ``ClientMonitor.stop()`` (a pass ending), the cancellation must go on up: it used to be
    swallowed with the probe's own, and the run went on to finish every trial and exit 0."""
    import asyncio

    from ddtree_cli.bench.monitor import ClientMonitor

    async def scenario() -> tuple[bool, bool]:
        monitor = ClientMonitor()
        monitor.start()
        await asyncio.sleep(0.02)  # a tick or two measured
        stopping = asyncio.ensure_future(monitor.stop())
        await asyncio.sleep(0)  # stop() has cancelled the probe and waits for it
        stopping.cancel()  # the user's Ctrl-C, right then
        try:
            await stopping
        except asyncio.CancelledError:
            return True, monitor._task.done()
        return False, monitor._task.done()

    cancelled, probe_done = asyncio.run(scenario())
    assert cancelled and probe_done

    async def plain_stop():
        monitor = ClientMonitor()
        monitor.start()
        await asyncio.sleep(0.02)
        return await monitor.stop()

    assert asyncio.run(plain_stop()).wall_s > 0  # an uninterrupted stop still reports
