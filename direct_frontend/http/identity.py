"""Who a request is: the owner of what it stores, from its credential, and the id a client
gave it (sans-IO).

An owner is the identity of the API key the request carried, a hash under
a fixed key (blake2b, 128 bits): the same on every worker, replica and
restart, so a sibling or a database checks it as this process does, and
never the key itself, so neither memory, the replica bus nor a log holds a
credential. With no API keys configured everyone is one owner
(:data:`ANONYMOUS`), as a single-user proxy is. ``[frontend.auth]
tenant_header`` narrows the owner to the tenant a trusted gateway names,
within the key: two tenants behind one key are apart, and no header lets
one key reach another key's objects.
"""

from __future__ import annotations

import re
from typing import Final

import msgspec

from direct_frontend.fleet.keys import key_identity, narrowed, tenant_flow
from direct_frontend.fleet.schema import AuthConfig, FrontendConfig
from direct_frontend.http.admin import api_key, bearer
from direct_frontend.http.asgi import Scope, header
from direct_frontend.openai.response_store import ANONYMOUS

#: a client's ``x-request-id`` is kept if it is this: short, and nothing a log line or a
#: header could be broken by (a UUID, a trace id, a gateway's id all are)
CLIENT_REQUEST_ID: Final = re.compile(rb"[A-Za-z0-9._:+=/@-]{1,128}")


def owner_of(auth: AuthConfig, scope: Scope) -> str:
    """The owner of what the request stores (its credential has been checked already)."""
    owner = ANONYMOUS
    if auth.api_keys:
        credential = bearer(scope) or api_key(scope)
        owner = key_identity(credential) if credential else ANONYMOUS
    if auth.tenant_header is not None:
        tenant = header(scope, auth.tenant_header.lower().encode())
        if tenant:
            owner = narrowed(owner, tenant)
    return owner


def client_request_id(scope: Scope) -> str | None:
    """The client's own ``x-request-id``, if it sent a well-formed one."""
    value = header(scope, b"x-request-id")
    return value.decode() if value and CLIENT_REQUEST_ID.fullmatch(value) else None


class Caller(msgspec.Struct, frozen=True):
    """Who sent a request: the owner of what it stores, and the tenant whose share of the
    admission queue it takes (``[frontend.tenants]``: the owner, unless a header names one;
    a body field may name another once the body is read, pipeline/tenancy.py
    ``named_in_body``)."""

    owner: str
    tenant: str


def caller_of(frontend: FrontendConfig, scope: Scope) -> Caller:
    owner = owner_of(frontend.auth, scope)
    named_by = frontend.tenants.header
    value = b"" if named_by is None else header(scope, named_by.lower().encode())
    return Caller(owner, tenant_flow(value) if value else owner)
