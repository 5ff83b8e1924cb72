"""The DDTREE/DFLASH crossover map at Qwen3-8B's cost, on patched SGLang, resumable across calls.

    python3 benchmarks/sglang_h200/crossover.py --pieces PIECE_DIR --out OUT   # one call per piece
    python3 benchmarks/sglang_h200/crossover.py --out OUT                      # again until done

Standard library only, like run.py, whose steps it strings together (the bundle is
prepare.py's, with the trained pair; ``contents.json`` names the SGLang release). In order,
each step recorded in ``map/progress.json`` under the state folder so that the next call
resumes where this one stopped (a step that would run past ``--until`` is not started; exit 3
means "call again"). The map's arguments (its arms, budgets, concurrencies, ...) are those of
the first call that names any of them, recorded in ``progress.json``: later calls may leave
them out, and one that names a different value is refused (``settle_map_args``). In order:

1. receive the pieces, install;
2. ``scale``: the trained pair in Qwen3-8B's shape, built here (``ckpt/scaled``);
3. phase A servers, all started at once (from 0.5.14 each once the one before has allocated
   its KV pool: ``run.pool_wait``): the scaled pair's plain, DFLASH and DDTREE at the
   phase-A budgets (the first on base + 2, which ``scaled_pair_gpu.py agree`` reads), and the
   small pair's plain, DFLASH and DDTREE (first budget) on the small base;
4. ``agree``: every arm of the scaled pair against the same arm of the small pair
   (``scaled_pair_gpu.py agree``), then the small pair's servers stop;
5. ``A-cN``: one interleaved ``ddtree bench`` per concurrency: every phase-A DDTREE budget
   (``ddtree-bN`` arms) against DFLASH, plain timed as the reference, ``--prompts-per``
   prompts at that concurrency (``--no-agree``: no small pair and no step 4). Every DDTREE
   server's round timing from ``/server_info`` is kept after each bench as
   ``A-cN.round-timing.json``. ``--auto`` adds ``ddtree-auto``, a DDTREE server started
   with ``--speculative-ddtree-budget auto`` (0.5.13 series only; a v2 release refuses it),
   whose policy state is kept as ``A-cN.auto-policy.json``; ``--graphs 15,auto`` adds
   ``ddtree-b15-graphs`` and ``ddtree-auto-graphs``, the same servers started with
   ``SGLANG_DDTREE_ROUND_GRAPHS=1``, whose round-graph state goes to
   ``A-cN.round-graphs.json``; ``autoh`` adds ``ddtree-auto-graphs-h2``, auto with its
   policy's hysteresis at 0.02 (``SGLANG_DDTREE_BUDGET_POLICY``), its state in
   ``A-cN.auto-graphs-h2-policy.json``, beside ``auto``'s ``A-cN.auto-graphs-policy.json``.
   A server under test (``may_fail``: budget auto, the graph
   servers) that exits at start-up is recorded in ``progress.json`` (``auto_failed``,
   ``auto_failed_ddtree-gauto``, ``start_failed_ddtree-gB``) and the map goes on without
   it. Phase A's servers must fit on the GPU together: five 8B-cost servers do;
6. ``profile-ARM-cN``: SGLang's profiler over 20 decode steps of DFLASH and DDTREE at the
   profile budgets (and the budget-auto server with ``--auto``, and the ``--profile-graphs``
   servers), at each profile
   concurrency (summaries only; the traces are dropped);
7. phase B: the phase-A DDTREE servers stop, the phase-B budgets start (memory: six 8B-cost
   servers do not fit on one H200 with their KV pools and graphs); ``B-cN`` benches them
   against the same DFLASH server, plain timed again unless ``--no-reference-b``.

Memory. SGLang 0.5.13 sizes a KV pool as ``free after load - free at start x (1 -
mem_fraction_static)``: with several 8B servers on one GPU a fraction that leaves room for
the others makes the later ones' pools negative. Every server gets the same
``--mem-fraction-static`` (0.9: the confound guard compares it) and the same
``--max-total-tokens`` cap, so each pool is the cap whatever the order the servers profile
in, and what is left holds every server's graphs. The cap (20000 tokens) holds 32 requests of
64 prompt + 128 new tokens + a 129-token verify window with room to spare.

Results: ``OUT/status.json`` and ``OUT/results.tgz`` (every step's JSON, the bench folders,
server command lines, profile summaries, log excerpts) after every call.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import run  # noqa: E402  (run.py, beside this file)

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]

# Seconds a step may take at most (estimates for the 8B-cost pair on an H200, with margin).
# Starting servers is resumable (they outlive the call), so its estimate is only the launch.
ESTIMATES = {"install": 60, "scale": 150, "servers": 60, "agree": 150, "bench": 240,
             "profile": 60, "phase-b": 60}  # fmt: skip


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def prompts_at(concurrency: int, per: int, floor: int) -> int:
    """Prompts per pass at a concurrency: ``per`` per request in flight (the bench wants at
    least 5), never fewer than ``floor``."""
    return max(floor, per * concurrency)


def commands(state: Path, args, ckpt: str, arms: list[tuple], version: str) -> dict:
    """name -> (port, command) for ``arms`` of (name, arm, budget, port) on ``ckpt``, every
    server with the same flags but the algorithm (and the KV cap: module docstring).
    Every server sleeps when idle: SGLang's scheduler otherwise polls its sockets in a busy
    loop, so the idle servers beside the one a trial runs on keep cores busy, and a round,
    bound by the host at these sizes, then costs what the core it lands on allows (on the
    H200 machine one server's host ops ran 30 % slower than another's in the same run)."""
    flags = ["--max-total-tokens", str(args.max_total_tokens), "--sleep-on-idle"]
    return {name: (port, run.server_cmd(state, arm, ckpt, None, budget, port, args.mem_fraction,
                                        args.max_bs, flags, version))
            for name, arm, budget, port in arms}  # fmt: skip


def servers_for(state: Path, args, budgets: list[int], version: str, auto: bool = False,
                graphs: tuple = ()) -> dict:  # fmt: skip
    """One phase: the scaled pair's plain (not with ``--no-plain``), DFLASH and one DDTREE
    server per budget on base, base + 1, base + 2 + slot (a budget keeps its slot in both
    phases); with ``auto`` also a DDTREE server with ``--speculative-ddtree-budget auto``
    (``ddtree-nauto``) after them;
    then one ``ddtree-gB`` server per entry of ``graphs`` (a budget or ``auto``), the same
    DDTREE server started with ``SGLANG_DDTREE_ROUND_GRAPHS=1`` (the round's draft head and
    tree build replayed from CUDA graphs), so that both run side by side in one bench. The
    ``ddtree-n*`` servers get ``SGLANG_DDTREE_ROUND_GRAPHS=0``: eager in every layout (the
    v1 worker's default is on)."""
    every = args.budgets_a + args.budgets_b
    arms = [] if args.no_plain else [("plain", "plain", None, args.base)]
    arms.append(("dflash", "dflash", None, args.base + 1))
    arms += [(f"ddtree-n{b}", "ddtree", b, args.base + 2 + every.index(b)) for b in budgets]
    if auto:
        arms.append(("ddtree-nauto", "ddtree", "auto", args.base + 2 + len(every)))
    out = commands(state, args, args.ckpt, arms, version)
    graph_arms = [(f"ddtree-g{b}", "ddtree", _budget_of(b), args.base + 3 + len(every) + i)
                  for i, b in enumerate(graphs)]  # fmt: skip
    graph_cmds = commands(state, args, args.ckpt, graph_arms, version)
    for cmds, on in ((out, 0), (graph_cmds, 1)):
        for name, (port, cmd) in cmds.items():
            if name.startswith("ddtree-"):
                switch = _split_switch(name)[1]
                extra = [f"{switch[0]}={switch[2]}"] if switch and switch[0] else []
                out[name] = (port, ["env", f"{GRAPHS_ENV}={on}", *extra, *cmd])
    return out


GRAPHS_ENV = "SGLANG_DDTREE_ROUND_GRAPHS"
VERIFY_ENV = "SGLANG_DDTREE_VERIFY_GRAPHS"
MOVE_ENV = "SGLANG_DDTREE_WINDOW_KV_MOVE"
# A ``--graphs`` entry ``N`` + a letter: budget N once more with one more v2 switch set, as
# its own arm (``ddtree-bN-graphs`` + the suffix). Each: (variable, arm suffix, value, what
# the arm is for, as ``--graphs``'s help says it).
PDL_ENV = "DDTREE_PDL"
POLICY_ENV = "SGLANG_DDTREE_BUDGET_POLICY"
SWITCHES = {
    "v": (VERIFY_ENV, "-verify", "1", "the v2 releases' verify-input graphs, on by default since "
          "the twenty-first GPU run, so that N alone has them too"),
    "m": (MOVE_ENV, "-move", "1", "the v2 accept moves only the accepted rows' KV, on by "
          "default since the twenty-fourth GPU run, so that N alone has it too"),
    "p": (PDL_ENV, "-pdl", "1", "the tree kernels launched with programmatic dependent launch"),
    "c": (None, "-control", None, "two servers of one configuration, the noise floor of output "
          "agreement: a batch's makeup decides bf16 near-ties, and at batch 1 so can the KV the "
          "radix cache kept from earlier batches"),
    "k": (MOVE_ENV, "-movecheck", "check", "both KV moves every round, the pool's result "
          "kept, differences counted in A-cN.kv-move-check.json"),
    "w": (MOVE_ENV, "-poolmove", "0", "the KV pool's own move of every window row, the "
          "default before the twenty-fourth GPU run"),
    "h": (POLICY_ENV, "-h2", "hysteresis=0.02", "the budget policy's hysteresis towards "
          "block - 1 at 0.02 instead of 0.05, beside auto as it is; auto only"),
}  # fmt: skip
# Switches that set the budget policy: for ``auto`` only (a fixed-budget server refuses them).
AUTO_SWITCHES = {"h"}


def _split_switch(text: str) -> tuple[str, tuple[str | None, str, str | None, str] | None]:
    """``15v`` -> (``15``, the ``v`` switch); ``15`` or ``auto`` -> (itself, None)."""
    switch = SWITCHES.get(text[-1:])
    return (text[:-1], switch) if switch else (text, None)


def _graph_budgets(text: str) -> list:
    """``--graphs``: budgets, ``auto``, budgets with a switch letter (``SWITCHES``) and auto
    with a policy switch (``AUTO_SWITCHES``), e.g. ``15,15m,auto,autoh``."""
    out = []
    for x in (x.strip() for x in text.split(",") if x.strip()):
        base, switch = _split_switch(x)
        policy = switch is not None and x[-1] in AUTO_SWITCHES  # autoh: auto only
        if x != "auto" and not (base == "auto" if policy else base.isdigit()):
            letters = "/".join(f"N{k}" for k in SWITCHES if k not in AUTO_SWITCHES)
            autos = "/".join(f"auto{k}" for k in AUTO_SWITCHES)
            raise argparse.ArgumentTypeError(
                f"--graphs: {x!r} is not a budget, {letters}, auto or {autos}"
            )
        out.append(int(x) if x.isdigit() else x)
    return out


def _budget_of(entry) -> int | str:
    """A ``--graphs`` entry's budget: ``15v`` -> 15, ``autoh`` -> ``auto``."""
    if not isinstance(entry, str):
        return entry
    base = _split_switch(entry)[0]
    return base if base == "auto" else int(base)


def arm_of(server: str) -> str:
    """The bench arm of a DDTREE server: ``ddtree-n15`` -> ``ddtree-b15``, ``ddtree-nauto`` ->
    ``ddtree-auto``, ``ddtree-g15`` -> ``ddtree-b15-graphs``, ``ddtree-gauto`` ->
    ``ddtree-auto-graphs``, ``ddtree-g15v`` -> ``ddtree-b15-graphs-verify``, ``ddtree-g15m``
    -> ``ddtree-b15-graphs-move``."""
    kind = server[len("ddtree-")]
    budget, switch = _split_switch(server[len("ddtree-") + 1 :])
    arm = "ddtree-auto" if budget == "auto" else f"ddtree-b{budget}"
    return arm + ("-graphs" if kind == "g" else "") + (switch[1] if switch else "")


def small_servers(state: Path, args, version: str) -> dict:
    """The small (trained) pair's plain, DFLASH and DDTREE at the first phase-A budget on the
    small base, for ``agree``."""
    arms = [(f"small-{arm}", arm, budget, args.small_base + i)
            for i, (arm, budget) in enumerate((("plain", None), ("dflash", None),
                                               ("ddtree", args.budgets_a[0])))]  # fmt: skip
    return commands(state, args, args.small_ckpt, arms, version)


def stop(v: run.Validation, names) -> None:
    for name in names:
        run.stop_server(v.state, name)


def warmup_at(concurrency: int, warmup: str) -> int:
    """Warmup requests per pass at a concurrency: ``warmup`` as a number, or ``"c"``: as
    many as the bench keeps in flight."""
    return concurrency if warmup == "c" else int(warmup)


def bench_step(v: run.Validation, step: str, servers: dict, concurrency: int,
               reference: bool) -> int:  # fmt: skip
    """One interleaved ``ddtree bench`` at one concurrency: every DDTREE server of the phase
    (its arm named by ``arm_of``) against DFLASH, the plain server the lossless check's
    reference (and timed when ``reference``), through the confound guard as
    ``run.guarded_bench`` runs it; with ``--no-plain`` no reference (the arms are checked
    against each other). 124: cut at the call's end."""
    args, state = v.args, v.state
    count = prompts_at(concurrency, args.prompts_per, args.prompts_floor)
    rows = run.load_rows(state, args.prompt_file, count, 64, args.vocab, seed=2)
    dataset = run.write_rows(v.results / f"prompts-c{concurrency}.jsonl", rows)
    output = v.results / step
    urls = [f"{arm_of(n)}=http://127.0.0.1:{port}" for n, (port, _) in servers.items()
            if n.startswith("ddtree-")]  # fmt: skip
    cmd = [sys.executable, "-m", "ddtree_cli", "bench", "--algo", "ddtree", "--baseline", "dflash",
           *[x for u in urls for x in ("--url", u)],
           "--url", f"dflash=http://127.0.0.1:{servers['dflash'][0]}",
           *plain_flags(servers, reference),
           "--dataset", str(dataset), "--num-prompts", str(count),
           "--max-new-tokens", str(args.max_new), "--temperature", "0",
           "--concurrency", str(concurrency), "--trials", str(args.trials),
           "--warmup", str(warmup_at(concurrency, args.warmup)),
           "--json", "--output", str(output)]  # fmt: skip
    return run.guarded_bench(v, step, cmd, run.client_env(state, args.client), margin=15)


def plain_flags(servers: dict, timed: bool) -> list[str]:
    """The bench's ``--reference`` (and ``--time-reference`` when ``timed``) for the phase's
    plain server; none without one (``--no-plain``)."""
    if "plain" not in servers:
        return []
    return ["--reference", f"http://127.0.0.1:{servers['plain'][0]}",
            *(["--time-reference"] if timed else [])]  # fmt: skip


def agree_step(v: run.Validation) -> dict:
    args = v.args
    rows = run.load_rows(v.state, args.prompt_file, args.agree_prompts, 64, args.vocab, seed=1)
    dataset = run.write_rows(v.results / "prompts-agree.jsonl", rows)
    out = v.results / "agree.json"
    cmd = [sys.executable, str(REPO / "benchmarks" / "scaled_pair_gpu.py"), "agree",
           "--prompt-file", str(dataset), "--prompts", str(len(rows)),
           "--max-new", str(args.agree_new), "--out", str(out),
           "--scaled-base", str(args.base), "--small-base", str(args.small_base)]  # fmt: skip
    proc = subprocess.run(cmd, env=run.client_env(v.state, args.client), capture_output=True,
                          text=True, timeout=max(10.0, v.left() - 10))  # fmt: skip
    if proc.returncode:
        raise RuntimeError(f"agree: {proc.stderr[-1500:]}")
    report = json.loads(out.read_text())
    return {arm: {"identical": r["identical"], "diverged": len(r["diverged"]),
                  "max_margin": max((max(d["small_plain_top2_margin"],
                                         d["scaled_plain_top2_margin"])
                                     for d in r["diverged"]), default=None),
                  "accept_length": r.get("accept_length")}
            for arm, r in report["arms"].items()}  # fmt: skip


def profile_step(v: run.Validation, name: str, port: int, concurrency: int) -> dict:
    rows = run.load_rows(v.state, v.args.prompt_file, concurrency, 64, v.args.vocab, seed=3)
    folder = v.results / "profile"
    summary = run.profile_server(port, f"{name}-c{concurrency}", folder, rows, 20, 256,
                                 wait=max(10.0, v.left() - 10))  # fmt: skip
    for trace in folder.glob("*.trace.json*"):  # hundreds of MB at this size; summaries stay
        trace.unlink()
    kernels = summary[0].get("kernel", {}) if summary else {}
    return {"kernel_us": kernels.get("total_us"), "kernels": kernels.get("events")}


def is_auto(server: str) -> bool:
    """A budget-auto server: ``ddtree-nauto``, ``ddtree-gauto``, ``ddtree-gautoh``."""
    return server.startswith("ddtree-") and _budget_of(server[len("ddtree-") + 1 :]) == "auto"


def may_fail(server: str) -> bool:
    """Whether a server may exit at start-up without ending the map: the ones under test
    (budget auto, and every ``--graphs`` server: the v2 releases' round graphs had never run
    on a GPU); plain, DFLASH and the eager budgets are what the map compares against."""
    return is_auto(server) or server.startswith("ddtree-g")


def healthy_but_optional(v: run.Validation, phase_a: dict, small: dict) -> bool:
    """``run.servers_healthy`` over phase A and the small pair, except that a server that
    ``may_fail`` exiting does not end the map: its log's end goes to ``progress.json``
    (``_failed_key``), it leaves ``phase_a`` and the others are waited for."""
    while True:
        try:
            return run.servers_healthy(v, {**phase_a, **small}, margin=20)
        except run.ServerExited as exc:
            gone = [n for n in phase_a if may_fail(n) and not run.server_alive(v.state, n)]
            if not gone:
                raise
            for name in gone:
                v.progress[_failed_key(name)] = str(exc)
                print(json.dumps({_failed_key(name): str(exc)[-1500:]}), flush=True)
                phase_a.pop(name)
            v.save()


def _failed_key(server: str) -> str:
    """``auto_failed`` (``ddtree-nauto``), ``auto_failed_ddtree-gauto`` (and so for every
    other budget-auto server), else ``start_failed_<server>``."""
    if server == "ddtree-nauto":
        return "auto_failed"
    return f"auto_failed_{server}" if is_auto(server) else f"start_failed_{server}"


STATE_KEYS = ("speculative_ddtree_round_timing", "speculative_ddtree_budget_policy",
              "speculative_ddtree_round_graphs")  # fmt: skip


def state_keys(server: str) -> tuple[str, ...]:
    """What a DDTREE server's ``/server_info`` is asked for: every one's round timing, a
    budget-auto server's policy, a ``--graphs`` server's round graphs."""
    timing, policy, graphs = STATE_KEYS
    return (timing, *[policy] * is_auto(server),
            *[graphs] * server.startswith("ddtree-g"))  # fmt: skip


# A v2 ``--graphs`` server's step graphs (the accept, and with ``Nv`` the verify inputs, per
# batch size): kept when its /server_info has them (0.5.13's worker has none).
STEP_KEYS = {"speculative_ddtree_accept_graphs": "accept-graphs",
             "speculative_ddtree_verify_graphs": "verify-graphs",
             "speculative_ddtree_kv_move_check": "kv-move-check"}  # fmt: skip


def ddtree_states(port: int, keys: tuple[str, ...], optional: tuple[str, ...] = ()) -> dict:
    """``key -> value`` for DDTREE entries of one server's ``/server_info`` internal state,
    asked once (``speculative_ddtree_budget_policy``: the budget-auto policy's budget per
    batch bucket, round times and calibration; ``speculative_ddtree_round_timing``: where
    every DDTREE server's rounds spend their host time), each missing one as what the server
    answered instead; each of ``optional`` only where the server has it."""
    try:
        status, info = run.http(f"http://127.0.0.1:{port}/server_info", timeout=30)
    except OSError as exc:
        return {key: {"error": str(exc)} for key in keys}
    ok = status == 200 and isinstance(info, dict)
    state = (info.get("internal_states") or [{}])[0] if ok else {}
    out = {key: state[key] for key in optional if state.get(key) is not None}
    for key in keys:
        out[key] = state.get(key)
        if out[key] is None:
            out[key] = {"error": f"no {key} in /server_info ({status})", "body": str(info)[:2000]}
    return out


def plan(args) -> list[str]:
    steps = ["scale", "servers-a"] + ([] if args.no_agree else ["agree"])
    steps += [f"A-c{c}" for c in args.concurrency]
    profiled = ["dflash", *[f"ddtree-n{b}" for b in args.profile_budgets]]
    profiled += ["ddtree-nauto"] if args.auto else []
    profiled += [f"ddtree-g{b}" for b in args.profile_graphs]
    steps += [f"profile-{n}-c{c}" for c in args.profile_concurrency for n in profiled]
    if args.budgets_b:
        steps += ["servers-b"] + [f"B-c{c}" for c in args.concurrency]
    return steps


def estimate(v: run.Validation, step: str) -> str:
    """The ESTIMATES key for ``step``; a bench's estimate follows the slowest bench done so
    far (x 1.3), so the first one measured sets the pace for the rest."""
    if step[:2] in ("A-", "B-"):
        done = [d["seconds"] for s, d in v.progress["done"].items()
                if s[:2] in ("A-", "B-") and "seconds" in d]  # fmt: skip
        if done:
            v.estimates["bench"] = max(60.0, 1.3 * max(done))
        return "bench"
    if step.startswith("profile-"):
        return "profile"
    return {"servers-a": "servers", "servers-b": "phase-b"}.get(step, step)


def crossover(v: run.Validation) -> int:
    if problem := settle_map_args(v):
        return v.finish(f"refused: {problem}", 2)
    if (code := run.receive_and_install(v)) is not None:
        return code
    if problem := settle_map_args(v):  # none named so far: the defaults, once installed
        return v.finish(f"refused: {problem}", 2)
    args, state = v.args, v.state
    c = run.contents(state)
    if args.prompt_file is None and "heldout" in c.get("prompts", []):
        args.prompt_file = "heldout"
    phase_a = servers_for(state, args, args.budgets_a, c["sglang"], auto=args.auto,
                          graphs=args.graphs)  # fmt: skip
    phase_b = servers_for(state, args, args.budgets_b, c["sglang"])
    small = {} if args.no_agree else small_servers(state, args, c["sglang"])
    for name in [n for n in phase_a if may_fail(n)]:  # exited at start-up in an earlier call
        if v.progress.get(_failed_key(name)):
            phase_a.pop(name)
    v.write("servers.json", {n: {"port": p, "cmd": cmd}
                             for n, (p, cmd) in {**phase_a, **phase_b, **small}.items()})  # fmt: skip
    todo = [s for s in plan(args) if not v.done(s)]
    for step in list(todo):
        if not v.fits(step, estimate(v, step)):
            return v.finish(f"incomplete: {len(todo)} steps left; call again", 3, todo)
        if step == "scale":
            if args.ckpt == "scaled" and not (state / "bundle" / "ckpt" / "scaled").is_dir():
                v.record(step, **run.build_scaled(state, "scaled", args.scale, args.client))
            else:
                v.record(step, built=False, ckpt=args.ckpt)
        elif step == "servers-a":
            run.start_servers(v, {**phase_a, **small}, pool_wait=run.pool_wait(c["sglang"]))
            if not healthy_but_optional(v, phase_a, small):
                return v.finish("incomplete: servers still starting (left running)", 3, todo)
            v.record(step, after_s=run.start_ages(v, {**phase_a, **small}))
        elif step == "agree":
            v.record(step, summary=agree_step(v))
            stop(v, small)
        elif step.startswith(("A-c", "B-c")):
            phase_b_step = step.startswith("B")
            servers = phase_b if phase_b_step else phase_a
            reference = not (phase_b_step and args.no_reference_b)
            began = time.monotonic()
            code = bench_step(v, step, servers, int(step.split("-c")[1]), reference)
            if code == 124:
                return v.finish(f"incomplete: {step} cut at the call's end; call again", 3, todo)
            v.record(step, returncode=code, seconds=round(time.monotonic() - began, 1))
            timing, policy, graphs = STATE_KEYS
            states = {n: ddtree_states(port, state_keys(n), tuple(STEP_KEYS))
                      for n, (port, _) in servers.items() if n.startswith("ddtree")}  # fmt: skip
            v.write(f"{step}.round-timing.json", {n: s[timing] for n, s in states.items()})
            for n, got in states.items():  # A-cN.auto-policy.json, .auto-graphs-policy.json, ...
                if is_auto(n):
                    v.write(f"{step}.{arm_of(n).removeprefix('ddtree-')}-policy.json", got[policy])
            for key, name in ((graphs, "round-graphs"), *STEP_KEYS.items()):
                if any(key in s for s in states.values()):
                    v.write(f"{step}.{name}.json",
                            {n: s[key] for n, s in states.items() if key in s})  # fmt: skip
        elif step.startswith("profile-"):
            name, conc = step.removeprefix("profile-").rsplit("-c", 1)
            if name in phase_a:
                v.record(step, **profile_step(v, name, phase_a[name][0], int(conc)))
            else:  # it exited at start-up
                v.record(step, skipped=_failed_key(name))
        elif step == "servers-b":
            stop(v, [n for n in phase_a if n.startswith("ddtree")] + list(small))
            run.start_servers(v, phase_b, pool_wait=run.pool_wait(c["sglang"]))
            if not run.servers_healthy(v, phase_b, margin=20):
                return v.finish("incomplete: phase B servers still starting", 3, todo)
            v.record(step)
        todo.remove(step)
    return v.finish("done", 0)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The map's arguments, checked (a mistake exits with argparse's one-line error), with
    ``given``: the options this call named (``settle_map_args``)."""
    p = _parser()
    args = p.parse_args(argv)
    _check(p, args)
    quiet = _parser()
    for action in quiet._actions:
        action.default = argparse.SUPPRESS
    args.given = sorted(vars(quiet.parse_args(argv)))
    return args


# Options of one call rather than of the map: where the pieces come from and the results go,
# the call's time, and which map and state it works on.
CALL_OPTIONS = frozenset({"state", "pieces", "out", "until", "map", "given"})


def _comparable(value):
    return json.loads(json.dumps(value))


def settle_map_args(v: run.Validation) -> str | None:
    """Fix a map's arguments once, so that a call that leaves them out resumes the same map.

    The first call that names any map option (everything but ``CALL_OPTIONS``), or, if none
    ever does, the first one past the install, records the map's arguments in
    ``progress.json`` (``args``); every later call takes the recorded value of each option
    it does not name, and is refused (the problem, one line) where it names a different
    one: the servers, arms and steps of a map are those it started with. (A call that left
    them out used to run the defaults on a map started otherwise: five 8B-cost servers on an
    80 GB card, one killed for memory at start-up.)"""
    args = v.args
    named = [k for k in args.given if k not in CALL_OPTIONS]
    recorded = v.progress.get("args")
    if recorded is None:
        if named or v.done("install"):
            v.progress["args"] = {k: _comparable(x) for k, x in vars(args).items()
                                  if k not in CALL_OPTIONS}  # fmt: skip
            v.save()
        return None
    differ = [k for k in named if k in recorded and _comparable(getattr(args, k)) != recorded[k]]
    if differ:
        k = differ[0]
        return (
            f"--{k.replace('_', '-')} {getattr(args, k)!r} differs from map "
            f"{args.map!r}'s {recorded[k]!r} (its arguments are fixed by its first call: "
            "name the same, none, or start another --map)"
        )
    for k, x in recorded.items():
        setattr(args, k, x)
    return None


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--state", default=os.environ.get("DDTREE_H200_STATE", "/tmp/ddtree-h200"))
    p.add_argument("--vocab", type=int, default=260)
    p.add_argument("--pieces", nargs="*", default=[])
    p.add_argument("--out", default="crossover-out")
    p.add_argument(
        "--map",
        default="map",
        help="the state's folder for this map's progress and results: a second map (another "
        "pair, other arms) on the same installed bundle, once the first one's servers are "
        "stopped (run.py stop all)",
    )
    p.add_argument("--until", type=float, default=540)
    p.add_argument("--ckpt", default="scaled", help="the pair to map (default: built by scale)")
    p.add_argument("--small-ckpt", default="trained")
    p.add_argument("--scale", default="qwen3-8b")
    p.add_argument("--client", help="folder holding ddtree_cli (default: the bundle's)")
    p.add_argument("--budgets-a", type=_ints, default=[64, 15, 32])
    p.add_argument("--budgets-b", type=_ints, default=[128])
    p.add_argument(
        "--auto",
        action="store_true",
        help="phase A also benches a DDTREE server with --speculative-ddtree-budget "
        "auto (arm ddtree-auto; SGLang 0.5.13 only)",
    )
    p.add_argument(
        "--graphs",
        type=_graph_budgets,
        default=[],
        help="phase-A DDTREE servers (budgets, or auto) started once more with "
        f"{GRAPHS_ENV}=1 (arms ddtree-bN-graphs, ddtree-auto-graphs; auto on SGLang 0.5.13 "
        "only); "
        + "; ".join(
            (f"auto{k}: auto " if k in AUTO_SWITCHES else f"N{k}: budget N ")
            + (f"with {var}={value}" if var else "once more with no switch")
            + (
                f" (arm ddtree-auto-graphs{suffix}: "
                if k in AUTO_SWITCHES
                else f" (arm ddtree-bN-graphs{suffix}: "
            )
            + f"{what})"
            for k, (var, suffix, value, what) in SWITCHES.items()
        )
        + ", e.g. 15,15m,auto,autoh",
    )
    p.add_argument(
        "--no-agree",
        action="store_true",
        help="no small-pair servers and no agree step (agreement measured before)",
    )
    p.add_argument("--concurrency", type=_ints, default=[1, 8, 16, 32, 4, 2])
    p.add_argument("--profile-concurrency", type=_ints, default=[1, 16])
    p.add_argument(
        "--profile-budgets",
        type=_ints,
        default=None,
        help="phase-A budgets profiled (default: 15 and 64, those of them in phase A)",
    )
    p.add_argument(
        "--profile-graphs",
        type=_graph_budgets,
        default=[],
        help="--graphs servers (budgets, or auto) profiled too, e.g. 64,auto",
    )
    p.add_argument("--prompts-per", type=int, default=5, help="prompts per request in flight")
    p.add_argument("--prompts-floor", type=int, default=8)
    p.add_argument("--trials", type=int, default=5)
    p.add_argument("--max-new", type=int, default=128)
    p.add_argument(
        "--warmup",
        default="1",
        help="unrecorded warmup requests per pass, run together: a number, or 'c' for the "
        "bench's concurrency (every arm meets that batch size before its first trial)",
    )
    p.add_argument("--agree-prompts", type=int, default=100)
    p.add_argument("--agree-new", type=int, default=64)
    p.add_argument("--prompt-file", help="default: the bundle's heldout set")
    p.add_argument("--no-reference-b", action="store_true", help="phase B without plain timed")
    p.add_argument(
        "--no-plain",
        action="store_true",
        help="no plain server: the benches have no --reference and check the arms against "
        "each other only; one server's memory freed (on an 80 GB GPU, DFLASH and two DDTREE "
        "8B-cost servers fit, not with plain beside them). Needs --no-agree",
    )
    p.add_argument("--mem-fraction", type=float, default=0.9)
    p.add_argument("--max-total-tokens", type=int, default=20000)
    p.add_argument("--max-bs", type=int, default=32)
    p.add_argument("--base", type=int, default=30000)
    p.add_argument("--small-base", type=int, default=31000)
    return p


def _check(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.warmup != "c" and not (args.warmup.isdigit()):
        p.error(f"--warmup must be a number of requests or 'c', got {args.warmup!r}")
    if args.no_plain and not args.no_agree:
        p.error("--no-plain needs --no-agree (agree compares with the plain servers)")
    if set(args.budgets_a) & set(args.budgets_b):
        p.error("--budgets-a must share no budget with --budgets-b")
    if not args.budgets_a and not (args.graphs and args.no_agree):
        p.error("--budgets-a may be empty only with --graphs and --no-agree")
    if args.profile_budgets is None:
        args.profile_budgets = [b for b in (15, 64) if b in args.budgets_a]
    if args.profile_concurrency and not set(args.profile_budgets) <= set(args.budgets_a):
        p.error("--profile-budgets must be phase-A budgets")
    if not set(args.profile_graphs) <= set(args.graphs):
        p.error("--profile-graphs must be --graphs entries")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    v = run.Validation(args, folder=args.map, estimates=ESTIMATES)
    try:
        return crossover(v)
    except run.ServerMismatch as exc:  # raised before any server is started
        return v.finish(f"refused: {exc}", 2)
    except Exception as exc:  # whatever broke, the results so far still go back
        import traceback

        traceback.print_exc()
        return v.finish(f"failed: {type(exc).__name__}: {str(exc)[:800]}", 1)


if __name__ == "__main__":
    sys.exit(main())
