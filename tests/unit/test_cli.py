"""The CLI skeleton: entry point, --version, --help, and the error → exit-code translation."""

from __future__ import annotations

import subprocess
import sys

import pytest
import typer

from ddtree_cli import __main__ as entry
from ddtree_cli import __version__
from ddtree_cli.errors import ConfigError, ExitCode


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
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
        env={"COLUMNS": "80", "PATH": "/usr/bin:/bin"},
    )
    assert result.returncode == 1
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
