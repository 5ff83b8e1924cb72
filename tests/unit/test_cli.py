"""The CLI skeleton: entry point, --version, --help, and the error → exit-code translation."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import typer

from ddtree_cli import __main__ as entry
from ddtree_cli import __version__
from ddtree_cli.errors import ConfigError, ExitCode

REPO = Path(__file__).resolve().parents[2]
EMBEDDED_CONFIG = str(REPO / "configs" / "deploy.embedded.yaml")


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ddtree_cli", *args], capture_output=True, text=True, timeout=120
    )


def test_version_flag_prints_the_package_version():
    result = run_cli("--version")
    assert result.returncode == 0
    assert result.stdout.strip() == f"ddtree {__version__}"


def test_help_lists_usage():
    result = run_cli("--help")
    assert result.returncode == 0
    assert "Usage" in result.stdout


def test_unknown_command_is_a_usage_error():
    result = run_cli("no-such-command")
    assert result.returncode == 2


@pytest.mark.parametrize(
    "args",
    [
        ("doctor", "--port", "99999", "--no-probes", "--json"),
        ("deploy", "--config", EMBEDDED_CONFIG, "--host", "h", "--port", "0"),
    ],
)
def test_a_port_outside_1_to_65535_is_a_usage_error(args):
    result = run_cli(*args)
    assert result.returncode == 2 and result.stdout == ""
    assert "is not in the range 1<=x<=65535" in result.stderr


def test_project_error_becomes_one_line_and_its_exit_code(monkeypatch, capsys):
    probe = typer.Typer()

    @probe.command()
    def broken() -> None:
        raise ConfigError("deploy.yaml:3: 'port' must be an integer", hint="write port: 30000")

    monkeypatch.setattr("ddtree_cli.cli.app", probe)
    with pytest.raises(SystemExit) as exc:
        entry.main([])
    assert exc.value.code == ExitCode.CONFIG
    err = capsys.readouterr().err
    assert "deploy.yaml:3: 'port' must be an integer" in err
    assert "Traceback" not in err


def test_long_error_stays_one_line_on_a_pipe():
    code = (
        "import typer\n"
        "from ddtree_cli import __main__ as entry\n"
        "from ddtree_cli.errors import DdtreeError\n"
        "import ddtree_cli.cli as cli\n"
        "probe = typer.Typer()\n"
        "@probe.command()\n"
        "def broken() -> None:\n"
        "    raise DdtreeError('x' * 50 + ' ' + 'y' * 50 + ' ' + 'z' * 50)\n"
        "cli.app = probe\n"
        "entry.main([])\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        env={"COLUMNS": "80", "PATH": "/usr/bin:/bin"},
    )
    assert result.returncode == 1
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr


@pytest.mark.parametrize(
    "argv, message",
    [
        (["patch", "--check", "--revert", "."], "cannot be combined"),
        (
            ["deploy", "--config", "configs/deploy.embedded.yaml", "--status", "--rollback"],
            "are exclusive",
        ),
        (
            ["deploy", "--config", "configs/deploy.embedded.yaml", "--group", "g"],
            "--group needs --inventory",
        ),
        (["doctor", "--group", "g"], "--group needs --inventory"),
        (["bench", "--url", "gpu1:30000"], "expected NAME=http://HOST:PORT"),
        (["bench", "--concurrency", "1,x"], "expected integers"),
        (["bench", "--budget", "autox"], "--budget must be a positive integer or 'auto'"),
        (["bench", "--max-budget", "64"], "--max-budget applies to --budget auto only"),
        (["bench", "--algo", "dflash", "--baseline", "ar", "--budget", "8"], "the ddtree arm"),
        (["serve", "--port", "many"], "many"),
    ],
)
def test_a_usage_error_exits_2_in_every_command(argv, message):
    result = subprocess.run(
        [sys.executable, "-m", "ddtree_cli", *argv], capture_output=True, text=True,
        timeout=120, cwd=REPO,
    )  # fmt: skip
    assert result.returncode == ExitCode.USAGE, result.stderr
    assert message in result.stderr
    assert result.stdout == ""


def test_ssh_options_have_one_spelling_and_one_short_flag():
    import click

    from ddtree_cli.cli import app

    root = typer.main.get_command(app)
    assert isinstance(root, click.Group)
    want = {
        "host": ["--host", "-H"], "inventory": ["--inventory", "-I"], "group": ["--group", "-g"],
        "identity": ["--identity", "-i"], "known_hosts": ["--known-hosts"],
        "ssh_config": ["--ssh-config"], "accept_new_host_key": ["--accept-new-host-key"],
    }  # fmt: skip
    seen = 0
    for name in ("deploy", "doctor", "bench"):
        for param in root.commands[name].params:
            if param.name in want:
                assert sorted(param.opts) == sorted(want[param.name]), (name, param.name)
                seen += 1
            # -i and -I mean one thing each, in every command
            assert "-i" not in param.opts or param.name == "identity"
            assert "-I" not in param.opts or param.name == "inventory"
    assert seen == 7 + 7 + 4  # deploy and doctor: all seven; bench --host: four
