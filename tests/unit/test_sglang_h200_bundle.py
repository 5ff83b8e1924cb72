"""benchmarks/sglang_h200: pieces round-trip with sha256 checks, and fair server flags."""

from __future__ import annotations

import json
import tarfile
from pathlib import Path

import pytest

from tests.sglang_h200 import load_script, without_own_ports

prepare = load_script("prepare")
run = load_script("run")


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
    bad = pieces / "bundle.tar.001"
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


def test_trace_summary_lists_the_speculative_workers_python_functions(tmp_path):
    """With Python stacks (SGLang records them by default), a trace summary gives the host
    time of the functions under a ``speculative/`` folder, per function, and no others."""
    import importlib.util

    import torch
    from torch.profiler import ProfilerActivity, profile

    folder = tmp_path / "speculative"
    folder.mkdir()
    (folder / "worker_stand_in.py").write_text(
        "import torch\n\n\ndef accept(a, b):\n    return torch.mm(a, b).relu()\n"
    )
    spec = importlib.util.spec_from_file_location("worker_stand_in", folder / "worker_stand_in.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)

    def elsewhere(a):
        return a.sum()

    a = torch.randn(32, 32)
    with profile(activities=[ProfilerActivity.CPU], with_stack=True) as prof:
        for _ in range(3):
            module.accept(a, a)
        elsewhere(a)
    trace = tmp_path / "stacks.trace.json"
    prof.export_chrome_trace(str(trace))
    summary = run.summarise_trace(trace, top=50)
    rows = summary["py_function"]["top"]
    assert [row["name"].rsplit(": ", 1)[-1] for row in rows] == ["accept"]
    assert rows[0]["count"] == 3 and rows[0]["total_us"] > 0
    assert "/speculative/worker_stand_in.py" in rows[0]["name"]


def test_trace_summary_says_how_long_the_gpu_waited_between_kernels(tmp_path):
    """The GPU's span and idle time from a trace's kernel events (torch.profiler's Chrome
    format: ``ph`` "X", ``cat`` "kernel", ``ts`` and ``dur`` in microseconds). A CPU-only
    machine cannot record kernels, so the events are written out here: two overlapping
    kernels (streams), a gap of 30 us, a kernel inside another one's span."""
    events = [
        {"ph": "X", "cat": "kernel", "name": "a", "ts": 100.0, "dur": 20.0},
        {"ph": "X", "cat": "kernel", "name": "b", "ts": 110.0, "dur": 20.0},  # to 130
        {"ph": "X", "cat": "kernel", "name": "c", "ts": 160.0, "dur": 40.0},  # gap 30
        {"ph": "X", "cat": "kernel", "name": "a", "ts": 170.0, "dur": 10.0},  # inside c
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0.0, "dur": 500.0},
    ]
    trace = tmp_path / "gpu.trace.json"
    trace.write_text(json.dumps({"traceEvents": events}))
    summary = run.summarise_trace(trace)
    assert summary["gpu"] == {"span_us": 100.0, "idle_us": 30.0}
    assert summary["kernel"]["total_us"] == 90.0 and summary["kernel"]["events"] == 4


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


# --- one bundle per SGLang release (--sglang) ----------------------------------------------


@pytest.mark.parametrize("version", sorted(prepare.PIN_LISTS))
def test_each_release_pins_exact_unique_wheels_and_itself(version):
    pins = prepare.release_pins(version)
    names = [p.split("==")[0].lower().replace("_", "-") for p in pins]
    assert all("==" in p for p in pins) and len(names) == len(set(names))
    assert f"sglang=={version}" in pins


def test_the_017_list_carries_the_kernels_that_release_asserts():
    pins = prepare.release_pins("0.5.17")
    for pin in ("sglang-kernel==0.4.5", "flashinfer-python==0.6.15.post1",
                "transformers==5.12.1", "apache-tvm-ffi==0.1.11"):  # fmt: skip
        assert pin in pins
    assert not any(p.startswith(("paramiko==", "cryptography==")) for p in pins)


def test_a_release_without_a_list_is_refused_before_any_work(tmp_path):
    with pytest.raises(SystemExit, match=r"no wheel list for SGLang 0\.5\.99 \(have: 0\.5\.13"):
        prepare.main(["--sglang", "0.5.99", "--out", str(tmp_path / "out")])
    assert not (tmp_path / "out").exists()


# Pins that knowingly differ from the release's own: the 0.5.13 list was measured on an H200
# with soundfile 0.14.0 (0.5.13 pins 0.13.1; soundfile is imported by the realtime/ASR routes
# only), and is kept as it was measured.
OFF_PIN = {("0.5.13", "soundfile")}


@pytest.mark.sglang
@pytest.mark.parametrize("version", sorted(prepare.PIN_LISTS))
def test_pins_satisfy_the_release_requirements(version):
    """Every wheel we pin that the release's own METADATA requires (Requires-Dist of the real
    wheel, markers evaluated for CPython 3.12 on Linux x86_64) is a version it accepts."""
    import zipfile

    from packaging.requirements import Requirement

    from ddtree_cli.errors import DdtreeError
    from ddtree_cli.patching import fetch
    from tests.conftest import require

    try:
        wheel = fetch.download_wheel(version)
    except DdtreeError as exc:
        require(False, f"cannot download sglang {version}: {exc}")
    with zipfile.ZipFile(wheel) as z:
        meta = z.read(next(n for n in z.namelist() if n.endswith(".dist-info/METADATA")))
    env = {"python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux",
           "platform_machine": "x86_64", "platform_system": "Linux", "extra": ""}  # fmt: skip
    ours = dict(p.lower().replace("_", "-").split("==") for p in prepare.release_pins(version))
    checked = 0
    for line in meta.decode().splitlines():
        if not line.startswith("Requires-Dist: "):
            continue
        req = Requirement(line.removeprefix("Requires-Dist: "))
        name = req.name.lower().replace("_", "-")
        if (req.marker and not req.marker.evaluate(env)) or name not in ours:
            continue
        if (version, name) in OFF_PIN:
            assert not req.specifier.contains(ours[name])  # still off: keep the note true
            continue
        assert req.specifier.contains(ours[name], prereleases=True), (name, ours[name], req)
        checked += 1
    assert checked >= 15  # sglang-kernel, flashinfer, transformers, xgrammar, openai, ...


def _zip(path: Path, members: dict[str, bytes]) -> Path:
    import zipfile

    with zipfile.ZipFile(path, "w") as z:
        for name, data in members.items():
            z.writestr(name, data)
        record = "".join(f"{n},sha256=x,{len(d)}\n" for n, d in members.items())
        z.writestr(f"{path.name.split('-')[0]}-{path.name.split('-')[1]}.dist-info/RECORD", record)
    return path


def test_bundle_wheels_drop_what_is_never_loaded_and_slim_the_kernel_on_request(tmp_path):
    """Wheels laid out as sglang-kernel 0.4.5 and xgrammar 0.2.1 are (members listed from the
    real wheels; tiny contents)."""
    import zipfile

    kernel = _zip(tmp_path / "sglang_kernel-0.4.5-cp310-abi3-manylinux2014_x86_64.whl", {
        "sgl_kernel/__init__.py": b"", "sgl_kernel/sm90/common_ops.abi3.so": b"90",
        "sgl_kernel/sm100/common_ops.abi3.so": b"100", "sgl_kernel/flash_ops.abi3.so": b"fa3",
        "sgl_kernel/flashmla_ops.abi3.so": b"mla", "sgl_kernel/spatial_ops.abi3.so": b"sp",
        "sgl_kernel/infllm_ops.cpython-310-x86_64-linux-gnu.so": b"inf"})  # fmt: skip
    xgrammar = _zip(tmp_path / "xgrammar-0.2.1-cp312-cp312-manylinux_2_28_x86_64.whl", {
        "xgrammar/__init__.py": b"", "xgrammar/libxgrammar_bindings.so": b"b",
        "xgrammar/lib/libxgrammar.a": b"static"})  # fmt: skip
    other = _zip(tmp_path / "dill-0.4.1-py3-none-any.whl", {"dill/__init__.py": b""})

    def members(wheel):
        with zipfile.ZipFile(wheel) as z:
            return {n for n in z.namelist() if not n.endswith("RECORD")}

    full = prepare.bundle_wheels([kernel, xgrammar, other], tmp_path / "w1", slim_kernel=False)
    assert full[0] == kernel and full[2] == other  # nothing to drop: used as downloaded
    assert members(full[1]) == {"xgrammar/__init__.py", "xgrammar/libxgrammar_bindings.so"}
    slim = prepare.bundle_wheels([kernel, xgrammar, other], tmp_path / "w2", slim_kernel=True)
    assert members(slim[0]) == {"sgl_kernel/__init__.py", "sgl_kernel/sm90/common_ops.abi3.so",
                                "sgl_kernel/spatial_ops.abi3.so"}  # fmt: skip
    assert slim[0].name == kernel.name


def test_the_tar_holds_contents_site_snapshot_and_a_client_without_weights(tmp_path):
    site, snap, ckpt = tmp_path / "site", tmp_path / "snap", tmp_path / "ckpt" / "trained"
    (site / "dill").mkdir(parents=True)
    (site / "dill" / "__init__.py").write_text("")
    (site / ".complete").write_text("")
    (snap / "sglang").mkdir(parents=True)
    (snap / "sglang" / "__init__.py").write_text("")
    (snap / "sglang-0.5.17.dist-info").mkdir()
    (snap / "tools").mkdir()  # another top-level folder of the wheel: not packed
    (ckpt / "target").mkdir(parents=True)
    contents = {"sglang": "0.5.17", "patched": True, "checkpoints": ["trained"]}
    tar_path = tmp_path / "bundle.tar.xz"
    prepare.build_tar(tar_path, site, snap, [ckpt], contents)
    with tarfile.open(tar_path, "r:xz") as tar:
        names = tar.getnames()
        packed = json.load(tar.extractfile("contents.json"))
    assert packed == contents
    assert "site/dill/__init__.py" in names and "site/.complete" not in names
    assert "snapshot/sglang/__init__.py" in names and "snapshot/sglang-0.5.17.dist-info" in names
    assert not any(n.startswith("snapshot/tools") for n in names)
    assert "client/ddtree_cli/bench/runner.py" in names and "run.py" in names
    assert not any(n.startswith("client/ddtree_cli/engine/embedded") for n in names)
    state = tmp_path / "state"
    (state / "bundle").mkdir(parents=True)
    with tarfile.open(tar_path) as tar:
        tar.extractall(state / "bundle", filter="data")
    assert run.contents(state) == contents


def test_contents_default_to_the_bundles_before_the_file(tmp_path):
    assert run.contents(tmp_path) == {"sglang": "0.5.13", "patched": True}


@pytest.mark.parametrize(("version", "flag"), [("0.5.13", "--cuda-graph-max-bs"),
                         ("0.5.14", "--cuda-graph-max-bs-decode"),
                         ("0.5.17", "--cuda-graph-max-bs-decode")])  # fmt: skip
def test_the_graph_flag_follows_the_release(tmp_path, version, flag):
    cmds = {arm: run.server_cmd(tmp_path, arm, "trained", None, 64 if arm == "ddtree" else None,
                                30000, 0.2, 8, [], version)
            for arm in ("plain", "dflash", "ddtree")}  # fmt: skip
    for cmd in cmds.values():
        assert cmd[cmd.index(flag) + 1] == "8"
        assert "--cuda-graph-max-bs" not in cmd or flag == "--cuda-graph-max-bs"
        assert "--disable-overlap-schedule" in cmd  # DDTREE refuses overlap; every arm alike
    swapped = [("DFLASH" if a == "DDTREE" else a) for a in cmds["ddtree"][:-2]]
    assert cmds["dflash"] == swapped


def _validate_args(**kw):
    import argparse

    base = {"ckpt": "trained", "block": None, "budgets": [15, 64], "concurrency": ["1", "8"],
            "mem_fraction": 0.18, "max_bs": 8}  # fmt: skip
    return argparse.Namespace(**{**base, **kw})


def test_validation_serves_one_ddtree_per_budget_beside_plain_and_dflash(tmp_path):
    c = {"sglang": "0.5.17", "patched": True}
    servers = run.validation_servers(tmp_path, _validate_args(), c)
    assert list(servers) == ["plain", "dflash", "ddtree-n15", "ddtree-n64"]
    ports = [port for port, _ in servers.values()]
    assert ports == [run.PORTS["plain"] + i for i in range(4)]
    assert ports[:3] == [run.PORTS["plain"], run.PORTS["dflash"], run.PORTS["ddtree"]]

    # Each server's torch.distributed port is its own, fixed, and none is an HTTP port:
    # servers started together no longer draw one from the free ports at the same time.
    nccl = [int(cmd[cmd.index("--nccl-port") + 1]) for _, cmd in servers.values()]
    assert len(set(nccl)) == len(nccl) and not set(nccl) & set(ports)

    plain = without_own_ports(servers["plain"], run)
    for name, (port, cmd) in servers.items():
        # The same flags but the ports, the algorithm and its budget (after plain's flags).
        assert without_own_ports((port, cmd), run)[: len(plain)] == plain
        if name.startswith("ddtree"):
            assert cmd[-2:] == ["--speculative-ddtree-budget", name.removeprefix("ddtree-n")]
    assert run.plan_steps(_validate_args(), c) == [
        "generate", "agree", "bench-n15-c1", "bench-n15-c8", "bench-n64-c1", "bench-n64-c8"]  # fmt: skip
    stock = {"sglang": "0.5.17", "patched": False}
    assert list(run.validation_servers(tmp_path, _validate_args(), stock)) == ["plain", "dflash"]
    assert run.plan_steps(_validate_args(), stock) == ["generate", "agree"]


def test_results_pack_under_the_limit_dropping_records_then_logs(tmp_path):
    import os

    folder = tmp_path / "results"
    (folder / "bench-n64-c1").mkdir(parents=True)
    (folder / "logs").mkdir()
    (folder / "agree.json").write_text("{}")
    (folder / "bench-n64-c1" / "requests.jsonl").write_bytes(os.urandom(300_000))
    (folder / "logs" / "plain.log").write_bytes(os.urandom(300_000))
    dest = tmp_path / "results.tgz"
    for limit, kept in ((10 << 20, 3), (400_000, 2), (100_000, 1)):
        run.pack_results(folder, dest, limit)
        with tarfile.open(dest) as tar:
            files = [m.name for m in tar.getmembers() if m.isfile()]
        assert len(files) == kept and "results/agree.json" in files


def test_the_import_check_names_every_missing_package(tmp_path):
    """Run for real in a subprocess over a snapshot laid out like SGLang's."""
    snap = tmp_path / "bundle" / "snapshot" / "sglang"
    for rel, body in {"__init__.py": "", "srt/__init__.py": "",
                      "srt/entrypoints/__init__.py": "", "srt/managers/__init__.py": "",
                      "srt/entrypoints/http_server.py": "import ddtree_missing_a\n",
                      "srt/managers/scheduler.py": "import json\n",
                      "srt/managers/detokenizer_manager.py": "import ddtree_missing_b\n",
                      }.items():  # fmt: skip
        (snap / rel).parent.mkdir(parents=True, exist_ok=True)
        (snap / rel).write_text(body)
    mods = ("sglang.srt.entrypoints.http_server", "sglang.srt.managers.scheduler",
            "sglang.srt.managers.detokenizer_manager", "sglang.srt.managers.dflash_worker_v2")  # fmt: skip
    out = run.import_check(tmp_path, mods)
    assert out == {
        "sglang.srt.entrypoints.http_server": "ModuleNotFoundError: No module named "
        "'ddtree_missing_a'",
        "sglang.srt.managers.scheduler": "ok",
        "sglang.srt.managers.detokenizer_manager": "ModuleNotFoundError: No module named "
        "'ddtree_missing_b'",
    }  # the other layout's module is skipped, not reported
    (snap / "__init__.py").write_text("import ddtree_missing_c\n")
    assert run.import_check(tmp_path, mods) == {
        "sglang": "ModuleNotFoundError: No module named 'ddtree_missing_c'"}  # fmt: skip


def test_validate_reports_a_failed_install_and_still_writes_its_results(tmp_path):
    """An unpacked bundle whose SGLang does not import: the call ends with the reason, the
    status and the results tar written, and nothing started."""
    bundle = tmp_path / "state" / "bundle"
    (bundle / "snapshot" / "sglang").mkdir(parents=True)
    (bundle / "snapshot" / "sglang" / "__init__.py").write_text("import ddtree_missing_d\n")
    (bundle / "contents.json").write_text(json.dumps({"sglang": "0.5.17", "patched": True}))
    (bundle / ".complete").write_text("x\n")
    out = tmp_path / "out"
    code = run.main(["--state", str(tmp_path / "state"), "validate", "--out", str(out)])
    assert code == 1
    status = json.loads((out / "status.json").read_text())
    assert status["status"].startswith("failed: install") and "ddtree_missing_d" in status["status"]
    with tarfile.open(out / "results.tgz") as tar:
        assert "results/progress.json" in tar.getnames()
    assert not list((tmp_path / "state").glob("*.pid"))
