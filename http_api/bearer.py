"""The one reading of an `Authorization: Bearer <token>` header, for every listener that takes one:
ingress's API keys and admin token, billing's admin routes and the dashboard."""
from __future__ import annotations


def bearer_token(authorization: str | None) -> str | None:
    """The token of a Bearer header (the scheme in any case), or None for no header or another scheme."""
    scheme, _, token = (authorization or "").partition(" ")
    return token.strip() if scheme.lower() == "bearer" else None
