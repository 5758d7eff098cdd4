"""Which browsers may talk to the server: the `Host` and `Origin` rules (and CORS).

A keyless server on 127.0.0.1 is reachable from every web page its user opens (Ollama's
CVE-2024-28224). Two doors, two checks:

- **Cross-site requests.** A foreign page can POST without a CORS preflight (a `text/plain`
  body, a form), and the browser sends it with the page's `Origin`. A request whose `Origin` is
  present and is neither the server's own (scheme http or https, same host and port as the
  `Host` header) nor listed in `--allowed-origins` gets 403 before any route runs. Browsers send
  `Origin` on every POST, and on cross-origin fetches of any method; non-browser clients (curl,
  the openai client, SGLang's router) send none and are unaffected.
- **DNS rebinding.** A page on a name the attacker re-points at 127.0.0.1 is same-origin with
  the server as far as the browser knows, so it could read the answers; but its requests carry
  the attacker's name in `Host`. `Host` must name the server: the bound address (with its port, or none),
  localhost / 127.0.0.1 / [::1] when bound to loopback, or a name of `--allowed-hosts`; else
  421. Bound to every interface (0.0.0.0, ::) with no `--allowed-hosts`, any `Host` is
  accepted (the server cannot know its names); with `--allowed-hosts`, the names given, the
  loopback names and IP literals (an IP literal cannot be rebound, and health probes use them).

An allowed foreign origin gets CORS: a preflight (`OPTIONS` with
`Access-Control-Request-Method`) is answered 204 with the methods and headers allowed
(`Authorization` and `Content-Type` among them), and every answer to it carries
`Access-Control-Allow-Origin` (its origin, never credentials: the API key travels in a header).
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from urllib.parse import urlsplit

from radixserve.config import normalize_origin, split_host

LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "[::1]"})
WILDCARD_BINDS = frozenset({"", "0.0.0.0", "::", "[::]"})
CORS_METHODS = "GET, POST, OPTIONS"
CORS_HEADERS = "Authorization, Content-Type"
CORS_MAX_AGE = "600"


def _is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name.strip("[]"))
    except ValueError:
        return False
    return True


def _is_loopback_bind(host: str) -> bool:
    host = host.strip("[]").lower()
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True)
class OriginPolicy:
    """The rules above for one server: bound to `bind_host`:`port`, with the options' lists."""

    bind_host: str
    port: int
    allowed_origins: tuple[str, ...] = ()
    allowed_hosts: tuple[str, ...] = ()

    def host_ok(self, host: str | None) -> bool:
        """Whether a request's `Host` names this server (absent: a non-browser client; allowed)."""
        if host is None or "*" in self.allowed_hosts:
            return True
        wildcard = self.bind_host.lower() in WILDCARD_BINDS
        if wildcard and not self.allowed_hosts:
            return True
        name, port = split_host(host)
        if port == -1 or not name:
            return False
        for allowed in self.allowed_hosts:
            allowed_name, allowed_port = split_host(allowed)
            if name == allowed_name and (allowed_port is None or allowed_port == port):
                return True
        # the name is what stops a rebinding page; a raw client that names the host without
        # its port (curl --resolve tricks, hand-written sockets) still means this server
        ours = port is None or port == self.port
        if not ours:
            return False
        bound = self.bind_host.lower()
        bound = f"[{bound}]" if ":" in bound and not bound.startswith("[") else bound
        if name == bound:
            return True
        if (wildcard or _is_loopback_bind(self.bind_host)) and name in LOOPBACK_NAMES:
            return True
        return wildcard and _is_ip(name)

    def same_origin(self, origin: str, host: str | None) -> bool:
        """Whether `origin` is the server's own: http or https on the host and port that the
        request's `Host` names (the page the server itself served, maybe behind a TLS proxy)."""
        if host is None:
            return False
        parts = urlsplit(origin.strip().lower())
        if parts.scheme not in ("http", "https") or not parts.hostname:
            return False
        default = {"http": 80, "https": 443}[parts.scheme]
        try:
            origin_port = parts.port or default
        except ValueError:
            return False
        name, port = split_host(host)
        origin_name = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
        return bool(name) and name == origin_name and (port or default) == origin_port

    def cross_origin_allowed(self, origin: str) -> bool:
        if "*" in self.allowed_origins:
            return True
        try:
            return normalize_origin(origin) in self.allowed_origins
        except ValueError:
            return False
