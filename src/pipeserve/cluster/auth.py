"""The cluster's shared secret, PIPESERVE_CLUSTER_TOKEN, used and never sent.

Both sides prove they know it, per message, with HMAC-SHA256 keyed by the token:

- a request carries `Authorization: Pipeserve-HMAC ts=<unix time>, nonce=<random>,
  mac=<HMAC("request", method, path, sha256(body), ts, nonce)>`; the receiver refuses a
  bad mac, a ts more than WINDOW seconds off its clock, and a nonce it has already seen;
- the answer carries `X-Pipeserve-Signature: <HMAC("response", the request's nonce,
  status, sha256(body))>`, and the serving machine uses no answer whose signature fails.

So a peer without the token learns nothing from a request that would let it answer or
ask, and the rank group's secret is derived from the token (group_secret), never sent.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import re
import secrets
import threading
import time

TOKEN_ENV = "PIPESERVE_CLUSTER_TOKEN"
MIN_LENGTH = 16
SCHEME = "Pipeserve-HMAC"
SIGNATURE_HEADER = "X-Pipeserve-Signature"
# Seconds a request's timestamp may differ from the receiver's clock (the machines'
# clocks must agree that closely); its nonce is remembered for twice as long.
WINDOW = 60.0
_FIELDS = re.compile(
    r"^ts=([0-9]{1,12}(?:\.[0-9]{1,6})?), nonce=([0-9a-f]{32}), mac=([0-9a-f]{64})$"
)


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


def _mac(token: str, *parts: str) -> str:
    message = "\n".join(parts).encode()
    return hmac.new(token.encode(), message, hashlib.sha256).hexdigest()


def _body_hash(body: bytes) -> str:
    return hashlib.sha256(body).hexdigest()


def sign_request(
    token: str, method: str, path: str, body: bytes = b"", now: float | None = None
) -> tuple[dict[str, str], str]:
    """(the Authorization header of one request, its nonce: the answer must be bound to it)."""
    stamp = f"{time.time() if now is None else now:.3f}"
    nonce = secrets.token_hex(16)
    mac = _mac(token, "request", method.upper(), path, _body_hash(body), stamp, nonce)
    return {"Authorization": f"{SCHEME} ts={stamp}, nonce={nonce}, mac={mac}"}, nonce


def sign_response(token: str, nonce: str, status: int, body: bytes) -> dict[str, str]:
    return {SIGNATURE_HEADER: _mac(token, "response", nonce, str(status), _body_hash(body))}


def response_signed(token: str, nonce: str, status: int, body: bytes, header: str | None) -> bool:
    """Whether an answer was signed by a holder of `token`, for the request with `nonce`."""
    expected = _mac(token, "response", nonce, str(status), _body_hash(body))
    return hmac.compare_digest((header or "").strip().encode(), expected.encode())


def group_secret(token: str, group_nonce: str) -> str:
    """The rank group's control-channel secret: derived from the token by rank 0 and by
    each node from the assignment's nonce, so it never crosses the node API."""
    return _mac(token, "group", group_nonce)


class RequestVerifier:
    """A receiver's check of signed requests, replays included (one per server)."""

    def __init__(self, token: str, window: float = WINDOW) -> None:
        self.token = token
        self.window = window
        self._seen: dict[str, float] = {}  # nonce -> when it may be forgotten
        self._lock = threading.Lock()

    def check(
        self, header: str | None, method: str, path: str, body: bytes, now: float | None = None
    ) -> tuple[str | None, str | None]:
        """(the request's nonce, None) when it is authentic and new, else (None, why not)."""
        scheme, _, fields = (header or "").partition(" ")
        found = _FIELDS.match(fields.strip()) if scheme == SCHEME else None
        if found is None:
            return None, f"a request signed with {TOKEN_ENV} ({SCHEME}) is needed"
        stamp, nonce, mac = found.groups()
        expected = _mac(self.token, "request", method.upper(), path, _body_hash(body), stamp, nonce)
        if not hmac.compare_digest(mac.encode(), expected.encode()):
            return None, f"wrong signature: {TOKEN_ENV} differs between the machines"
        clock = time.time() if now is None else now
        off = float(stamp) - clock
        if abs(off) > self.window:
            return None, (
                f"request time is {off:+.0f} s off this machine's clock (limit {self.window:g} s):"
                " synchronise the clocks"
            )
        with self._lock:
            self._seen = {n: t for n, t in self._seen.items() if t > clock}
            if nonce in self._seen:
                return None, "replayed request refused"
            self._seen[nonce] = clock + 2 * self.window
        return nonce, None
