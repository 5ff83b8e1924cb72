"""systemd units for a deployment: rendering (pure), installing, readiness.

The unit follows what works for GPU inference servers: ``Type=exec`` (SGLang sends no
sd_notify), a long ``TimeoutStartSec`` (weights, CUDA graphs and JIT take minutes),
``Restart=on-failure`` with a start limit, ``KillMode=control-group`` (SGLang's scheduler
children survive their parent otherwise), GPUs by UUID with ``CUDA_DEVICE_ORDER=PCI_BUS_ID``,
secrets in a 0600 ``EnvironmentFile``, no device or procfs sandboxing (it hides the GPU).
"""

from __future__ import annotations

import http.client
import json
import re
import shlex
import time
from dataclasses import dataclass

from ddtree_cli.config import DeployConfig, RouterConfig
from ddtree_cli.errors import ConfigError, RemoteError
from ddtree_cli.remote.ssh import Connection, HostSpec

UNIT_DIR = "/etc/systemd/system"
ENV_DIR = "/etc/ddtree"


# ---------------------------------------------------------------------------- rendering


@dataclass(frozen=True)
class NodeRole:
    """Where this host sits in a multi-node tensor-parallel group (rank 0 first)."""

    rank: int
    nnodes: int
    dist_init_addr: str


def service_port(cfg: DeployConfig, host: HostSpec) -> int:
    return host.service_port or cfg.service_port


def launch_argv(cfg: DeployConfig, host: HostSpec, algo: str, python: str,
                node: NodeRole | None = None) -> list[str]:
    """The server's command line. DFLASH and DDTREE differ only in the algorithm flags."""
    launch = cfg.launch
    port = str(service_port(cfg, host))
    release = f"{cfg.remote_dir}/current"
    if launch.kind == "command":
        values = {"python": python, "host": cfg.service_host, "port": port, "algo": algo,
                  "release": release, "name": cfg.name}
        try:
            return [arg.format(**values) for arg in launch.command]
        except (KeyError, IndexError, ValueError) as exc:
            raise ConfigError(f"{cfg.path}: launch.command: unknown placeholder {exc} (known: "
                              f"{', '.join('{' + k + '}' for k in values)})") from exc
    if launch.kind == "embedded":
        argv = [python, "-m", "ddtree_cli", "serve", "--algo", algo]
        if algo == "ddtree" and launch.ddtree_budget is not None:
            argv += ["--budget", str(launch.ddtree_budget)]
        return argv + [*launch.args, "--host", cfg.service_host, "--port", port]
    argv = [python, "-m", "sglang.launch_server", "--model-path", launch.model_path,
            "--speculative-algorithm", algo.upper(),
            "--speculative-draft-model-path", launch.draft_model_path,
            "--speculative-num-draft-tokens", str(launch.num_draft_tokens)]
    if algo == "ddtree":
        budget = launch.ddtree_budget if launch.ddtree_budget is not None \
            else launch.num_draft_tokens - 1
        argv += ["--speculative-ddtree-budget", str(budget)]
    argv += launch.args
    if node is not None:
        argv += ["--nnodes", str(node.nnodes), "--node-rank", str(node.rank),
                 "--dist-init-addr", node.dist_init_addr]
    return argv + ["--host", cfg.service_host, "--port", port]


def _quote(arg: str) -> str:
    """One word for a systemd command line or assignment ('%' and '$' escaped)."""
    arg = arg.replace("%", "%%").replace("$", "$$")
    if arg and re.fullmatch(r"[A-Za-z0-9_@%+=:,./-]+", arg) and not arg.startswith("$"):
        return arg
    return '"' + arg.replace("\\", "\\\\").replace('"', '\\"') + '"'


def env_file_path(cfg: DeployConfig) -> str:
    return f"{ENV_DIR}/{cfg.name}.env"


def render_unit(cfg: DeployConfig, host: HostSpec, algo: str, python: str,
                node: NodeRole | None = None) -> str:
    gpus = list(host.gpus) or cfg.gpus
    env = {"PYTHONPATH": f"{cfg.remote_dir}/current", "PYTHONUNBUFFERED": "1",
           "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
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
            raise ConfigError(f"{cfg.path}: secret {name} (server.secret_env) is not set in "
                              f"this shell's environment")
        value = environ[name]
        if "\n" in value:
            raise ConfigError(f"secret {name} contains a newline")
        lines.append(f"{name}={json.dumps(value)}")  # double-quoted, escapes kept
    return "\n".join(lines) + "\n" if lines else ""


def redact_env_file(text: str) -> str:
    return "\n".join(f"{line.split('=', 1)[0]}=<redacted>" for line in text.splitlines() if line)


def render_router_unit(cfg: DeployConfig, router: RouterConfig, worker_urls: list[str],
                       python: str) -> str:
    """A unit for SGLang's router (sgl-model-gateway) in front of the replicas."""
    argv = [arg.format(python=python, port=router.port) for arg in router.command] \
        if router.command else \
        [python, "-m", "sglang_router.launch_router", "--worker-urls", *worker_urls,
         "--policy", router.policy, "--host", "0.0.0.0", "--port", str(router.port)]
    return "\n".join([
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
    ])


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
                raise ConfigError(f"unit word {word!r} uses a systemd {char} expansion; only "
                                  f"the commands ddtree deploy renders can be started by hand")
        words.append(word.replace("%%", "%").replace("$$", "$"))
    return words


# ---------------------------------------------------------------------------- control


def write_root_file(conn: Connection, path: str, text: str, mode: int = 0o644) -> None:
    """Write a file as root atomically, created with ``mode`` before any content lands."""
    script = ("import os,sys;p=sys.argv[1];m=int(sys.argv[2],8);t=p+'.tmp';"
              "os.makedirs(os.path.dirname(p),exist_ok=True);"
              "fd=os.open(t,os.O_WRONLY|os.O_CREAT|os.O_TRUNC,m);os.fchmod(fd,m);"
              "os.write(fd,sys.stdin.buffer.read());os.fsync(fd);os.close(fd);os.replace(t,p)")
    conn.run(["python3", "-c", script, path, oct(mode)[2:]], stdin=text, timeout=60, sudo=True,
             check=True)


def read_root_file(conn: Connection, path: str) -> str | None:
    result = conn.run(["cat", path], timeout=60, sudo=True)
    return result.stdout if result.ok else None


def systemctl(conn: Connection, *args: str, check: bool = True, timeout: float = 120):
    return conn.run(["systemctl", *args], timeout=timeout, sudo=True, check=check)


def unit_state(conn: Connection, unit: str) -> dict[str, str]:
    out = conn.run(["systemctl", "show", unit, "--property=ActiveState,SubState,NRestarts,"
                    "ExecMainStatus,LoadState"], timeout=60)
    return dict(line.split("=", 1) for line in out.stdout.splitlines() if "=" in line)


def journal_tail(conn: Connection, unit: str, lines: int = 20, since: str | None = None) -> list[str]:
    argv = ["journalctl", "-u", unit, "-n", str(lines), "--no-pager", "-o", "cat"]
    if since:
        argv += ["--since", since]
    out = conn.run(argv, timeout=60, sudo=True)
    return [line for line in out.stdout.splitlines() if line.strip()]


def host_now(conn: Connection) -> str:
    """The host's clock, for ``journalctl --since`` (local and host clocks may disagree)."""
    return conn.run(["date", "+%Y-%m-%d %H:%M:%S"], timeout=30, check=True).stdout.strip()


# ---------------------------------------------------------------------------- readiness


class NotReady(Exception):
    """The service did not become ready; the message says why (one line)."""


def http_request(conn: Connection, host: str, port: int, method: str, path: str,
                 body: dict | None = None, timeout: float = 60) -> tuple[int, str]:
    """An HTTP request made from the host itself (through an SSH direct-tcpip channel), so a
    server bound to the host's loopback is reachable without opening a port."""
    target = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
    channel = conn.open_tunnel(target, port, timeout=timeout)
    channel.settimeout(timeout)
    try:
        client = http.client.HTTPConnection(target, port, timeout=timeout)
        client.sock = channel  # paramiko channels offer sendall/makefile like a socket
        payload = json.dumps(body).encode() if body is not None else None
        headers = {"Content-Type": "application/json"} if payload else {}
        client.request(method, path, body=payload, headers=headers)
        response = client.getresponse()
        return response.status, response.read().decode(errors="replace")
    finally:
        channel.close()


def wait_ready(conn: Connection, cfg: DeployConfig, host: HostSpec, unit: str, *,
               started_at: str | None, timeout: float | None = None,
               note=lambda _msg: None) -> dict:
    """Poll /health until 200 (503 means still starting), then run the canary /generate.

    Fails fast when the unit dies or restarts instead of waiting out the timeout.
    Returns the canary's ``meta_info``.
    """
    port = service_port(cfg, host)
    deadline = time.monotonic() + (timeout or cfg.ready_timeout_s)
    last = "no answer yet"
    delay = 0.25
    while True:
        state = unit_state(conn, unit)
        if state.get("ActiveState") == "failed" or state.get("SubState") == "auto-restart" \
                or int(state.get("NRestarts", "0") or 0) > 0:
            raise NotReady(f"{unit} exited (state {state.get('ActiveState')}/"
                           f"{state.get('SubState')}, exit status {state.get('ExecMainStatus')})")
        if state.get("ActiveState") not in ("active", "activating", "reloading", "deactivating"):
            raise NotReady(f"{unit} is {state.get('ActiveState')}")
        try:
            status, _ = http_request(conn, cfg.service_host, port, "GET", "/health", timeout=30)
            if status == 200:
                break
            last = f"/health answered {status}"
            note(f"starting ({last})")
        except (ConnectionRefusedError, OSError, http.client.HTTPException) as exc:
            last = f"port {port} not answering ({type(exc).__name__})"
        except RemoteError:
            raise
        if time.monotonic() > deadline:
            raise NotReady(f"not ready after {timeout or cfg.ready_timeout_s:.0f} s: {last}")
        time.sleep(delay)
        delay = min(delay * 1.5, 2.0)
    return canary(conn, cfg, host)


def canary(conn: Connection, cfg: DeployConfig, host: HostSpec) -> dict:
    body = {"text": cfg.canary_prompt,
            "sampling_params": {"max_new_tokens": cfg.canary_tokens, "temperature": 0,
                                "ignore_eos": True}}
    try:
        status, text = http_request(conn, cfg.service_host, service_port(cfg, host), "POST",
                                    "/generate", body, timeout=max(60.0, cfg.ready_timeout_s))
    except (OSError, http.client.HTTPException) as exc:
        raise NotReady(f"canary /generate failed: {exc}") from exc
    if status != 200:
        raise NotReady(f"canary /generate answered {status}: {text[:200]}")
    try:
        answer = json.loads(text)
        meta = answer["meta_info"]
    except (ValueError, KeyError, TypeError) as exc:
        raise NotReady(f"canary /generate answered something that is not SGLang's format: "
                       f"{text[:200]}") from exc
    tokens = meta.get("completion_tokens", 0)
    if tokens < min(16, cfg.canary_tokens):
        raise NotReady(f"canary generated {tokens} tokens, expected {cfg.canary_tokens}")
    if cfg.speculative and not meta.get("spec_verify_ct"):
        raise NotReady("canary ran without speculative decoding (meta_info.spec_verify_ct is "
                       f"{meta.get('spec_verify_ct')!r})")
    return meta


def describe_argv(argv: list[str]) -> str:
    return shlex.join(argv)
