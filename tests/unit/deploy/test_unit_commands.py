"""read_unit: the command, environment and directory of a rendered unit, for starting it by
hand where there is no systemd (the inverse of the rendering's quoting)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ddtree_cli.deploy.config import MultiNodeConfig, RouterConfig, load_deploy_config
from ddtree_cli.deploy.units import (
    NodeRole,
    launch_argv,
    read_unit,
    render_router_unit,
    render_unit,
)
from ddtree_cli.errors import ConfigError
from ddtree_cli.remote.hostspec import HostSpec

REPO = Path(__file__).resolve().parents[3]
SGLANG_CFG = REPO / "configs/deploy.sglang.yaml"

# Any argument a unit can carry: no newline (one ExecStart line), no NUL, no braces (the
# command's {placeholders}).
WORD = st.text(
    st.characters(blacklist_categories=("Cs",), blacklist_characters="\n\r\x00{}"), max_size=12
)


@settings(max_examples=200, deadline=None)
@given(st.lists(WORD, min_size=1, max_size=6))
def test_any_command_comes_back_word_for_word(words):
    cfg = load_deploy_config(REPO / "configs/deploy.embedded.yaml")
    cfg = replace(cfg, launch=replace(cfg.launch, kind="command", command=["{python}", *words]))
    unit = read_unit(render_unit(cfg, HostSpec("h"), "ddtree", "/usr/bin/python3"))
    assert unit.argv == ["/usr/bin/python3", *words]


def test_a_multinode_rank_unit_reads_back_as_its_launch_line():
    cfg = load_deploy_config(SGLANG_CFG)
    cfg = replace(cfg, multinode=MultiNodeConfig(2, "127.0.0.1:5000"), env={"A": "1 %2 $3"})
    host = HostSpec("gpu1", gpus=("GPU-aaaa",), service_port=31001)
    node = NodeRole(1, 2, "127.0.0.1:5000")
    unit = read_unit(render_unit(cfg, host, "ddtree", "/venv/bin/python", node))
    assert unit.argv == launch_argv(cfg, host, "ddtree", "/venv/bin/python", node)
    assert unit.argv[unit.argv.index("--node-rank") + 1] == "1"
    assert unit.env == {
        "PYTHONPATH": "/opt/sglang/ddtree/current", "PYTHONUNBUFFERED": "1",
        "CUDA_DEVICE_ORDER": "PCI_BUS_ID", "CUDA_VISIBLE_DEVICES": "GPU-aaaa", "A": "1 %2 $3",
    }  # fmt: skip
    assert unit.working_directory == "/opt/sglang/ddtree/current"
    assert unit.environment_file == "/etc/ddtree/sglang-ddtree.env"  # secret_env: [HF_TOKEN]


def test_the_router_unit_reads_back_as_the_router_command():
    cfg = load_deploy_config(SGLANG_CFG)
    workers = ["http://127.0.0.1:31000", "http://127.0.0.1:31001"]
    unit = read_unit(render_router_unit(cfg, RouterConfig(host="gpu1"), workers, "/p"))
    assert unit.argv == ["/p", "-m", "sglang_router.launch_router", "--worker-urls", *workers,
                         "--policy", "cache_aware", "--host", "0.0.0.0", "--port", "30080"]  # fmt: skip
    assert unit.env == {} and unit.working_directory is None


@pytest.mark.parametrize(("text", "message"), [
    ("[Service]\nExecStart=/bin/python %h/x\n", "systemd % expansion"),
    ('[Service]\nExecStart=/bin/sh -c "echo $HOME"\n', r"systemd \$ expansion"),
    ("[Service]\nType=exec\n", "no ExecStart"),
    ("[Service]\nExecStart=/bin/a\nExecStart=/bin/b\n", "more than one ExecStart"),
])  # fmt: skip
def test_units_that_cannot_be_started_by_hand_are_refused(text, message):
    with pytest.raises(ConfigError, match=message):
        read_unit(text)
