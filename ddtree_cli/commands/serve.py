"""``ddtree serve``: run the embedded engine behind SGLang's HTTP API."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Annotated

import typer

from ddtree_cli.commands._options import JsonOpt
from ddtree_cli.console import console, emit_json
from ddtree_cli.extras import ENGINE, require

Algo = Annotated[str, typer.Option("--algo", help="Decoding: ar, dflash or ddtree.")]


def serve(
    algo: Algo = "ar",
    budget: Annotated[
        str | None,
        typer.Option(
            help="DDTree node budget per round (default: block size - 1), or 'auto': per "
            "round, the candidate that commits the most tokens per second for the batch."
        ),
    ] = None,
    max_budget: Annotated[
        int | None,
        typer.Option(help="With --budget auto: the largest candidate (default: 4 x block)."),
    ] = None,
    block_size: Annotated[
        int | None, typer.Option(help="Drafter block size (default: the drafter's, 16).")
    ] = None,
    model: Annotated[
        Path | None,
        typer.Option(
            help="Model folder (target/, draft/, ddtree-engine.json), or 'random' for the "
            "fixed-seed random pair. Default: the embedded trained pair."
        ),
    ] = None,
    host: Annotated[str, typer.Option(help="Address to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="TCP port (0: any free port).")] = 30000,
    device: Annotated[str, typer.Option(help="cpu, cuda or cuda:N.")] = "cpu",
    dtype: Annotated[str, typer.Option(help="float32, bfloat16 or float16.")] = "float32",
    max_running_requests: Annotated[
        int, typer.Option(help="Requests decoded together in one batch.")
    ] = 8,
    context_length: Annotated[
        int | None,
        typer.Option(help="Prompt + output tokens per request (default: the model's limit)."),
    ] = None,
    seed: Annotated[
        int, typer.Option(help="Seed of sampling (and of the weights with --model random).")
    ] = 0,
    threads: Annotated[int, typer.Option(help="CPU threads for torch (0: torch's default).")] = 1,
    disable_cuda_graph: Annotated[
        bool,
        typer.Option(
            "--disable-cuda-graph",
            help="On CUDA, run every round eagerly instead of replaying captured graphs.",
        ),
    ] = False,
    json_out: JsonOpt = False,
) -> None:
    """Serve AR, DFlash or DDTree decoding over SGLang's HTTP API until interrupted.

    Endpoints: /generate, /v1/completions, /health, /health_generate, /server_info, /metrics.
    """
    require(ENGINE, "ddtree serve")
    from ddtree_cli.engine.server import ServeOptions, ready_summary, run_forever

    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s")
    opts = ServeOptions(
        algo=algo,
        budget=budget,
        max_budget=max_budget,
        block_size=block_size,
        model=model,
        host=host,
        port=port,
        device=device,
        dtype=dtype,
        max_running_requests=max_running_requests,
        context_length=context_length,
        seed=seed,
        threads=threads,
        cuda_graphs=not disable_cuda_graph,
    )

    def on_ready(server) -> None:
        summary = ready_summary(server)
        if json_out:
            emit_json(summary)
            return
        shape = {
            "ar": "",
            "dflash": f", block {summary['block_size']}",
            "ddtree": f", block {summary['block_size']}, budget {summary['budget']}",
        }[algo]
        if summary["budget_candidates"]:
            shape += f" of {', '.join(map(str, summary['budget_candidates']))}"

        weights = "fixed-seed RANDOM weights" if summary["random_init"] else "trained weights"
        console.print(
            f"ddtree serve: [bold]{summary['url']}[/] ({algo}{shape}; {summary['model']}, "
            f"{weights}, {summary['target_params'] / 1e6:.1f}M params, {summary['device']})"
        )

    run_forever(opts, on_ready)


def register(app: typer.Typer) -> None:
    app.command("serve")(serve)
