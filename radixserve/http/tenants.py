"""Tenants from API keys (`--api-key-file`): who a request belongs to, and its cache namespace.

Each line of the file is `key`, `key tenant-name`, or `key tenant-name admin`. A request
authenticated by a key belongs to
that key's tenant, and its prefix-cache namespace is derived here, on the server, from the
tenant: `tenant`, or `tenant` NUL `cache_salt` when the client sends a salt. Tenant names cannot
contain NUL (nor whitespace), so the part before the first NUL is always the tenant: whatever
salt a client sends, it can only narrow its own tenant's namespace, never name another's. The
cache keeps namespaces apart (no shared nodes), so neither hits nor their timing cross tenants.

What a key sees of the server is its tenant's too: /metrics shows a tenant key only its own
tenant's series, /server_info only the model and options (no file paths, no page or queue counts,
no pids), since the server's global numbers move with other tenants' traffic. An `admin` key
(monitoring, operators) sees everything, as every key does without --api-key-file.

Keys are never logged nor put in an error message: errors name the file's line instead.
"""

from __future__ import annotations

import hashlib
import hmac
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from radixserve.front.types import GenerateRequest

# the names go into a Prometheus label and a cache namespace: keep them plain
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
SCOPE_KEY = "radixserve.tenant"  # where the API-key middleware leaves the tenant in the ASGI scope
ADMIN_SCOPE_KEY = "radixserve.admin"  # and whether the key is an admin key (True) or a tenant's (False)
ADMIN = "admin"  # the third field of a key file's line


def derived_name(key: str) -> str:
    """The name of a key given without one: stable, and reveals nothing usable about the key
    (8 hex digits of its SHA-256)."""
    return "tenant-" + hashlib.sha256(key.encode()).hexdigest()[:8]


@dataclass(frozen=True)
class Tenants:
    """The keys (as SHA-256 digests) and the tenant each belongs to. Several keys may share a
    tenant (rotating a key without losing the tenant's cache)."""

    digests: tuple[tuple[bytes, str], ...]
    admins: frozenset[bytes] = frozenset()  # digests of the admin keys, which see every tenant

    @classmethod
    def single(cls, key: str) -> Tenants:
        """The single --api-key: one key, of the unnamed shared tenant ("")."""
        return cls(((hashlib.sha256(key.encode()).digest(), ""),))

    @property
    def names(self) -> frozenset[str]:
        return frozenset(name for _, name in self.digests)

    def identify(self, token: bytes) -> KeyHolder | None:
        """Who holds a presented key, or None. Compares against every key in constant time
        (digests of equal length, no early exit), so neither which key matched nor any key's
        length leaks through timing."""
        digest = hashlib.sha256(token).digest()
        found: KeyHolder | None = None
        for known, name in self.digests:
            if hmac.compare_digest(digest, known):
                found = KeyHolder(name, known in self.admins)
        return found


@dataclass(frozen=True)
class KeyHolder:
    """A key's tenant, and whether it is an admin key (sees every tenant's numbers)."""

    tenant: str
    admin: bool


def load_api_key_file(path: str | Path) -> Tenants:
    """Parse and validate the file; a `ValueError` names the file and line of the first problem
    (never the key itself)."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"--api-key-file {path}: cannot read it: {getattr(exc, 'strerror', None) or exc}") from None
    entries: list[tuple[bytes, str]] = []
    admins: set[bytes] = set()
    seen: dict[bytes, int] = {}
    explicit: dict[str, int] = {}
    unnamed: dict[str, int] = {}
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        where = f"--api-key-file {path}, line {number}"
        parts = line.split()
        if len(parts) > 3 or (len(parts) == 3 and parts[2] != ADMIN):
            raise ValueError(f"{where}: expected `key` or `key tenant-name`, got {len(parts)} fields "
                             f"(a third field can only be `{ADMIN}`)")
        key = parts[0]
        if len(parts) >= 2:
            name = parts[1]
            if not _NAME.fullmatch(name):
                raise ValueError(
                    f"{where}: the tenant name must be 1-64 characters of letters, digits, '.', '_' "
                    "and '-', starting with a letter or digit"
                )
            explicit.setdefault(name, number)
        else:
            name = derived_name(key)
            unnamed[name] = number
        digest = hashlib.sha256(key.encode()).digest()
        if digest in seen:
            raise ValueError(f"{where}: the same key as on line {seen[digest]}")
        seen[digest] = number
        entries.append((digest, name))
        if len(parts) == 3:
            admins.add(digest)
    if not entries:
        raise ValueError(f"--api-key-file {path}: no keys (only blank lines and # comments)")
    for name, number in unnamed.items():
        if name in explicit:
            raise ValueError(
                f"--api-key-file {path}, line {explicit[name]}: the tenant name {name} is the one derived "
                f"for the unnamed key on line {number}; choose another name"
            )
    return Tenants(tuple(entries), frozenset(admins))


def sees_everything(scope: dict[str, Any]) -> bool:
    """Whether the request may see every tenant's numbers: no tenants (no key, or the single
    --api-key), or an admin key of the file."""
    return scope.get(SCOPE_KEY) is None or bool(scope.get(ADMIN_SCOPE_KEY))


def namespace(tenant: str, salt: str | None) -> str:
    """A tenant's cache namespace, narrowed by the client's salt if it sent one."""
    return tenant if salt is None else f"{tenant}\x00{salt}"


def salt_in(tenant: str | None, namespace: str | None) -> tuple[bool, str | None]:
    """Whether a cache namespace is the tenant's (always, without tenants), and the client's
    salt in it: `namespace` undone."""
    if tenant is None:
        return True, namespace
    if namespace == tenant:
        return True, None
    if namespace is not None and namespace.startswith(tenant + "\x00"):
        return True, namespace[len(tenant) + 1 :]
    return False, None


def scope_requests(scope: dict[str, Any], requests: list[GenerateRequest]) -> None:
    """Put requests in the tenant of the key that authenticated them (if tenants are on): their
    cache namespace becomes the tenant's, narrowed by any salt the client gave."""
    tenant = scope.get(SCOPE_KEY)
    if tenant is None:
        return
    for req in requests:
        req.cache_salt = namespace(tenant, req.cache_salt)
        req.tenant = tenant
