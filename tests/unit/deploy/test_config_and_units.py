"""Deploy config / inventory parsing and unit rendering (pure functions, no hosts)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from ddtree_cli.deploy.config import load_deploy_config, load_inventory
from ddtree_cli.deploy.units import (
    NodeRole,
    launch_argv,
    redact_env_file,
    render_env_file,
    render_router_unit,
    render_unit,
)
from ddtree_cli.errors import ConfigError
from ddtree_cli.remote.hostspec import HostSpec

REPO = Path(__file__).resolve().parents[3]
SGLANG_CFG = REPO / "configs/deploy.sglang.yaml"


def write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_shipped_configs_load():
    embedded = load_deploy_config(REPO / "configs/deploy.embedded.yaml")
    assert embedded.launch.kind == "embedded" and embedded.source == REPO
    sglang = load_deploy_config(SGLANG_CFG)
    assert sglang.secret_env == ["HF_TOKEN"] and sglang.preflight_gpu
    inv = load_inventory(REPO / "configs/hosts.example.yaml")
    assert [h.name for h in inv.select("h200")] == ["gpu1", "gpu2"]
    assert inv.hosts["gpu2"].port == 2222 and inv.hosts["gpu1"].user == "root"


def test_dflash_and_ddtree_differ_only_in_algorithm_flags():
    cfg = load_deploy_config(SGLANG_CFG)
    host = HostSpec("gpu1")
    dflash = launch_argv(cfg, host, "dflash", "/venv/bin/python")
    ddtree = launch_argv(cfg, host, "ddtree", "/venv/bin/python")
    assert dflash[dflash.index("--speculative-algorithm") + 1] == "DFLASH"
    assert ddtree[ddtree.index("--speculative-algorithm") + 1] == "DDTREE"
    strip = {"DFLASH", "DDTREE", "--speculative-ddtree-budget", "15"}
    assert [a for a in dflash if a not in strip] == [a for a in ddtree if a not in strip]
    assert "--disable-overlap-schedule" in dflash and "--disable-overlap-schedule" in ddtree
    assert dflash[:3] == ["/venv/bin/python", "-m", "sglang.launch_server"]


def test_unit_has_the_options_gpu_servers_need():
    cfg = load_deploy_config(SGLANG_CFG)
    host = HostSpec("gpu1", gpus=("GPU-aaaa", "GPU-bbbb"), service_port=31000)
    unit = render_unit(cfg, host, "ddtree", "/opt/sglang/venv/bin/python")
    for line in (
        "Type=exec",
        "TimeoutStartSec=1800",
        "Restart=on-failure",
        "KillMode=control-group",
        "Environment=CUDA_DEVICE_ORDER=PCI_BUS_ID",
        "Environment=CUDA_VISIBLE_DEVICES=GPU-aaaa,GPU-bbbb",
        "EnvironmentFile=/etc/ddtree/sglang-ddtree.env",
        "Environment=PYTHONPATH=/opt/sglang/ddtree/current",
        "WorkingDirectory=/opt/sglang/ddtree/current",
    ):
        assert line in unit.splitlines(), line
    exec_start = next(line for line in unit.splitlines() if line.startswith("ExecStart="))
    assert exec_start.startswith("ExecStart=/opt/sglang/venv/bin/python -m sglang.launch_server")
    assert "--port 31000" in exec_start
    assert "PrivateDevices" not in unit and "DeviceAllow" not in unit
    assert "HF_TOKEN" not in unit.replace("EnvironmentFile", "")


def test_secrets_go_to_env_file_and_are_redacted():
    cfg = load_deploy_config(SGLANG_CFG)
    text = render_env_file(cfg, {"HF_TOKEN": "hf_s3cr3t"})
    assert text == 'HF_TOKEN="hf_s3cr3t"\n'
    assert "s3cr3t" not in redact_env_file(text)
    with pytest.raises(ConfigError, match="HF_TOKEN"):
        render_env_file(cfg, {})


def test_systemd_quoting_of_awkward_arguments(tmp_path):
    cfg = load_deploy_config(
        write(
            tmp_path,
            "d.yaml",
            """
name: q
remote: {python: /usr/bin/python3}
launch:
  kind: command
  command: ["{python}", "-c", "print('a b'); x = '100%' + \\"$HOME\\"", "--port", "{port}"]
""",
        )
    )
    unit = render_unit(cfg, HostSpec("h"), "ddtree", "/usr/bin/python3")
    exec_start = next(line for line in unit.splitlines() if line.startswith("ExecStart="))
    assert exec_start == (
        "ExecStart=/usr/bin/python3 -c \"print('a b'); x = '100%%' + \\\"$$HOME\\\"\" --port 30000"
    )
    assert not cfg.speculative


def test_multinode_and_router_rendering():
    cfg = load_deploy_config(SGLANG_CFG)
    ranks = [
        launch_argv(cfg, HostSpec(f"gpu{r}"), "ddtree", "/p", NodeRole(r, 2, "10.0.0.11:5000"))
        for r in range(2)
    ]
    for rank, argv in enumerate(ranks):
        text = " ".join(argv)
        assert f"--nnodes 2 --node-rank {rank} --dist-init-addr 10.0.0.11:5000" in text
    from ddtree_cli.deploy.config import RouterConfig

    unit = render_router_unit(
        cfg,
        RouterConfig(host="gpu1", port=30080),
        ["http://10.0.0.11:30000", "http://10.0.0.12:30000"],
        "/p",
    )
    assert (
        "ExecStart=/p -m sglang_router.launch_router --worker-urls http://10.0.0.11:30000 "
        "http://10.0.0.12:30000 --policy cache_aware --host 0.0.0.0 --port 30080"
    ) in unit


@pytest.mark.parametrize(
    ("text", "line", "message"),
    [
        (
            "name: x\nremote:\n  python: /p\nlaunch:\n  kind: magic\n",
            5,
            "launch.kind must be one of",
        ),
        (
            "name: x\nremote:\n  python: /p\n  keep_releases: 1\nlaunch: {kind: embedded}\n",
            4,
            "keep_releases",
        ),
        (
            "name: x\nremote: {python: /p}\nlaunch: {kind: embedded}\nserver:\n  port: 70000\n",
            5,
            "port",
        ),
        ("name: x\nremote: {python: /p}\nlaunch: {kind: embedded}\nbogus: 1\n", 4, "unknown key"),
        (
            "name: x\nremote: {python: /p}\nlaunch:\n  kind: embedded\n  args: [--port, '1']\n",
            5,
            "--port",
        ),
        ("name: x\nremote:\n  python: [/p\n", 4, "invalid YAML"),
        (
            "name: x\nremote: {python: /p}\nserver:\n  gpus: ['0']\nlaunch: {kind: embedded}\n",
            4,
            "UUID",
        ),
        (
            "name: x\nremote: {python: /p}\nlaunch:\n  kind: embedded\n  ddtree_budget: autox\n",
            5,
            "launch.ddtree_budget must be a positive integer or 'auto', got 'autox'",
        ),
        (
            "name: x\nremote: {python: /p}\nlaunch:\n  kind: embedded\n  ddtree_budget: 0\n",
            5,
            "launch.ddtree_budget must be at least 1",
        ),
        (
            "name: x\nremote: {python: /p}\nlaunch:\n  kind: embedded\n  ddtree_budget: 15\n"
            "  ddtree_max_budget: 64\n",
            6,
            "launch.ddtree_max_budget applies to launch.ddtree_budget auto only",
        ),
        (
            "name: x\nremote: {python: /p}\nlaunch:\n  kind: sglang\n  model_path: m\n"
            "  draft_model_path: d\n  ddtree_budget: auto\n  ddtree_max_budget: 8\n",
            8,
            "launch.ddtree_max_budget 8 is below launch.num_draft_tokens - 1 (15)",
        ),
        (
            "name: x\nremote: {python: /p}\nlaunch:\n  kind: embedded\n  algo: dflash\n"
            "  ddtree_budget: auto\n",
            6,
            "launch.ddtree_budget applies to algo: ddtree only",
        ),
    ],
)
def test_config_errors_name_file_and_line(tmp_path, text, line, message):
    path = write(tmp_path, "deploy.yaml", text)
    with pytest.raises(ConfigError) as info:
        load_deploy_config(path)
    assert str(info.value).startswith(f"{path}:{line}: "), str(info.value)
    assert message in str(info.value)


@pytest.mark.parametrize(
    ("text", "line", "message"),
    [
        ("hosts:\n  a: {address: x}\n  b:\n    port: nope\n", 4, "hosts.b.port must be an integer"),
        ("hosts:\n  a: {address: x}\ngroups:\n  g:\n    - a\n    - zz\n", 6, "unknown host 'zz'"),
        ("hosts:\n  a: {address: x\n  b: {}\n", 3, "invalid YAML"),
        ("hosts:\n  a: {address: x, colour: red}\n", 2, "unknown key 'hosts.a.colour'"),
        ("hosts:\n  a: x\n  a: y\n", 3, "duplicate key"),
    ],
)
def test_inventory_errors_name_file_and_line(tmp_path, text, line, message):
    path = write(tmp_path, "hosts.yaml", text)
    with pytest.raises(ConfigError) as info:
        load_inventory(path)
    assert str(info.value).startswith(f"{path}:{line}: "), str(info.value)
    assert message in str(info.value)


def test_cli_broken_inventory_is_one_line_with_file_and_line(tmp_path):
    inv = write(tmp_path, "hosts.yaml", "hosts:\n  gpu1:\n    address: 10.0.0.1\n    port: [22\n")
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "ddtree_cli",
            "deploy",
            "--config",
            str(REPO / "configs/deploy.embedded.yaml"),
            "--inventory",
            str(inv),
            "--json",
        ],
        capture_output=True,
        text=True,
        env={**os.environ, "COLUMNS": "400"},
    )
    assert result.returncode == 3
    assert result.stdout == ""
    assert re.search(rf"{re.escape(str(inv))}:\d+: invalid YAML.*at line 4\)", result.stderr)
    assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) <= 2


def test_reading_a_deploy_config_and_an_inventory_loads_no_ssh_library():
    # Config and unit rendering are pure: an operator's YAML is checked without paramiko.
    code = (
        "import sys\n"
        "from ddtree_cli.deploy.config import load_deploy_config, load_inventory\n"
        "from ddtree_cli.deploy.units import render_unit\n"
        "from ddtree_cli.remote.hostspec import HostSpec\n"
        f"cfg = load_deploy_config({str(REPO / 'configs/deploy.sglang.yaml')!r})\n"
        f"load_inventory({str(REPO / 'configs/hosts.example.yaml')!r})\n"
        "render_unit(cfg, HostSpec('gpu1'), 'ddtree', '/usr/bin/python3')\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('paramiko', 'cryptography')))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_budget_auto_reaches_both_launchers(tmp_path):
    """``ddtree_budget: auto`` with a maximum becomes SGLang's flags (the 0.5.13 series
    takes them; newer series refuse auto in one line at start-up) and the embedded
    engine's; DFLASH gets neither."""
    text, n = re.subn(
        r"(?m)^  ddtree_budget: 15\b.*$",
        "  ddtree_budget: auto\n  ddtree_max_budget: 64",
        SGLANG_CFG.read_text(),
    )
    assert n == 1
    cfg = load_deploy_config(write(tmp_path, "deploy.yaml", text))
    host = HostSpec("gpu1")
    ddtree = launch_argv(cfg, host, "ddtree", "/venv/bin/python")
    i = ddtree.index("--speculative-ddtree-budget")
    assert ddtree[i : i + 4] == [
        "--speculative-ddtree-budget", "auto", "--speculative-ddtree-max-budget", "64"]  # fmt: skip
    dflash = launch_argv(cfg, host, "dflash", "/venv/bin/python")
    assert not any(a.startswith("--speculative-ddtree") for a in dflash)
    embedded = load_deploy_config(
        write(
            tmp_path,
            "embedded.yaml",
            "name: x\nremote: {python: /p}\nlaunch:\n  kind: embedded\n"
            "  ddtree_budget: AUTO\n  ddtree_max_budget: 32\n",
        )
    )
    argv = launch_argv(embedded, host, "ddtree", "/p")
    assert argv[argv.index("--budget") :][:4] == ["--budget", "auto", "--max-budget", "32"]
    assert "--budget" not in launch_argv(embedded, host, "dflash", "/p")
