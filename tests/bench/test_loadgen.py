"""The load generator against the SGLang-format emitter (a stand-in for an SGLang server,
which cannot run here): concurrency, warmup, Poisson arrivals, error-rate stop, the guard."""

from __future__ import annotations

import asyncio
import socket
import statistics
from pathlib import Path

import pytest

from ddtree_cli.bench.client import Endpoint
from ddtree_cli.bench.emitter import Emitter, EmitterConfig
from ddtree_cli.bench.loadgen import PassSpec, _arrival_gaps, run_pass
from ddtree_cli.bench.runner import BenchOptions, prepare
from ddtree_cli.bench.workloads import load_workload
from ddtree_cli.errors import UsageError

SAMPLING = {"max_new_tokens": 12, "temperature": 0.0}


def _pass(spec: PassSpec, n: int, config: EmitterConfig = EmitterConfig()):
    async def go():
        emitter = Emitter(config)
        port = await emitter.start()
        try:
            ep = Endpoint(f"http://127.0.0.1:{port}")
            result = await run_pass(ep, load_workload("chat", n), spec)
            ep.close()
            return result, emitter
        finally:
            await emitter.stop()

    return asyncio.run(go())


def test_concurrency_is_respected_and_warmup_is_not_recorded():
    spec = PassSpec("a", concurrency=3, trial=1, sampling=SAMPLING, warmup=2)
    result, emitter = _pass(spec, 15, EmitterConfig(tokens_per_chunk=2, chunk_interval=0.002))
    assert len(result.records) == 15
    assert all(r["ok"] for r in result.records)
    assert emitter.requests == 15 + 2
    assert emitter.max_in_flight == 3
    assert {r["completion_tokens"] for r in result.records} == {12}
    assert result.throughput()["output_tok_s"] == pytest.approx(15 * 12 / result.wall_s)


def test_poisson_arrivals_are_seeded_with_the_right_mean():
    gaps = _arrival_gaps(4001, rate=20.0, seed=5)
    assert gaps == _arrival_gaps(4001, rate=20.0, seed=5)
    assert gaps[0] == 0.0
    assert statistics.mean(gaps[1:]) == pytest.approx(1 / 20.0, rel=0.06)
    assert _arrival_gaps(3, rate=float("inf"), seed=0) == [0.0, 0.0, 0.0]


def test_open_loop_pass_sends_at_the_given_rate_order():
    spec = PassSpec("a", concurrency=4, trial=1, sampling=SAMPLING, request_rate=200.0, warmup=0)
    result, _ = _pass(spec, 10)
    starts = [r["start_s"] for r in sorted(result.records, key=lambda r: r["index"])]
    assert starts == sorted(starts)
    assert len(result.records) == 10


def test_a_dead_server_stops_the_pass_with_the_reason():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    spec = PassSpec("a", concurrency=1, trial=1, sampling=SAMPLING, warmup=0, max_error_rate=0.2)

    async def go():
        return await run_pass(Endpoint(f"http://127.0.0.1:{port}"), load_workload("chat", 20), spec)

    result = asyncio.run(go())
    assert result.stopped and "5 of 5 requests to arm 'a' failed" in result.stopped
    assert "cannot connect" in result.stopped
    assert len(result.records) == 5  # stopped early, the rest never sent


def test_prompt_guard_and_arm_resolution():
    # Values and combinations of options: usage errors (exit 2), raised before anything runs.
    with pytest.raises(UsageError, match="below 5 x the concurrency 4"):
        prepare(BenchOptions(num_prompts=10, concurrency=[1, 4]))
    # One count per point: each one against its own concurrency, the list as long as theirs.
    with pytest.raises(UsageError, match="10 prompts at concurrency 4 is below 5 x"):
        prepare(BenchOptions(num_prompts=[5, 10], concurrency=[1, 4]))
    with pytest.raises(UsageError, match="--num-prompts 5,20,40 has 3 values but --concurrency "
                       "1,4 has 2"):  # fmt: skip
        prepare(BenchOptions(num_prompts=[5, 20, 40], concurrency=[1, 4]))
    with pytest.raises(UsageError, match="--concurrency 4,1,4 lists 4 twice"):
        prepare(BenchOptions(concurrency=[4, 1, 4]))
    _, prompts = prepare(BenchOptions(num_prompts=[5, 20], concurrency=[1, 4], dataset="math"))
    # The largest count is loaded; the point with N runs its first N, which are exactly the
    # prompts --num-prompts N alone chooses.
    assert [p.id for p in prompts[:5]] == [
        p.id for p in prepare(BenchOptions(num_prompts=5, dataset="math"))[1]
    ]
    assert len(prompts) == 20
    arms, prompts = prepare(BenchOptions(concurrency=[1, 4]))
    assert arms == ["ddtree", "dflash"] and len(prompts) == 20
    arms, _ = prepare(BenchOptions(urls={"ddtree": "http://h:1"}))
    assert arms == ["ddtree"]
    with pytest.raises(UsageError, match="neither --algo"):
        prepare(BenchOptions(urls={"ddtree": "http://h:1", "eagle": "http://h:2"}))
    with pytest.raises(UsageError, match="no algorithm 'eagle'"):
        prepare(BenchOptions(baseline="eagle"))
    with pytest.raises(UsageError, match="--host and --config go together"):
        prepare(BenchOptions(host="gpu1"))
    with pytest.raises(UsageError, match="drop --url"):
        prepare(
            BenchOptions(host="gpu1", config=Path("deploy.yaml"), urls={"ddtree": "http://h:1"})
        )


def test_several_arms_under_test_resolve_in_url_order_with_the_baseline_last():
    urls = {"dflash": "http://h:1", "ddtree-b64": "http://h:3", "ddtree-b15": "http://h:2"}
    arms, _ = prepare(BenchOptions(urls=urls))
    assert arms == ["ddtree-b64", "ddtree-b15", "dflash"]
    # "ddtree-" alone and "ddtreex" are not arms of --algo ddtree.
    for name in ("ddtree-", "ddtreex"):
        with pytest.raises(UsageError, match=f"arm\\(s\\) {name}, which are neither"):
            prepare(BenchOptions(urls={"ddtree": "http://h:1", name: "http://h:2"}))
    with pytest.raises(UsageError, match="--time-reference needs --reference"):
        prepare(BenchOptions(urls={"ddtree": "http://h:1"}, time_reference=True))


def test_host_without_config_exits_2_with_one_line():
    import subprocess
    import sys

    res = subprocess.run(
        [sys.executable, "-m", "ddtree_cli", "bench", "--host", "gpu1", "--json"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 2, res.stderr
    assert "--host and --config go together" in res.stderr and res.stdout == ""


def test_workload_defaults_follow_the_target():
    embedded = BenchOptions().with_defaults()
    assert (embedded.dataset, embedded.num_prompts, embedded.max_new_tokens, embedded.trials) == (
        "stdlib",
        16,
        128,
        5,
    )
    _, prompts = prepare(BenchOptions())
    assert len(prompts) == 16 and all(p.id.startswith("stdlib-") for p in prompts)
    served = BenchOptions(urls={"ddtree": "http://h:1"}).with_defaults()
    assert (served.dataset, served.num_prompts, served.max_new_tokens, served.trials) == (
        "code",
        5,
        16,
        3,
    )
    # The steady-state guard sets the floor at each point of a sweep, which gets what a run
    # at that concurrency alone would get; one count when they agree. Given values always win.
    assert BenchOptions(concurrency=[1, 8]).with_defaults().num_prompts == [16, 40]
    assert BenchOptions(concurrency=[1, 2]).with_defaults().num_prompts == 16
    served_sweep = BenchOptions(urls={"ddtree": "http://h:1"}, concurrency=[1, 2, 8])
    assert served_sweep.with_defaults().num_prompts == [5, 10, 40]
    _, prompts = prepare(served_sweep)
    assert len(prompts) == 40
    given = BenchOptions(dataset="chat", num_prompts=7, max_new_tokens=9, trials=2).with_defaults()
    assert (given.dataset, given.num_prompts, given.max_new_tokens, given.trials) == (
        "chat",
        7,
        9,
        2,
    )


def test_an_unreachable_url_is_a_one_line_error_and_writes_nothing(tmp_path):
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "run"
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "ddtree_cli",
            "bench",
            "--url",
            f"ddtree=http://127.0.0.1:{port}",
            "--baseline",
            "none",
            "--output",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 1
    assert f"arm 'ddtree' at http://127.0.0.1:{port} is not reachable" in res.stderr
    assert "Traceback" not in res.stderr and res.stdout == ""
    assert not out.exists()


def test_url_options_name_their_arms():
    from ddtree_cli.commands.bench import _parse_concurrency, _parse_urls

    assert _parse_urls(["http://h:1"], "ddtree") == {"ddtree": "http://h:1"}
    assert _parse_urls(["dflash=http://h:2", "ddtree=https://h:3"], "ddtree") == {
        "dflash": "http://h:2",
        "ddtree": "https://h:3",
    }
    with pytest.raises(UsageError, match="twice"):
        _parse_urls(["a=http://h:1", "a=http://h:2"], "a")
    with pytest.raises(UsageError, match="expected NAME=http"):
        _parse_urls(["ddtree=h:1"], "ddtree")
    assert _parse_concurrency("1,4,16") == [1, 4, 16]
    with pytest.raises(UsageError):
        _parse_concurrency("1,x")
