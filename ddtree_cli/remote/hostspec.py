"""Where and how to reach one host: ``[USER@]HOST[:PORT]`` parsed, plus what an inventory adds.

Kept apart from :mod:`ddtree_cli.remote.ssh` so that reading a deploy config or an inventory
does not load paramiko.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ddtree_cli.errors import RemoteError


@dataclass(frozen=True)
class HostSpec:
    """Where and how to reach one host. ``None`` fields fall back to ~/.ssh/config, then defaults."""

    host: str
    user: str | None = None
    port: int | None = None
    identity: str | None = None
    name: str | None = None
    gpus: tuple[str, ...] = ()
    service_port: int | None = None
    vars: dict = field(default_factory=dict, compare=False, hash=False)

    @property
    def label(self) -> str:
        if self.name:
            return self.name
        user = f"{self.user}@" if self.user else ""
        host = f"[{self.host}]" if ":" in self.host else self.host
        port = f":{self.port}" if self.port else ""
        return f"{user}{host}{port}"

    @classmethod
    def parse(cls, text: str) -> HostSpec:
        """Parse ``[USER@]HOST[:PORT]``; ``[v6addr]:PORT`` for IPv6."""
        raw = text.strip()
        if not raw or any(c.isspace() for c in raw):
            raise RemoteError(f"invalid host {text!r}: expected [USER@]HOST[:PORT]")
        user = None
        if "@" in raw:
            user, raw = raw.rsplit("@", 1)
            if not user:
                raise RemoteError(f"invalid host {text!r}: empty user before '@'")
        port: int | None = None
        if raw.startswith("["):
            end = raw.find("]")
            if end < 0:
                raise RemoteError(f"invalid host {text!r}: missing ']'")
            host, rest = raw[1:end], raw[end + 1 :]
            if rest:
                if not rest.startswith(":"):
                    raise RemoteError(f"invalid host {text!r}: expected ':PORT' after ']'")
                port = _parse_port(rest[1:], text)
        elif raw.count(":") == 1:
            host, port_text = raw.split(":")
            port = _parse_port(port_text, text)
        else:
            host = raw  # a bare IPv6 address has several colons and no port
        if not host:
            raise RemoteError(f"invalid host {text!r}: empty host name")
        return cls(host=host, user=user, port=port)


def _parse_port(text: str, original: str) -> int:
    if not text.isdigit() or not 0 < int(text) < 65536:
        raise RemoteError(f"invalid host {original!r}: port must be 1-65535")
    return int(text)
