"""systemd units for a deployment, rendered from the config and read back (pure: no SSH,
no I/O).

The unit follows what works for GPU inference servers: ``Type=exec`` (SGLang sends no
sd_notify), a long ``TimeoutStartSec`` (weights, CUDA graphs and JIT take minutes),
``Restart=on-failure`` with a start limit, ``KillMode=control-group`` (SGLang's scheduler
children survive their parent otherwise), GPUs by UUID with ``CUDA_DEVICE_ORDER=PCI_BUS_ID``,
secrets in a 0600 ``EnvironmentFile``, no device or procfs sandboxing (it hides the GPU).
"""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass

from ddtree_cli.deploy.config import DeployConfig, RouterConfig
from ddtree_cli.errors import ConfigError
from ddtree_cli.remote.hostspec import HostSpec

UNIT_DIR = "/etc/systemd/system"
ENV_DIR = "/etc/ddtree"


@dataclass(frozen=True)
class NodeRole:
    """Where this host sits in a multi-node tensor-parallel group (rank 0 first)."""

    rank: int
    nnodes: int
    dist_init_addr: str


def service_port(cfg: DeployConfig, host: HostSpec) -> int:
    return host.service_port or cfg.service_port


def launch_argv(
    cfg: DeployConfig, host: HostSpec, algo: str, python: str, node: NodeRole | None = None
) -> list[str]:
    """The server's command line. DFLASH and DDTREE differ only in the algorithm flags."""
    launch = cfg.launch
    port = str(service_port(cfg, host))
    release = f"{cfg.remote_dir}/current"
    if launch.kind == "command":
        values = {
            "python": python,
            "host": cfg.service_host,
            "port": port,
            "algo": algo,
            "release": release,
            "name": cfg.name,
        }
        try:
            return [arg.format(**values) for arg in launch.command]
        except (KeyError, IndexError, ValueError) as exc:
            raise ConfigError(
                f"{cfg.path}: launch.command: unknown placeholder {exc} (known: "
                f"{', '.join('{' + k + '}' for k in values)})"
            ) from exc
    if launch.kind == "embedded":
        argv = [python, "-m", "ddtree_cli", "serve", "--algo", algo]
        if algo == "ddtree":
            if launch.ddtree_budget is not None:
                argv += ["--budget", str(launch.ddtree_budget)]
            if launch.ddtree_max_budget is not None:
                argv += ["--max-budget", str(launch.ddtree_max_budget)]
        return argv + [*launch.args, "--host", cfg.service_host, "--port", port]
    argv = [
        python,
        "-m",
        "sglang.launch_server",
        "--model-path",
        launch.model_path,
        "--speculative-algorithm",
        algo.upper(),
        "--speculative-draft-model-path",
        launch.draft_model_path,
        "--speculative-num-draft-tokens",
        str(launch.num_draft_tokens),
    ]
    if algo == "ddtree":
        budget = (
            launch.ddtree_budget
            if launch.ddtree_budget is not None
            else launch.num_draft_tokens - 1
        )
        argv += ["--speculative-ddtree-budget", str(budget)]
        if launch.ddtree_max_budget is not None:
            argv += ["--speculative-ddtree-max-budget", str(launch.ddtree_max_budget)]
    argv += launch.args
    if node is not None:
        argv += [
            "--nnodes",
            str(node.nnodes),
            "--node-rank",
            str(node.rank),
            "--dist-init-addr",
            node.dist_init_addr,
        ]
    return argv + ["--host", cfg.service_host, "--port", port]


def _quote(arg: str) -> str:
    """One word for a systemd command line or assignment ('%' and '$' escaped)."""
    arg = arg.replace("%", "%%").replace("$", "$$")
    if arg and re.fullmatch(r"[A-Za-z0-9_@%+=:,./-]+", arg) and not arg.startswith("$"):
        return arg
    return '"' + arg.replace("\\", "\\\\").replace('"', '\\"') + '"'


def env_file_path(cfg: DeployConfig) -> str:
    return f"{ENV_DIR}/{cfg.name}.env"


def render_unit(
    cfg: DeployConfig, host: HostSpec, algo: str, python: str, node: NodeRole | None = None
) -> str:
    gpus = list(host.gpus) or cfg.gpus
    env = {
        "PYTHONPATH": f"{cfg.remote_dir}/current",
        "PYTHONUNBUFFERED": "1",
        "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
    }
    if gpus:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(gpus)
    env.update(cfg.env)
    lines = [
        "# Managed by ddtree deploy; changes here are replaced on the next deploy.",
        "[Unit]",
        f"Description=ddtree deployment {cfg.name} ({algo})",
        "After=network-online.target nvidia-persistenced.service",
        "Wants=network-online.target",
        "StartLimitIntervalSec=600",
        "StartLimitBurst=5",
        "",
        "[Service]",
        "Type=exec",
    ]
    if cfg.user:
        lines.append(f"User={cfg.user}")
    lines.append(f"WorkingDirectory={cfg.remote_dir}/current")
    lines += [f"Environment={_quote(f'{k}={v}')}" for k, v in env.items()]
    if cfg.secret_env:
        lines.append(f"EnvironmentFile={env_file_path(cfg)}")
    lines += [
        "ExecStart=" + " ".join(_quote(a) for a in launch_argv(cfg, host, algo, python, node)),
        f"TimeoutStartSec={cfg.timeout_start_s}",
        "TimeoutStopSec=120",
        "KillMode=control-group",
        "KillSignal=SIGTERM",
        "Restart=on-failure",
        "RestartSec=10",
        "LimitNOFILE=65535",
        "LimitMEMLOCK=infinity",
        "",
        "[Install]",
        "WantedBy=multi-user.target",
        "",
    ]
    return "\n".join(lines)


def render_env_file(cfg: DeployConfig, environ: dict[str, str]) -> str:
    """KEY=value lines for the secrets named in ``server.secret_env``, from ``environ``."""
    lines = []
    for name in cfg.secret_env:
        if name not in environ:
            raise ConfigError(
                f"{cfg.path}: secret {name} (server.secret_env) is not set in "
                f"this shell's environment"
            )
        value = environ[name]
        if "\n" in value:
            raise ConfigError(f"secret {name} contains a newline")
        lines.append(f"{name}={json.dumps(value)}")  # double-quoted, escapes kept
    return "\n".join(lines) + "\n" if lines else ""


def redact_env_file(text: str) -> str:
    return "\n".join(f"{line.split('=', 1)[0]}=<redacted>" for line in text.splitlines() if line)


def render_router_unit(
    cfg: DeployConfig, router: RouterConfig, worker_urls: list[str], python: str
) -> str:
    """A unit for SGLang's router (sgl-model-gateway) in front of the replicas."""
    argv = (
        [arg.format(python=python, port=router.port) for arg in router.command]
        if router.command
        else [
            python,
            "-m",
            "sglang_router.launch_router",
            "--worker-urls",
            *worker_urls,
            "--policy",
            router.policy,
            "--host",
            "0.0.0.0",
            "--port",
            str(router.port),
        ]
    )
    return "\n".join(
        [
            "# Managed by ddtree deploy.",
            "[Unit]",
            f"Description=SGLang router for ddtree deployment {cfg.name}",
            "After=network-online.target",
            "Wants=network-online.target",
            "",
            "[Service]",
            "Type=exec",
            "ExecStart=" + " ".join(_quote(a) for a in argv),
            "Restart=on-failure",
            "RestartSec=5",
            "KillMode=control-group",
            "LimitNOFILE=65535",
            "",
            "[Install]",
            "WantedBy=multi-user.target",
            "",
        ]
    )


def router_unit_name(cfg: DeployConfig) -> str:
    return f"{cfg.name}-router.service"


@dataclass(frozen=True)
class UnitCommand:
    """What a rendered unit runs: enough to start it by hand where there is no systemd."""

    argv: list[str]
    env: dict[str, str]
    working_directory: str | None
    environment_file: str | None


def read_unit(text: str) -> UnitCommand:
    """The command line, environment and working directory of a unit this module rendered.

    The inverse of the rendering's quoting (double quotes with backslash escapes, ``%%`` and
    ``$$``); a unit using systemd's own expansions (``%h``, ``$VAR``) is refused, because
    starting it by hand would run something else than systemd would.
    """
    argv: list[str] | None = None
    env: dict[str, str] = {}
    workdir = env_file = None
    for line in text.split("\n"):  # systemd's lines; str.splitlines also splits at \x1c...
        key, sep, value = line.partition("=")
        if not sep or line.startswith(("#", ";", "[")):
            continue
        if key == "ExecStart":
            if argv is not None:
                raise ConfigError("the unit has more than one ExecStart line")
            argv = _unquote_words(value)
        elif key == "Environment":
            for assignment in _unquote_words(value):
                name, _, setting = assignment.partition("=")
                env[name] = setting
        elif key == "WorkingDirectory":
            workdir = value
        elif key == "EnvironmentFile":
            env_file = value
    if not argv:
        raise ConfigError("the unit has no ExecStart line")
    return UnitCommand(argv=argv, env=env, working_directory=workdir, environment_file=env_file)


def _unquote_words(value: str) -> list[str]:
    words = []
    for word in shlex.split(value):
        for char in "%$":
            if char in word.replace(char * 2, ""):
                raise ConfigError(
                    f"unit word {word!r} uses a systemd {char} expansion; only "
                    f"the commands ddtree deploy renders can be started by hand"
                )
        words.append(word.replace("%%", "%").replace("$$", "$"))
    return words
