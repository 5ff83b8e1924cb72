"""Deploy configuration and host inventories: YAML in, validated dataclasses out.

Every error names the file and line (``deploy.yaml:12: launch.kind must be one of ...``),
because a config that is wrong on one of forty hosts must be fixable without guessing.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from ddtree_cli.budget_policy import BudgetOptionError, budget_options
from ddtree_cli.errors import ConfigError
from ddtree_cli.remote.hostspec import HostSpec

ALGOS = ("dflash", "ddtree")
LAUNCH_KINDS = ("sglang", "embedded", "command")


# ---------------------------------------------------------------------------- YAML with lines


class _Map(dict):
    """A mapping that remembers the line of each key (1-based) and of itself."""

    line: int = 0
    key_lines: dict

    def line_of(self, key: str) -> int:
        return self.key_lines.get(key, self.line)


class _List(list):
    line: int = 0
    item_lines: list


class _Loader(yaml.SafeLoader):
    pass


def _construct_map(loader: _Loader, node: yaml.MappingNode) -> _Map:
    loader.flatten_mapping(node)
    result = _Map()
    result.line = node.start_mark.line + 1
    result.key_lines = {}
    for key_node, value_node in node.value:
        key = loader.construct_object(key_node, deep=True)
        if key in result:
            raise ConfigError(
                f"{node.start_mark.name}:{key_node.start_mark.line + 1}: duplicate key {key!r}"
            )
        result[key] = loader.construct_object(value_node, deep=True)
        result.key_lines[key] = key_node.start_mark.line + 1
    return result


def _construct_list(loader: _Loader, node: yaml.SequenceNode) -> _List:
    result = _List(loader.construct_object(child, deep=True) for child in node.value)
    result.line = node.start_mark.line + 1
    result.item_lines = [child.start_mark.line + 1 for child in node.value]
    return result


_Loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_map)
_Loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_SEQUENCE_TAG, _construct_list)


def load_yaml(path: Path) -> Any:
    """Parse ``path``; syntax errors become ConfigError with file:line."""
    try:
        text = path.read_text()
    except FileNotFoundError as exc:
        raise ConfigError(f"{path}: no such file") from exc
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read ({exc.strerror})") from exc
    try:
        return yaml.load(_named(text, path), Loader=_Loader)  # noqa: S506 (SafeLoader subclass)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        line = mark.line + 1 if mark else 1
        started = ""
        if exc.context_mark is not None and exc.context_mark.line + 1 != line:
            started = f" ({exc.context} at line {exc.context_mark.line + 1})"
        raise ConfigError(
            f"{path}:{line}: invalid YAML: {exc.problem or exc.context}{started}"
        ) from exc
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: invalid YAML: {exc}") from exc


def _named(text: str, path: Path):
    import io

    stream = io.StringIO(text)
    stream.name = str(path)
    return stream


class _Reader:
    """Typed access to one mapping, raising ConfigError with file:line."""

    def __init__(self, path: Path, data: Any, where: str):
        self.path = path
        self.where = where
        if data is None:
            data = _Map()
            data.line, data.key_lines = 1, {}
        if not isinstance(data, dict):
            raise ConfigError(
                f"{path}:{getattr(data, 'line', 1)}: {where or 'the file'} must be a mapping"
            )
        self.data = data
        self.used: set[str] = set()

    def error(self, key: str | None, message: str) -> ConfigError:
        line = (
            self.data.line_of(key)
            if key and isinstance(self.data, _Map)
            else getattr(self.data, "line", 1)
        )
        return ConfigError(f"{self.path}:{line}: {message}")

    def name(self, key: str) -> str:
        return f"{self.where}.{key}" if self.where else key

    def get(
        self, key: str, types: type | tuple[type, ...], default: Any = None, required: bool = False
    ) -> Any:
        self.used.add(key)
        if key not in self.data or self.data[key] is None:
            if required:
                raise self.error(None, f"{self.name(key)} is required")
            return default
        value = self.data[key]
        if isinstance(value, bool) and bool not in (
            types if isinstance(types, tuple) else (types,)
        ):
            raise self.error(key, f"{self.name(key)} must be {_type_name(types)}, not a boolean")
        if not isinstance(value, types):
            raise self.error(
                key,
                f"{self.name(key)} must be {_type_name(types)}, "
                f"got {type(value).__name__} {value!r}",
            )
        return value

    def choice(self, key: str, choices: tuple[str, ...], default: str) -> str:
        value = self.get(key, str, default)
        if value not in choices:
            raise self.error(
                key, f"{self.name(key)} must be one of {', '.join(choices)}, got {value!r}"
            )
        return value

    def str_list(self, key: str) -> list[str]:
        value = self.get(key, list, [])
        for i, item in enumerate(value):
            if isinstance(item, bool) or not isinstance(item, (str, int, float)):
                line = value.item_lines[i] if isinstance(value, _List) else self.data.line_of(key)
                raise ConfigError(f"{self.path}:{line}: {self.name(key)}[{i}] must be a string")
        return [str(item) for item in value]

    def str_map(self, key: str) -> dict[str, str]:
        value = self.get(key, dict, {})
        for k, v in value.items():
            if not isinstance(k, str) or isinstance(v, (dict, list)):
                raise ConfigError(
                    f"{self.path}:{value.line_of(k)}: {self.name(key)}.{k} must be a string value"
                )
        return {k: "" if v is None else str(v) for k, v in value.items()}

    def sub(self, key: str) -> _Reader:
        return _Reader(self.path, self.get(key, dict, None), self.name(key))

    def port(self, key: str, default: int | None) -> int | None:
        value = self.get(key, int, default)
        if value is not None and not 0 < value < 65536:
            raise self.error(key, f"{self.name(key)} must be a port (1-65535), got {value}")
        return value

    def finish(self) -> None:
        unknown = [k for k in self.data if k not in self.used]
        if unknown:
            raise self.error(unknown[0], f"unknown key {self.name(str(unknown[0]))!r}")


def _type_name(types) -> str:
    names = {
        str: "a string",
        int: "an integer",
        float: "a number",
        bool: "true or false",
        list: "a list",
        dict: "a mapping",
    }
    types = types if isinstance(types, tuple) else (types,)
    return " or ".join(names.get(t, t.__name__) for t in types)


# ---------------------------------------------------------------------------- deploy config


@dataclass(frozen=True)
class LaunchConfig:
    kind: str = "sglang"
    algo: str = "ddtree"
    model_path: str | None = None
    draft_model_path: str | None = None
    num_draft_tokens: int = 16
    ddtree_budget: int | str | None = None  # a number of nodes, or "auto"
    ddtree_max_budget: int | None = None  # with "auto" only
    args: list[str] = field(default_factory=list)
    command: list[str] = field(default_factory=list)  # kind == "command": placeholders allowed


@dataclass(frozen=True)
class RouterConfig:
    host: str  # the inventory host that runs the router
    port: int = 30080
    policy: str = "cache_aware"
    command: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class MultiNodeConfig:
    nnodes: int
    dist_init_addr: str  # rank 0's address:port, reachable from every node


@dataclass(frozen=True)
class DeployConfig:
    path: Path
    name: str
    source: Path
    include: list[str]
    exclude: list[str]
    remote_dir: str
    python: str
    keep_releases: int
    service_host: str
    service_port: int
    gpus: list[str]
    env: dict[str, str]
    secret_env: list[str]
    user: str | None
    timeout_start_s: int
    ready_timeout_s: float
    canary_prompt: str
    canary_tokens: int
    speculative: bool
    preflight_gpu: bool
    launch: LaunchConfig
    router: RouterConfig | None = None
    multinode: MultiNodeConfig | None = None

    @property
    def unit_name(self) -> str:
        return f"{self.name}.service"


def _unit_safe(name: str) -> bool:
    import re

    return re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.@-]{0,200}", name) is not None


def load_deploy_config(path: str | Path) -> DeployConfig:
    path = Path(path)
    root = _Reader(path, load_yaml(path), "")
    name = root.get("name", str, required=True)
    if not _unit_safe(name):
        raise root.error(
            "name",
            f"name {name!r} must be a valid systemd unit name (letters, digits, '-', '_', '.')",
        )

    src = root.sub("source")
    source = (path.parent / src.get("path", str, ".")).resolve()
    include = src.str_list("include")
    exclude = src.str_list("exclude")
    src.finish()

    remote = root.sub("remote")
    remote_dir = remote.get("dir", str, f"/opt/ddtree/{name}")
    if not remote_dir.startswith("/"):
        raise remote.error("dir", "remote.dir must be an absolute path")
    python = remote.get("python", str, required=True)
    keep = remote.get("keep_releases", int, 5)
    if keep < 2:
        raise remote.error(
            "keep_releases",
            "remote.keep_releases must be at least 2 (the running release and one to roll back to)",
        )
    user = remote.get("user", str, None)
    remote.finish()

    server = root.sub("server")
    service_host = server.get("host", str, "127.0.0.1")
    service_port = server.port("port", 30000)
    gpus = server.str_list("gpus")
    for gpu in gpus:
        if not gpu.startswith(("GPU-", "MIG-")):
            raise server.error(
                "gpus", f"server.gpus must list GPU UUIDs (GPU-...), got {gpu!r}; see nvidia-smi -L"
            )
    env = server.str_map("env")
    secret_env = server.str_list("secret_env")
    timeout_start = server.get("timeout_start_s", int, 1800)
    ready_timeout = float(server.get("ready_timeout_s", (int, float), timeout_start))
    server.finish()

    canary = root.sub("canary")
    canary_prompt = canary.get("prompt", str, "The capital of France is")
    canary_tokens = canary.get("max_new_tokens", int, 32)
    if canary_tokens < 16:
        raise canary.error(
            "max_new_tokens",
            "canary.max_new_tokens must be at least 16, so that a speculative round is exercised",
        )
    canary.finish()

    launch = _load_launch(root.sub("launch"))
    speculative = root.get("speculative", bool, launch.kind != "command")

    pre = root.sub("preflight")
    preflight_gpu = pre.get("gpu", bool, launch.kind == "sglang")
    pre.finish()

    router = _load_router(root.sub("router")) if root.get("router", dict, None) else None
    multinode = (
        _load_multinode(root.sub("multinode")) if root.get("multinode", dict, None) else None
    )
    root.finish()
    return DeployConfig(
        path=path,
        name=name,
        source=source,
        include=include,
        exclude=exclude,
        remote_dir=remote_dir.rstrip("/"),
        python=python,
        keep_releases=keep,
        service_host=service_host,
        service_port=service_port,
        gpus=gpus,
        env=env,
        secret_env=secret_env,
        user=user,
        timeout_start_s=timeout_start,
        ready_timeout_s=ready_timeout,
        canary_prompt=canary_prompt,
        canary_tokens=canary_tokens,
        speculative=speculative,
        preflight_gpu=preflight_gpu,
        launch=launch,
        router=router,
        multinode=multinode,
    )


def _load_launch(r: _Reader) -> LaunchConfig:
    kind = r.choice("kind", LAUNCH_KINDS, "sglang")
    algo = r.choice("algo", ALGOS, "ddtree")
    launch = LaunchConfig(
        kind=kind,
        algo=algo,
        model_path=r.get("model_path", str, None),
        draft_model_path=r.get("draft_model_path", str, None),
        num_draft_tokens=r.get("num_draft_tokens", int, 16),
        ddtree_budget=r.get("ddtree_budget", (int, str), None),
        ddtree_max_budget=r.get("ddtree_max_budget", int, None),
        args=r.str_list("args"),
        command=r.str_list("command"),
    )
    launch = _check_budget(r, launch)
    if kind == "sglang" and not (launch.model_path and launch.draft_model_path):
        raise r.error(
            None, "launch.model_path and launch.draft_model_path are required for kind: sglang"
        )
    if kind == "command" and not launch.command:
        raise r.error(None, "launch.command (a list) is required for kind: command")
    if kind != "command" and launch.command:
        raise r.error("command", "launch.command is only used with kind: command")
    for flag in ("--speculative-algorithm", "--port", "--host"):
        if flag in launch.args:
            raise r.error(
                "args",
                f"launch.args must not set {flag}: it is derived from --algo "
                "and server.host/port so both arms stay identical",
            )
    r.finish()
    return launch


def _check_budget(r: _Reader, launch: LaunchConfig) -> LaunchConfig:
    """``ddtree_budget`` (a number of nodes or ``auto``) and ``ddtree_max_budget`` (with
    ``auto`` only, at least ``num_draft_tokens - 1``), checked as ``ddtree serve`` checks
    ``--budget``/``--max-budget``; the budget comes back parsed."""
    for key in ("ddtree_budget", "ddtree_max_budget"):
        if getattr(launch, key) is not None and launch.algo != "ddtree":
            raise r.error(key, f"launch.{key} applies to algo: ddtree only")
    names = {
        "budget": "launch.ddtree_budget",
        "max_budget": "launch.ddtree_max_budget",
        "block_size": "launch.num_draft_tokens",
    }
    block = launch.num_draft_tokens if launch.kind == "sglang" else None
    try:
        budget = budget_options(launch.ddtree_budget, launch.ddtree_max_budget, block, names)
    except BudgetOptionError as exc:
        raise r.error(f"ddtree_{exc.option}", str(exc)) from None
    return dataclasses.replace(launch, ddtree_budget=budget)


def _load_router(r: _Reader) -> RouterConfig:
    cfg = RouterConfig(
        host=r.get("host", str, required=True),
        port=r.port("port", 30080),
        policy=r.get("policy", str, "cache_aware"),
        command=r.str_list("command"),
    )
    r.finish()
    return cfg


def _load_multinode(r: _Reader) -> MultiNodeConfig:
    nnodes = r.get("nnodes", int, required=True)
    if nnodes < 2:
        raise r.error("nnodes", "multinode.nnodes must be at least 2")
    cfg = MultiNodeConfig(nnodes=nnodes, dist_init_addr=r.get("dist_init_addr", str, required=True))
    r.finish()
    return cfg


# ---------------------------------------------------------------------------- inventory


@dataclass(frozen=True)
class Inventory:
    path: Path
    hosts: dict[str, HostSpec]
    groups: dict[str, list[str]]

    def select(self, group: str | None) -> list[HostSpec]:
        if group is None:
            return list(self.hosts.values())
        if group not in self.groups:
            known = ", ".join(sorted(self.groups)) or "none"
            raise ConfigError(f"{self.path}: no group {group!r} (groups: {known})")
        return [self.hosts[name] for name in self.groups[group]]


def load_inventory(path: str | Path) -> Inventory:
    """``hosts: {name: {address, user, port, identity, gpus, service_port}}``, ``groups``."""
    path = Path(path)
    root = _Reader(path, load_yaml(path), "")
    defaults = root.sub("defaults")
    d_user = defaults.get("user", str, None)
    d_port = defaults.port("port", None)
    d_identity = defaults.get("identity", str, None)
    defaults.finish()
    hosts_node = root.get("hosts", dict, required=True)
    if not hosts_node:
        raise root.error("hosts", "hosts is empty")
    hosts: dict[str, HostSpec] = {}
    for name in hosts_node:
        if not isinstance(name, str):
            raise ConfigError(f"{path}:{hosts_node.line_of(name)}: host names must be strings")
        entry = hosts_node[name]
        if isinstance(entry, str) or entry is None:
            spec = HostSpec.parse(entry or name)
            hosts[name] = HostSpec(
                host=spec.host,
                user=spec.user or d_user,
                port=spec.port or d_port,
                identity=d_identity,
                name=name,
            )
            continue
        r = _Reader(path, entry, f"hosts.{name}")
        address = r.get("address", str, name)
        gpus = tuple(r.str_list("gpus"))
        for gpu in gpus:
            if not gpu.startswith(("GPU-", "MIG-")):
                raise r.error(
                    "gpus", f"hosts.{name}.gpus must list GPU UUIDs (GPU-...), got {gpu!r}"
                )
        hosts[name] = HostSpec(
            host=address,
            user=r.get("user", str, d_user),
            port=r.port("port", d_port),
            identity=r.get("identity", str, d_identity),
            name=name,
            gpus=gpus,
            service_port=r.port("service_port", None),
        )
        r.finish()
    groups: dict[str, list[str]] = {}
    groups_node = root.get("groups", dict, {})
    for group, members in groups_node.items():
        if not isinstance(members, list) or not all(isinstance(m, str) for m in members):
            raise ConfigError(
                f"{path}:{groups_node.line_of(group)}: groups.{group} must be a list of host names"
            )
        for i, member in enumerate(members):
            if member not in hosts:
                line = (
                    members.item_lines[i]
                    if isinstance(members, _List)
                    else groups_node.line_of(group)
                )
                raise ConfigError(f"{path}:{line}: groups.{group}: unknown host {member!r}")
        groups[group] = list(members)
    root.finish()
    return Inventory(path=path, hosts=hosts, groups=groups)
