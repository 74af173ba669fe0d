"""Credentials out of what the daemon shows: URLs as they may be printed (sans-IO).

A URL in the fleet file may carry a credential: user info
(``nats://user:pass@host:4222``, or a NATS token as ``nats://token@host``) or
a query parameter (``https://host/v1/traces?api_key=...``). Everything that
shows such a URL (``check``, ``check --json``, ``/fleet``, log lines and
error messages) shows :func:`redact_url` of it instead, which keeps where
the URL points and says that a credential is there without saying which.
"""

from __future__ import annotations

import logging
import re
import traceback
from collections.abc import Iterable
from urllib.parse import unquote

#: what a secret shows as, wherever it would have been printed
REDACTED = "<redacted>"

# scheme://userinfo@ (the userinfo ends at the last "@" before the path)
_USERINFO = re.compile(r"^(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*://)?(?P<userinfo>[^/?#]*)@")
# a query parameter whose name says it holds a credential: api_key, access_token, X-Amz-Signature…
_CREDENTIAL_NAME = re.compile(
    r"key|token|secret|pass|pwd|auth|sig|credential|session|cookie", re.IGNORECASE
)


def redact_url(url: str) -> str:
    """``url`` with its user info and credential-looking query values replaced by REDACTED.

    The whole user info goes (a user name alone is a token to NATS), and so
    does the value of every query parameter whose name contains ``key``,
    ``token``, ``secret``, ``pass``, ``pwd``, ``auth``, ``sig``,
    ``credential``, ``session`` or ``cookie``. Never raises: it is applied to
    text the loader has not accepted yet, to show it in a message.
    """
    shown = _USERINFO.sub(lambda m: f"{m['scheme'] or ''}{REDACTED}@", url, count=1)
    query_at = shown.find("?")
    if query_at < 0:
        return shown
    fragment_at = shown.find("#", query_at)
    end = len(shown) if fragment_at < 0 else fragment_at
    params = [_redact_param(param) for param in shown[query_at + 1:end].split("&")]
    return shown[:query_at + 1] + "&".join(params) + shown[end:]


def url_secrets(url: str) -> set[str]:
    """The credentials :func:`redact_url` hides in ``url``, as written and percent-decoded.

    The user info whole and, after a ``:``, its password; each credential
    query value. A user name alone is only a secret when it is all there is.
    """
    found: set[str] = set()
    userinfo = _USERINFO.match(url)
    if userinfo is not None and userinfo["userinfo"]:
        found.add(userinfo["userinfo"])
        found.add(userinfo["userinfo"].partition(":")[2])
    query = url.partition("?")[2].partition("#")[0]
    for param in query.split("&") if query else ():
        name, equals, value = param.partition("=")
        if equals and value and _CREDENTIAL_NAME.search(name):
            found.add(value)
    return {form for secret in found for form in (secret, unquote(secret)) if form}


def scrub(text: str, secrets: Iterable[str]) -> str:
    """``text`` with every one of ``secrets`` replaced by REDACTED (the longest first)."""
    for secret in sorted({secret for secret in secrets if secret}, key=len, reverse=True):
        text = text.replace(secret, REDACTED)
    return text


class SecretFilter(logging.Filter):
    """Replaces known secrets by REDACTED in a record's message and traceback.

    For records of libraries that print what they were given. A record
    carrying a secret keeps its level and logger; its traceback (formatted
    and redacted) becomes part of its message.
    """

    def __init__(self, secrets: Iterable[str]) -> None:
        super().__init__()
        self.secrets = {secret for secret in secrets if secret}

    def filter(self, record: logging.LogRecord) -> bool:
        if not self.secrets:
            return True
        text = record.getMessage()
        if record.exc_info:
            text += "\n" + "".join(traceback.format_exception(*record.exc_info)).rstrip()
        if not any(secret in text for secret in self.secrets):
            return True
        record.msg, record.args = scrub(text, self.secrets), None
        record.exc_info, record.exc_text = None, None
        return True


def _redact_param(param: str) -> str:
    name, equals, value = param.partition("=")
    if equals and value and _CREDENTIAL_NAME.search(name):
        return f"{name}={REDACTED}"
    return param
