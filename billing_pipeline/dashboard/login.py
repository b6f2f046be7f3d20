"""How a browser gets into the dashboard without ever holding the admin token.

`tokenmill dashboard --url` signs a login token with a key derived from the admin token:
short-lived and good for one use. The billing service checks it, records its use in the billing
store (so it stays used across billing processes and restarts until it expires), and answers with a
session cookie (HttpOnly, SameSite=Strict, Secure unless served over plain HTTP on loopback) signed
the same way, so a link that leaks from a terminal's scrollback or a browser history is worthless
after its first use or two minutes. Rotating the admin token ends every session.

A token is ``<expiry epoch s>.<nonce>.<signature>``; the signature is an HMAC-SHA256 over the
token's purpose and its first two parts, so a login token is never accepted as a session or the
other way round. Its key is HMAC(admin token, a fixed label), never the admin token itself: the
token is also a bearer credential, and one secret used as two keys lets a flaw in either use reach
the other.
"""
from __future__ import annotations

import base64
import hashlib
import hmac
import secrets
import threading
import time
from typing import Protocol

from infra.config import same_secret

LOGIN_TTL_S = 120
SESSION_TTL_S = 8 * 3600
SESSION_COOKIE = "tokenmill_dashboard"
LOGIN = "dashboard-login"
SESSION = "dashboard-session"


SIGNING_LABEL = b"tokenmill dashboard signing key v1"


def signing_key(admin_token: str) -> bytes:
    """The dashboard's signing key, derived from (and not equal to) the admin token."""
    return hmac.new(admin_token.encode(), SIGNING_LABEL, hashlib.sha256).digest()


def _signature(key: str, purpose: str, payload: str) -> str:
    mac = hmac.new(signing_key(key), f"{purpose}:{payload}".encode(), hashlib.sha256).digest()
    return base64.urlsafe_b64encode(mac).decode().rstrip("=")


def issue(key: str, purpose: str, ttl_s: float, now: float | None = None) -> str:
    expires = int((time.time() if now is None else now) + ttl_s)
    payload = f"{expires}.{secrets.token_urlsafe(12)}"
    return f"{payload}.{_signature(key, purpose, payload)}"


def verify(key: str, purpose: str, token: str | None, now: float | None = None) -> tuple[str, int] | None:
    """(nonce, expiry) of a well-signed token of this purpose that has not expired, else None."""
    parts = (token or "").split(".")
    if len(parts) != 3 or not parts[0].isdigit():
        return None
    payload = f"{parts[0]}.{parts[1]}"
    if not same_secret(parts[2], _signature(key, purpose, payload)):  # bytes: a non-ASCII token is just wrong
        return None
    expires = int(parts[0])
    if expires <= (time.time() if now is None else now):
        return None
    return parts[1], expires


class UsedNonces(Protocol):
    def first_use(self, nonce: str, expires: int) -> bool:
        """Record the nonce's use; True only for its first use anywhere."""


class LoginTokens:
    """Accepts each login token once: the nonces used are kept until their tokens expire, here and,
    with ``used``, in a record every billing process shares and a restart keeps."""

    def __init__(self, key: str, used: UsedNonces | None = None):
        self._key = key
        self._used: dict[str, int] = {}
        self._shared = used
        self._lock = threading.Lock()

    def redeem(self, token: str | None, now: float | None = None) -> bool:
        now = time.time() if now is None else now
        checked = verify(self._key, LOGIN, token, now)
        if checked is None:
            return False
        nonce, expires = checked
        with self._lock:
            self._used = {n: e for n, e in self._used.items() if e > now}
            if nonce in self._used:
                return False
            self._used[nonce] = expires
        return self._shared is None or self._shared.first_use(nonce, expires)

    def new_session(self, now: float | None = None) -> str:
        return issue(self._key, SESSION, SESSION_TTL_S, now)

    def session_valid(self, cookie: str | None, now: float | None = None) -> bool:
        return verify(self._key, SESSION, cookie, now) is not None


def login_url(billing_url: str, key: str, now: float | None = None) -> str:
    return f"{billing_url.rstrip('/')}/dashboard/login?token={issue(key, LOGIN, LOGIN_TTL_S, now)}"
