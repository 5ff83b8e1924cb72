"""benchmarks/sglang_h200: pieces round-trip with sha256 checks, and fair server flags."""

from __future__ import annotations

import importlib.util
import json
import tarfile
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parents[2] / "benchmarks" / "sglang_h200"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"sglang_h200_{name}", HERE / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


prepare = _load("prepare")
run = _load("run")


def _bundle(tmp_path: Path) -> Path:
    """A small gzipped tar split into 1 MiB pieces, as prepare.py writes it."""
    src = tmp_path / "src"
    (src / "ckpt").mkdir(parents=True)
    (src / "ckpt" / "blob").write_bytes(bytes(range(256)) * 10_000)  # ~2.5 MiB
    (src / "run.py").write_text("print('hi')\n")
    tgz = tmp_path / "bundle.tgz"
    with tarfile.open(tgz, "w:gz", compresslevel=0) as tar:
        tar.add(src / "ckpt", "ckpt")
        tar.add(src / "run.py", "run.py")
    pieces = tmp_path / "pieces"
    pieces.mkdir()
    manifest = prepare.split(tgz, pieces, 1)
    (pieces / "manifest.json").write_text(json.dumps(manifest))
    return pieces


def _args(state: Path, **kw):
    import argparse

    return argparse.Namespace(state=str(state), **kw)


def test_pieces_arrive_one_by_one_and_reassemble(tmp_path):
    pieces = _bundle(tmp_path)
    names = sorted(p for p in pieces.iterdir() if p.name != "manifest.json")
    assert len(names) >= 3 and all(p.stat().st_size <= 1 << 20 for p in names)
    state = tmp_path / "state"
    assert (
        run.cmd_receive(_args(state, sources=[str(pieces / "manifest.json"), str(names[0])])) == 0
    )
    assert run.unpack(state, state / "bundle") == 2  # not all pieces yet: nothing unpacked
    assert not (state / "bundle").exists()
    for piece in names[1:]:
        assert run.cmd_receive(_args(state, sources=[str(piece)])) == 0
    assert run.unpack(state, state / "bundle") == 0
    assert (state / "bundle" / "ckpt" / "blob").read_bytes() == bytes(range(256)) * 10_000
    assert (state / "bundle" / ".complete").is_file()
    assert not (state / "pieces").exists()


def test_a_corrupted_piece_is_refused(tmp_path):
    pieces = _bundle(tmp_path)
    bad = pieces / "bundle.tgz.001"
    data = bytearray(bad.read_bytes())
    data[100] ^= 0xFF
    bad.write_bytes(bytes(data))
    state = tmp_path / "state"
    assert run.cmd_receive(_args(state, sources=[str(pieces / "manifest.json")])) == 0
    assert run.cmd_receive(_args(state, sources=[str(bad)])) == 2
    assert not (state / "pieces" / bad.name).exists()


@pytest.mark.parametrize("block", [None, 16, 33])
def test_arms_differ_only_in_the_algorithm(tmp_path, block):
    cmds = {
        arm: run.server_cmd(
            tmp_path, arm, "random", block, 64 if arm == "ddtree" else None, 30000, 0.25, 8, []
        )  # fmt: skip
        for arm in ("plain", "dflash", "ddtree")
    }
    plain = cmds["plain"]
    for arm in ("dflash", "ddtree"):
        assert cmds[arm][: len(plain)] == plain
        extra = cmds[arm][len(plain) :]
        assert extra[:2] == ["--speculative-algorithm", arm.upper()]
    assert cmds["ddtree"][-2:] == ["--speculative-ddtree-budget", "64"]
    swapped = [("DFLASH" if a == "DDTREE" else a) for a in cmds["ddtree"][:-2]]
    assert cmds["dflash"] == swapped
    for flag in ("--disable-overlap-schedule", "--skip-tokenizer-init", "--page-size"):
        assert flag in plain
    draft = cmds["ddtree"][cmds["ddtree"].index("--speculative-draft-model-path") + 1]
    assert draft.endswith("draft" if block is None else f"draft-b{block}")


def test_pins_are_exact_and_unique():
    pins = prepare.read_pins()
    names = [p.split("==")[0].lower().replace("_", "-") for p in pins]
    assert all("==" in p for p in pins)
    assert len(names) == len(set(names))
    assert "sglang==0.5.13" in pins and "sglang-kernel==0.4.3" in pins


def test_slim_wheel_drops_members_and_their_record_lines(tmp_path):
    import zipfile

    wheel = tmp_path / "k-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr("k/__init__.py", "x = 1\n")
        z.writestr("k/big.so", b"\0" * 1000)
        z.writestr("k-1.0.dist-info/RECORD", "k/__init__.py,sha256=a,6\nk/big.so,sha256=b,1000\n")
    slim = prepare.slim_wheel(wheel, tmp_path / "slim", drop=("k/big.so",))
    with zipfile.ZipFile(slim) as z:
        assert sorted(z.namelist()) == ["k-1.0.dist-info/RECORD", "k/__init__.py"]
        assert z.read("k-1.0.dist-info/RECORD").decode() == "k/__init__.py,sha256=a,6\n"
    assert slim.name == wheel.name


def test_heldout_prompts_come_only_from_heldout_files(tmp_path):
    from ddtree_cli.training.corpus import is_heldout

    names = [f"mod{i}.py" for i in range(200)]
    held = [n for n in names if is_heldout(n)]
    assert held and len(held) < len(names)  # the rule splits this set both ways
    for name in names:
        body = "".join(f"# {name} line {j}\n" for j in range(50))
        (tmp_path / name).write_text(body)
    rows = prepare.heldout_prompts(len(held) * 3, 40, root=tmp_path)
    assert all(len(r) == 40 for r in rows)
    texts = [bytes(r).decode() for r in rows]
    assert {t.split()[1] for t in texts} == set(held)  # every held-out file, nothing else
    assert all(t.startswith("# ") for t in texts)  # windows start at line starts
    assert len(set(texts)) == len(texts)
    with pytest.raises(SystemExit, match="held-out prompts"):
        prepare.heldout_prompts(len(held) * 17, 40, root=tmp_path)


def test_prompt_file_by_path_or_bundle_name(tmp_path):
    rows = [[1, 2, 3], [4, 5], [6]]
    named = tmp_path / "state" / "bundle" / "prompts" / "heldout.jsonl"
    named.parent.mkdir(parents=True)
    named.write_text("".join(json.dumps({"input_ids": r}) + "\n" for r in rows))
    args = _args(tmp_path / "state", prompt_file="heldout", prompts=2, prompt_len=8, vocab=260)
    assert run.prompt_rows(args, seed=1) == rows[:2]
    args.prompt_file = str(named)
    assert run.prompt_rows(args, seed=1) == rows[:2]
    args.prompts = 4
    with pytest.raises(SystemExit, match="3 prompts, 4 asked for"):
        run.prompt_rows(args, seed=1)
    args.prompt_file = None
    random_rows = run.prompt_rows(args, seed=1)
    assert len(random_rows) == 4 and all(len(r) == 8 and max(r) < 260 for r in random_rows)


def test_serve_ddtree_block_16_budget_64_has_its_own_log():
    """The paper's setting next to the default budget on the same draft, logs kept apart."""
    cmd = run.server_cmd(Path("/s"), "ddtree", "random", 16, 64, 30002, 0.2, 8, [])
    assert cmd[cmd.index("--speculative-draft-model-path") + 1].endswith("draft-b16")
    assert cmd[-2:] == ["--speculative-ddtree-budget", "64"]
    tags = {run.log_tag("random", 16, budget) for budget in (None, 8, 15, 64)}
    assert tags == {"random-b16", "random-b16-n8", "random-b16-n15", "random-b16-n64"}
    assert run.log_tag("random", None, None) == "random"


def test_trace_summary_of_a_real_profiler_trace(tmp_path):
    """A Chrome trace written by torch.profiler itself, summarised per op."""
    import gzip

    import torch
    from torch.profiler import ProfilerActivity, profile

    a, b = torch.randn(64, 64), torch.randn(64, 64)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(7):
            torch.mm(a, b)
        torch.relu(a)
    raw = tmp_path / "raw.json"
    prof.export_chrome_trace(str(raw))
    trace = tmp_path / "ddtree-TP-0.trace.json.gz"
    with gzip.open(trace, "wt") as f:
        f.write(raw.read_text())  # SGLang writes gzipped traces
    summary = run.summarise_trace(trace, top=50)
    ops = {row["name"]: row for row in summary["cpu_op"]["top"]}
    assert ops["aten::mm"]["count"] == 7 and ops["aten::relu"]["count"] == 1
    assert ops["aten::mm"]["total_us"] > 0
    assert summary["cpu_op"]["events"] >= 8
    assert summary["cpu_op"]["total_us"] >= ops["aten::mm"]["total_us"]
    assert summary["trace"] == trace.name
    assert "kernel" not in summary  # a CPU-only trace has no GPU kernels


def test_profile_step_drives_sglangs_profiler_api(tmp_path, monkeypatch):
    """`run.py profile` against a stand-in for SGLang's /start_profile and /generate (a real
    SGLang server needs a GPU): the request names the folder and step count, the trace the
    server writes there is found and summarised, and the summary is kept next to it."""
    import gzip
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    seen = {}

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            seen[self.path] = body
            if self.path == "/generate":  # the profiler writes its trace after the steps
                events = [{"ph": "X", "cat": "kernel", "name": "tree_kernel", "dur": 3.0}] * 4
                folder = Path(seen["/start_profile"]["output_dir"])
                with gzip.open(folder / "ddtree-TP-0.trace.json.gz", "wt") as f:
                    json.dump({"traceEvents": events}, f)
                reply = {"output_ids": [1] * 8, "meta_info": {}}
            else:
                reply = {}
            data = json.dumps(reply).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    monkeypatch.setitem(run.PORTS, "ddtree", server.server_address[1])
    try:
        code = run.main(["--state", str(tmp_path / "state"), "profile", "ddtree",
                         "--output", str(tmp_path / "prof"), "--steps", "12",
                         "--max-new", "8", "--wait", "10"])  # fmt: skip
    finally:
        server.shutdown()
    assert code == 0
    start = seen["/start_profile"]
    assert start["num_steps"] == 12 and start["activities"] == ["CPU", "GPU"]
    assert Path(start["output_dir"]) == (tmp_path / "prof").resolve()
    assert seen["/generate"]["sampling_params"]["max_new_tokens"] == 8
    (summary,) = json.loads((tmp_path / "prof" / "summary-ddtree.json").read_text())
    assert summary["kernel"]["top"] == [{"name": "tree_kernel", "total_us": 12.0, "count": 4}]
