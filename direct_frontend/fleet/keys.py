"""``[frontend.auth]``: the OpenAI endpoints' keys, from the fleet file, the environment and a file.

A fleet file is often world-readable or kept in version control, so the keys
may live elsewhere: ``api_keys_env`` names an environment variable holding
keys separated by commas or whitespace, ``api_keys_file`` a file holding one
key per line (blank lines and ``#`` comments skipped; a relative path starts
at the fleet file's directory). The loader reads both at every load and
reload, and the union with the keys written in ``api_keys`` becomes
``api_keys`` itself, which is all the rest of the daemon reads: a rotated
key file applies with a reload. A variable that is unset or holds no key,
or a file that cannot be read or holds no key, is a problem on the line and
field that names it, so ``run`` refuses to start open by mistake and a
reload keeps the running fleet. Messages name the variable, the file and
the line, never a key.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import re
from collections.abc import Callable, Mapping
from pathlib import Path

from direct_frontend.fleet.checker import Checker, keys_of, secret_problem
from direct_frontend.fleet.locate import KeyPath, Locator
from direct_frontend.fleet.schema import AuthConfig, TenantConfig, TenantsConfig

_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_SEPARATORS = re.compile(r"[,\s]+")
_COMMENT = re.compile(r"(?:^|\s)#.*$")  # a "#" at the start or after a space: keys have none


@dataclasses.dataclass(frozen=True, slots=True)
class KeySources:
    """Where ``api_keys_env`` and ``api_keys_file`` are read from (a test gives its own)."""

    environ: Mapping[str, str]
    read_text: Callable[[Path], str]


def process_sources() -> KeySources:
    """This process's environment and filesystem."""
    return KeySources(os.environ, lambda path: path.read_text(encoding="utf-8"))


def env_keys(value: str) -> list[str]:
    """The keys of an environment variable's value: separated by commas or whitespace."""
    return [key for key in _SEPARATORS.split(value) if key]


def file_keys(text: str) -> list[tuple[int, str]]:
    """(line number, key) for each key of a keys file: one a line, ``#`` comments skipped."""
    out = []
    for number, line in enumerate(text.splitlines(), 1):
        key = _COMMENT.sub("", line).strip()
        if key:
            out.append((number, key))
    return out


#: the owner-id hash's key: a domain of its own, so an owner id equals no other hash of a key
_OWNER_KEY = b"direct-frontend/owner/1"


def key_identity(credential: str) -> str:
    """The owner id of an API key: 33 characters that do not reveal the key.

    A hash under a fixed key (blake2b, 128 bits): the same on every worker,
    replica and restart, so a sibling or a database checks it as this process
    does, and never the key itself.
    """
    return "k" + hashlib.blake2b(credential.encode(), key=_OWNER_KEY, digest_size=16).hexdigest()


def narrowed(owner: str, tenant: bytes) -> str:
    """``owner`` narrowed to the tenant a trusted header names (hashed as a key is)."""
    return owner + "/t" + hashlib.blake2b(tenant[:256], key=_OWNER_KEY, digest_size=16).hexdigest()


def tenant_flow(value: bytes) -> str:
    """The admission flow of a tenant a header names (cut at 256 bytes: a name, not a body)."""
    return named_flow(value[:256].decode("latin-1"))


def named_flow(name: str) -> str:
    """The admission flow of a tenant named ``name`` (cut at 256 characters)."""
    return "h:" + name[:256]


class AuthTables(Checker):
    """Reads ``[frontend.auth]``, resolving its keys from the environment and a keys file."""

    def __init__(self, file: str, locator: Locator, sources: KeySources) -> None:
        super().__init__(file, locator)
        self.key_sources = sources

    def auth(self, value: object, path: KeyPath, source: Path) -> AuthConfig:
        tbl = self.table(value, path, keys_of(AuthConfig))
        if tbl is None:
            return AuthConfig()
        keys: list[str] = list(self.read(AuthConfig, "api_keys", tbl, path) or ())
        env = self.string(tbl, path, "api_keys_env")
        if env is not None:
            keys += self.keys_of_env(env, (*path, "api_keys_env"))
        file: Path | None = None
        written = self.string(tbl, path, "api_keys_file")
        if written is not None:
            file = source.parent / written
            if written.startswith("~"):
                self.report((*path, "api_keys_file"),
                            f"{written!r}: '~' is not expanded; write the full path")
            else:
                keys += self.keys_of_file(file, (*path, "api_keys_file"))
        by_hand = {"api_keys": tuple(dict.fromkeys(keys)),  # the union, in order, once each
                   "api_keys_env": env, "api_keys_file": file}
        return AuthConfig(**self.fields(AuthConfig, tbl, path, by_hand))

    def tenants(self, value: object, path: KeyPath) -> TenantsConfig:
        """``[frontend.tenants]`` with each ``[[frontend.tenants.tenant]]`` resolved to the
        flow it matches: the tenant a header or body field names, or the owner of an API key."""
        tbl = self.table(value, path, keys_of(TenantsConfig))
        if tbl is None:
            return TenantsConfig()
        header = self.string(tbl, path, "header")
        named_by = None if header is None else "header"
        if tbl.get("field") is not None:
            if header is not None:
                self.report((*path, "field"), "give header or field, not both: one of them "
                            "names the tenants")
            named_by = "field"
        raw = tbl.get("tenant", [])
        tenants: list[TenantConfig] = []
        if not isinstance(raw, list):
            self.report((*path, "tenant"), "expected an array of tables "
                        "([[frontend.tenants.tenant]])")
            raw = []
        for index, item in enumerate(raw, 1):
            where = (*path, "tenant", index)
            entry = self.table(item, where, keys_of(TenantConfig))
            if entry is None:
                continue
            tenant = TenantConfig(**self.fields(TenantConfig, entry, where, {"flow": ""}))
            flow = self.tenant_flow(tenant, named_by, where)
            if flow is not None:
                tenants.append(dataclasses.replace(tenant, flow=flow))
        flows = [tenant.flow for tenant in tenants]
        if len(set(flows)) < len(flows):
            self.report((*path, "tenant"), "two tenants are the same one")
        labels = [tenant.label for tenant in tenants]
        if len(set(labels)) < len(labels):
            self.report((*path, "tenant"), "two tenants have the same name")
        return TenantsConfig(**self.fields(TenantsConfig, tbl, path,
                                           {"header": header, "tenant": tuple(tenants)}))

    def tenant_flow(self, tenant: TenantConfig, named_by: str | None,
                    where: KeyPath) -> str | None:
        """The flow of one listed tenant: its name's, when a header or field names the
        tenants (``named_by``), else its API key's owner."""
        if named_by is not None:
            if tenant.api_key_env is not None:
                self.report((*where, "api_key_env"), f"with [frontend.tenants] {named_by} "
                            "its value names the tenants: give name instead")
                return None
            if tenant.name is None:
                self.report(where, f"give the tenant's name (the value of the {named_by} "
                            "that names it)")
                return None
            if named_by == "field":  # a JSON string: any text
                return named_flow(tenant.name)
            return tenant_flow(tenant.name.encode("latin-1", "replace"))
        if tenant.api_key_env is None:
            self.report(where, "give the tenant's api_key_env (the variable holding its API "
                        "key), or [frontend.tenants] header or field for tenants named so")
            return None
        keys = self.keys_of_env(tenant.api_key_env, (*where, "api_key_env"))
        if len(keys) != 1:
            if keys:
                self.report((*where, "api_key_env"), f"${tenant.api_key_env} must hold one key")
            return None
        return key_identity(keys[0])

    def keys_of_env(self, name: str, where: KeyPath) -> list[str]:
        if not _ENV_NAME.fullmatch(name):
            self.report(where, f"{name!r} is not an environment variable name")
            return []
        value = self.key_sources.environ.get(name)
        if value is None:
            self.report(where, f"the environment variable {name} is not set")
            return []
        keys = env_keys(value)
        if not keys:
            self.report(where, f"the environment variable {name} holds no keys")
        for index, key in enumerate(keys, 1):
            problem = secret_problem(key)
            if problem is not None:
                self.report(where, f"key {index} of ${name} {problem}")
                return []
        return keys

    def keys_of_file(self, file: Path, where: KeyPath) -> list[str]:
        try:
            text = self.key_sources.read_text(file)
        except OSError as exc:
            self.report(where, f"cannot read {file}: {exc.strerror or type(exc).__name__}")
            return []
        except UnicodeDecodeError:
            self.report(where, f"{file} is not UTF-8 text")
            return []
        keys = file_keys(text)
        if not keys:
            self.report(where, f"{file} holds no keys (one a line, # starts a comment)")
        for number, key in keys:
            problem = secret_problem(key)
            if problem is not None:
                self.report(where, f"{file}:{number}: the key {problem}")
                return []
        return [key for _, key in keys]
