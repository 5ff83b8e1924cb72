"""``ddtree bench``: A/B of a speculative decoder against a baseline, with statistics."""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich import box
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from ddtree_cli.commands._options import AcceptNewHostKeyOpt, IdentityOpt, JsonOpt, KnownHostsOpt
from ddtree_cli.console import console, emit_json, err_console, warn
from ddtree_cli.errors import UsageError
from ddtree_cli.extras import ENGINE, require

if TYPE_CHECKING:
    from ddtree_cli.bench.summary import Summary


def _parse_urls(values: list[str], algo: str) -> dict[str, str]:
    urls: dict[str, str] = {}
    for value in values:
        name, sep, url = value.partition("=")
        if not sep or "://" in name:
            name, url = algo, value
        if not url.startswith(("http://", "https://")):
            raise UsageError(f"--url {value}: expected NAME=http://HOST:PORT")
        if name in urls:
            raise UsageError(f"--url names arm '{name}' twice")
        urls[name] = url
    return urls


def _ints(text: str) -> list[int] | None:
    """The comma list of integers in ``text`` (blanks skipped); None if one is not one."""
    try:
        return [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        return None


def _parse_concurrency(text: str) -> list[int]:
    values = _ints(text)
    if values is None:
        raise UsageError(f"--concurrency {text}: expected integers like 1,4,16")
    return values


def _parse_num_prompts(text: str | None) -> int | list[int] | None:
    """One count (every point), or a comma list with one count per --concurrency point."""
    if text is None:
        return None
    values = _ints(text)
    if not values:
        raise UsageError(
            f"--num-prompts {text}: expected an integer, or one per concurrency like 10,20,40"
        )
    return values[0] if len(values) == 1 else values


class _RichReporter:
    def __init__(self, progress: Progress | None):
        self.progress = progress
        self.task = None

    def phase(self, text: str) -> None:
        if self.progress is not None:
            self.progress.console.print(f"[dim]{text}[/]")

    def pass_started(self, arm: str, concurrency: int, trial: int, total: int) -> None:
        if self.progress is None:
            return
        if self.task is not None:
            self.progress.remove_task(self.task)
        self.task = self.progress.add_task(
            f"{arm:>8}  concurrency {concurrency}  trial {trial}", total=total
        )

    def request_done(self, record: dict[str, Any]) -> None:
        if self.progress is not None and self.task is not None:
            self.progress.advance(self.task)

    def pass_done(self, result: Any) -> None:
        pass


def _print_summary(summary: Summary) -> None:
    for point in summary.sweep:
        table = Table(
            title=f"concurrency {point.concurrency}  (TTFT/TPOT: p50 ms)",
            title_justify="left",
            box=box.SIMPLE_HEAD,
        )
        for col in ("arm", "tok/s", "95% CI", "req/s", "accept", "TTFT", "TPOT", "errors"):
            table.add_column(col, justify="right" if col != "arm" else "left", no_wrap=True)
        for arm, m in point.arms.items():
            ci = m.output_tok_s_ci95
            table.add_row(
                arm,
                _f(m.output_tok_s, 1),
                f"{_f(ci[0], 0)}–{_f(ci[1], 0)}" if ci else "—",
                _f(m.request_s, 3),
                _f(m.accept_length, 2),
                _f(m.ttft_ms.p50, 1),
                _f(m.tpot_ms.p50, 2),
                f"{m.errors}/{m.requests}",
            )
        console.print(table)
        for arm, comp in summary.compared(point).items():
            e = comp.output_tok_s
            ci = e.ci95 or (math.nan, math.nan)
            style = "bold" if "no clear" not in e.verdict else "yellow"
            console.print(
                f"  {arm}/{summary.baseline} output tok/s: "
                f"{_f(e.ratio, 3)} (95% CI {_f(ci[0], 3)}–{_f(ci[1], 3)}) → "
                f"[{style}]{e.verdict}[/]"
            )
        for arm, comp in (point.over_reference or {}).items():
            e = comp.output_tok_s
            ci = e.ci95 or (math.nan, math.nan)
            console.print(
                f"  {arm}/plain output tok/s: {_f(e.ratio, 3)} "
                f"(95% CI {_f(ci[0], 3)}–{_f(ci[1], 3)}) → {e.verdict}"
            )
    check = summary.lossless
    if check.compared:
        state = "[green]pass[/]" if check.ok else "[red]FAIL[/]"
        console.print(
            f"lossless: {check.compared} outputs compared, {len(check.mismatches)} differ → {state}"
        )
    console.print(f"results: {summary.run_dir}/report.md")


def _f(v: Any, digits: int) -> str:
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "—"
    return f"{v:,.{digits}f}"


def bench(
    algo: Annotated[str, typer.Option(help="The arm under test.")] = "ddtree",
    baseline: Annotated[
        str, typer.Option(help="The arm to compare against; 'none' measures --algo alone.")
    ] = "dflash",
    url: Annotated[
        list[str] | None,
        typer.Option(
            "--url",
            help="A running server: NAME=http://HOST:PORT (repeat per arm). NAME is --algo, "
            "--baseline, or --algo-SUFFIX for several arms under test (ddtree-b15=..., "
            "ddtree-b64=...), each compared with the baseline in the same interleaved trials. "
            "Without --url or --host, one embedded `ddtree serve` per arm runs on 127.0.0.1.",
        ),
    ] = None,
    reference: Annotated[
        str | None,
        typer.Option(help="A plain (non-speculative) server: each arm's divergence from it."),
    ] = None,
    time_reference: Annotated[
        bool,
        typer.Option(
            "--time-reference",
            help="Also time the --reference server in every trial, interleaved with the arms: "
            "each arm's speed-up over plain decoding.",
        ),
    ] = False,
    dataset: Annotated[
        str | None,
        typer.Option(
            help="code, math, chat, stdlib, random, or a .jsonl / ShareGPT .json file "
            "(default: stdlib on the embedded engine, code with --url/--host)."
        ),
    ] = None,
    num_prompts: Annotated[
        str | None,
        typer.Option(
            metavar="N[,N...]",
            help="Prompts per pass: one count for every --concurrency point, or one per point "
            "(--concurrency 1,8,32 --num-prompts 10,40,160); each at least 5 x its "
            "concurrency. Default per point: 16 on the embedded engine, else 5, or 5 x the "
            "concurrency if more.",
        ),
    ] = None,
    max_new_tokens: Annotated[
        int | None,
        typer.Option(help="Output tokens per request (default: 128 embedded, else 16)."),
    ] = None,
    temperature: Annotated[float, typer.Option(help="Sampling temperature.")] = 0.0,
    concurrency: Annotated[
        str, typer.Option(help="Requests in flight; a list sweeps it, e.g. 1,4,16.")
    ] = "1",
    request_rate: Annotated[
        float, typer.Option(help="Poisson arrivals per second (inf: as fast as allowed).")
    ] = math.inf,
    trials: Annotated[
        int | None,
        typer.Option(
            help="Interleaved trials per arm and concurrency (default: 5 embedded, else 3)."
        ),
    ] = None,
    warmup: Annotated[int, typer.Option(help="Unrecorded warmup requests per pass.")] = 1,
    seed: Annotated[int, typer.Option(help="Seed for prompt choice and arm order.")] = 0,
    timeout: Annotated[float, typer.Option(help="Seconds allowed per request.")] = 300.0,
    max_error_rate: Annotated[
        float, typer.Option(help="Stop when this fraction of a pass's requests fail.")
    ] = 0.2,
    output: Annotated[
        Path | None, typer.Option(help="Run folder (default: runs/bench-<UTC time>).")
    ] = None,
    allow_mismatch: Annotated[
        bool,
        typer.Option(
            "--allow-mismatch",
            help="Run even if the arms' /server_info differ in more than the algorithm, or "
            "the replicas behind an arm's router differ among themselves.",
        ),
    ] = False,
    random_input_len: Annotated[int, typer.Option(help="Words per --dataset random prompt.")] = 32,
    model: Annotated[
        Path | None, typer.Option(help="Embedded engine: model folder (default: the trained pair).")
    ] = None,
    budget: Annotated[
        str | None, typer.Option(help="Embedded engine: DDTree budget, a number or 'auto'.")
    ] = None,
    max_budget: Annotated[
        int | None, typer.Option(help="Embedded engine, with --budget auto: the largest budget.")
    ] = None,
    block_size: Annotated[
        int | None, typer.Option(help="Embedded engine: drafter block size.")
    ] = None,
    server_timeout: Annotated[
        float, typer.Option(help="Seconds to wait for servers to become healthy.")
    ] = 300.0,
    host: Annotated[
        str | None,
        typer.Option(
            "--host",
            "-H",
            help="[USER@]HOST[:PORT] whose service (--config) is switched between the arms "
            "through the deploy module: the A/B on identical hardware.",
        ),
    ] = None,
    config: Annotated[
        Path | None, typer.Option(help="With --host: the deploy YAML of that service.")
    ] = None,
    identity: IdentityOpt = None,
    known_hosts: KnownHostsOpt = None,
    accept_new_host_key: AcceptNewHostKeyOpt = False,
    port: Annotated[
        int | None, typer.Option(help="With --host: the service port (default: the config's).")
    ] = None,
    json_out: JsonOpt = False,
) -> None:
    """A/B the arm under test (--algo) against a baseline on the same prompts.

    Interleaved trials, bootstrap confidence intervals, paired tests and a lossless check.
    """
    from ddtree_cli.bench.runner import BenchOptions, run_bench

    opts = BenchOptions(
        algo=algo,
        baseline=baseline,
        urls=_parse_urls(url or [], algo),
        reference=reference,
        time_reference=time_reference,
        dataset=dataset,
        num_prompts=_parse_num_prompts(num_prompts),
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        concurrency=_parse_concurrency(concurrency),
        request_rate=request_rate,
        trials=trials,
        warmup=warmup,
        seed=seed,
        timeout=timeout,
        max_error_rate=max_error_rate,
        output=output,
        allow_mismatch=allow_mismatch,
        random_input_len=random_input_len,
        model=model,
        budget=budget,
        max_budget=max_budget,
        block_size=block_size,
        server_timeout=server_timeout,
        host=host,
        config=config,
        identity=identity,
        known_hosts=known_hosts,
        accept_new_host_key=accept_new_host_key,
        service_port=port,
    )
    if opts.embedded:
        require(ENGINE, "the embedded bench (no --url, no --host)")
    show = not json_out and err_console.is_terminal
    progress = (
        Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=err_console,
            transient=True,
        )
        if show
        else None
    )
    if progress is not None:
        with progress:
            outcome = run_bench(opts, _RichReporter(progress))
    else:
        outcome = run_bench(opts, _RichReporter(None))
    if json_out:
        emit_json(outcome.summary.to_json())
    else:
        for w in outcome.summary.warnings:
            warn(w)
        _print_summary(outcome.summary)
    if outcome.error is not None:
        raise outcome.error


def register(app: typer.Typer) -> None:
    app.command("bench")(bench)
