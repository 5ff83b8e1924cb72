"""benchmarks/sglang_h200: `serve --tp`, NVLink multicast off in every server's environment,
and deploy's router / multi-node units rendered (units.py) and started by hand (run.py
start-units), as the two-GPU session will do where there is no systemd."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from ddtree_cli.deploy.units import read_unit
from tests.sglang_h200 import HERE, load_script

run = load_script("run")
units = load_script("units")

UUIDS = ("GPU-00000000-1111-2222-3333-444444444444", "GPU-55555555-6666-7777-8888-999999999999")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_inventory(tmp_path: Path, ports: list[int]) -> Path:
    """Two 'hosts' on this machine, one GPU each, as the two-GPU session will describe it."""
    hosts = "\n".join(
        f"  gpu{i}:\n    address: 127.0.0.1\n    gpus: [{uuid}]\n    service_port: {port}"
        for i, (uuid, port) in enumerate(zip(UUIDS, ports, strict=True))
    )
    path = tmp_path / "hosts.yaml"
    path.write_text(f"hosts:\n{hosts}\n")
    return path


def write_config(tmp_path: Path, extra: str, launch: str | None = None) -> Path:
    launch = launch or (
        "launch:\n  kind: sglang\n  model_path: /ckpt/target\n  draft_model_path: /ckpt/draft\n"
        "  num_draft_tokens: 16\n  args: [--tp-size, '2', --page-size, '1']\n"
    )
    path = tmp_path / "deploy.yaml"
    path.write_text(
        f"name: tp2\nsource: {{path: .}}\nremote: {{dir: {tmp_path}/deploy, python: /p}}\n"
        f"server: {{host: 127.0.0.1, port: 30000}}\n{launch}{extra}"
    )
    return path


def run_py(*argv: str) -> subprocess.CompletedProcess:
    """run.py as the GPU session runs it: its own process, which exits while the servers it
    started live on in their sessions."""
    cmd = [sys.executable, str(HERE / "run.py"), *argv]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300)


def render(config: Path, inventory: Path, tmp_path: Path) -> list[dict]:
    out = tmp_path / "units.json"
    argv = ["--config", str(config), "--inventory", str(inventory), "--out", str(out)]
    assert units.main(argv) == 0
    return json.loads(out.read_text())["units"]


# --- serve --tp and the environment ----------------------------------------------------


def test_serve_tp_reaches_the_launched_command_and_its_log(tmp_path):
    # No SGLang here: the launch exits at once, after run.py has written the command it ran.
    state = tmp_path / "state"
    argv = ["--state", str(state), "serve", "ddtree", "--block", "16", "--tp", "2", "--wait", "60"]
    assert run.main(argv) == 1
    log = state / "logs" / "ddtree-random-b16-tp2.log"
    command = log.read_text().splitlines()[0]
    assert command.startswith("$ ") and " --tp-size 2" in command
    assert "No module named" in log.read_text()  # it really ran, and exited


def test_one_gpu_adds_no_flag_and_bad_tp_is_refused():
    assert run.tp_flags(1) == [] and run.tp_tag("random-b16", 1) == "random-b16"
    with pytest.raises(SystemExit, match="at least 1"):
        run.tp_flags(0)


def test_multicast_is_off_whatever_the_caller_set(tmp_path, monkeypatch):
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "1")
    monkeypatch.setenv("NVSHMEM_DISABLE_NVLS", "0")
    env = run.server_env(tmp_path)
    assert {k: env[k] for k in run.MULTICAST_OFF} == {
        "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
        "NVSHMEM_DISABLE_NVLS": "1",
    }  # fmt: skip
    unit = {"env": {"PYTHONPATH": "/rel/current", "NCCL_NVLS_ENABLE": "1", "X": "y"}}
    env = run.unit_env(tmp_path, unit)
    assert env["NCCL_NVLS_ENABLE"] == "0" and env["X"] == "y"
    assert env["PYTHONPATH"].split(os.pathsep)[:2] == [
        "/rel/current",
        str(tmp_path / "bundle" / "snapshot"),
    ]


# --- rendering --------------------------------------------------------------------------


def test_multinode_renders_one_unit_per_rank_with_its_gpu(tmp_path):
    inventory = write_inventory(tmp_path, [31000, 31001])
    config = write_config(tmp_path, "multinode: {nnodes: 2, dist_init_addr: '127.0.0.1:5000'}\n")
    got = render(config, inventory, tmp_path)
    assert [u["role"] for u in got] == ["rank0", "rank1"]
    assert [u["health_url"] for u in got] == ["http://127.0.0.1:31000/health", None]
    for rank, unit in enumerate(got):
        argv = unit["argv"]
        assert argv[:3] == ["/p", "-m", "sglang.launch_server"]
        assert argv[argv.index("--node-rank") + 1] == str(rank)
        assert argv[argv.index("--nnodes") + 1] == "2" and "--tp-size" in argv
        assert argv[argv.index("--dist-init-addr") + 1] == "127.0.0.1:5000"
        assert unit["env"]["CUDA_VISIBLE_DEVICES"] == UUIDS[rank]
        assert unit["working_directory"] == f"{tmp_path}/deploy/current"
        assert unit["argv"] == read_unit(unit["unit"]).argv


def test_router_follows_the_replicas_it_routes_to(tmp_path):
    inventory = write_inventory(tmp_path, [31000, 31001])
    config = write_config(tmp_path, "router: {host: gpu0, port: 30080}\n")
    got = render(config, inventory, tmp_path)
    assert [u["role"] for u in got] == ["replica", "replica", "router"]
    router = got[-1]
    assert router["name"] == "tp2-router"
    assert router["argv"] == [
        "/p", "-m", "sglang_router.launch_router",
        "--worker-urls", "http://127.0.0.1:31000", "http://127.0.0.1:31001",
        "--policy", "cache_aware", "--host", "0.0.0.0", "--port", "30080",
    ]  # fmt: skip
    assert router["health_url"] == "http://127.0.0.1:30080/health"


def test_a_multinode_config_with_the_wrong_host_count_is_one_line(tmp_path, capsys):
    inventory = write_inventory(tmp_path, [31000, 31001])
    config = write_config(tmp_path, "multinode: {nnodes: 3, dist_init_addr: '127.0.0.1:5000'}\n")
    assert units.main(["--config", str(config), "--inventory", str(inventory),
                       "--out", str(tmp_path / "u.json")]) == 2  # fmt: skip
    assert "nnodes is 3 but 2 host(s)" in capsys.readouterr().err
    assert not (tmp_path / "u.json").exists()


# --- starting by hand -------------------------------------------------------------------


@pytest.mark.slow
def test_rendered_units_start_by_hand_with_their_environment(tmp_path):
    """Two replicas started from their rendered ExecStart lines. The server is a stand-in
    (python's http.server, through launch.kind: command): SGLang cannot run on a CPU; what is
    under test is the rendering -> argv -> process path and the environment it gets."""
    ports = [free_port(), free_port()]
    release = tmp_path / "deploy" / "current"
    release.mkdir(parents=True)
    (release / "health").write_text("ok\n")  # GET /health -> 200 from http.server
    launch = ('launch:\n  kind: command\n  command: ["{python}", "-m", "http.server", "{port}", '
              '"--bind", "127.0.0.1"]\n')  # fmt: skip
    config = write_config(tmp_path, "", launch)
    got = render(config, write_inventory(tmp_path, ports), tmp_path)
    # The units name /p as their interpreter; this machine's python stands in for it.
    data = json.loads((tmp_path / "units.json").read_text())
    for unit in data["units"]:
        unit["argv"][0] = sys.executable
    (tmp_path / "units.json").write_text(json.dumps(data))
    state = tmp_path / "state"
    base = ["--state", str(state)]
    try:
        started = run_py(*base, "start-units", str(tmp_path / "units.json"), "--wait", "120")
        assert started.returncode == 0, started.stderr
        for i, unit in enumerate(got):
            pid = int((state / f"unit-{unit['name']}.pid").read_text())
            environ = dict(
                item.split("=", 1)
                for item in Path(f"/proc/{pid}/environ").read_text().split("\0") if "=" in item
            )  # fmt: skip
            assert environ["CUDA_VISIBLE_DEVICES"] == UUIDS[i]
            assert environ["NCCL_NVLS_ENABLE"] == "0"
            assert environ["PYTHONPATH"].startswith(str(release) + os.pathsep)
            assert Path(f"/proc/{pid}/cwd").resolve() == release.resolve()
    finally:
        assert run.main([*base, "stop-units"]) == 0
    assert not list(state.glob("unit-*.pid"))
    for unit in got:
        log = (state / "logs" / f"unit-{unit['name']}.log").read_text()
        assert log.startswith(f"$ {sys.executable} -m http.server")


def test_start_units_refuses_what_it_cannot_start_and_starts_nothing(tmp_path, capsys):
    config = write_config(tmp_path, "")  # remote.dir/current does not exist
    render(config, write_inventory(tmp_path, [31000, 31001]), tmp_path)
    state = tmp_path / "state"
    units_json = str(tmp_path / "units.json")
    assert run.main(["--state", str(state), "start-units", units_json, "--only", "nope"]) == 2
    assert "no unit nope" in capsys.readouterr().err
    assert run.main(["--state", str(state), "start-units", units_json]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert not list(state.glob("unit-*.pid"))


def test_a_unit_that_dies_fails_the_start(tmp_path):
    release = tmp_path / "deploy" / "current"
    release.mkdir(parents=True)
    launch = 'launch:\n  kind: command\n  command: ["{python}", "-c", "raise SystemExit(3)"]\n'
    config = write_config(tmp_path, "", launch)
    render(config, write_inventory(tmp_path, [free_port(), free_port()]), tmp_path)
    data = json.loads((tmp_path / "units.json").read_text())
    for unit in data["units"]:
        unit["argv"][0] = sys.executable
    (tmp_path / "units.json").write_text(json.dumps(data))
    state = tmp_path / "state"
    started = run_py("--state", str(state), "start-units", str(tmp_path / "units.json"))
    assert started.returncode == 1 and "exited with 3" in started.stderr
    assert run.main(["--state", str(state), "stop-units"]) == 0
