"""The cluster's shared secret: PIPESERVE_CLUSTER_TOKEN, the same on every machine.

Every request between the serving machine and a node (node API, model files) carries it
as `Authorization: Bearer <token>`; it is compared in constant time. A machine without
the variable accepts nothing and can ask nothing.
"""

from __future__ import annotations

import hmac
import os

TOKEN_ENV = "PIPESERVE_CLUSTER_TOKEN"
MIN_LENGTH = 16


def cluster_token() -> str | None:
    """This machine's token, or None when the variable is unset or empty."""
    token = os.environ.get(TOKEN_ENV, "").strip()
    return token or None


def token_problem(token: str | None) -> str | None:
    if token is None:
        return f"{TOKEN_ENV} is not set: a cluster needs the same secret on every machine"
    if len(token) < MIN_LENGTH:
        return f"{TOKEN_ENV} is too short: use at least {MIN_LENGTH} characters"
    return None


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def authorized(header: str | None, token: str) -> bool:
    """Whether an Authorization header carries `token` (constant-time comparison)."""
    scheme, _, sent = (header or "").partition(" ")
    if scheme.lower() != "bearer":
        return False
    return hmac.compare_digest(sent.strip().encode(), token.encode())
