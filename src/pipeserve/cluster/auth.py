"""The cluster's shared secret, PIPESERVE_CLUSTER_TOKEN, used and never sent.

Both sides prove they know it, per message, with HMAC-SHA256 keyed by the token:

- a request carries `Authorization: Pipeserve-HMAC ts=<unix time>, nonce=<random>,
  mac=<HMAC("request", method, path, sha256(body), ts, nonce, target)>`, where target is
  the address the request was sent to as the TCP connection sees it (`ip:port`); the
  receiver refuses a bad mac, a ts more than WINDOW seconds off its clock, a nonce it has
  already seen, and a target that is not the local address the request arrived at;
- the answer carries `X-Pipeserve-Signature: <HMAC("response", the request's nonce,
  status, sha256(body), local)>`, local being the node's own address of that connection,
  and the serving machine uses no answer whose signature fails for the address it dialled.

So a peer without the token learns nothing from a request that would let it answer or
ask; a request captured on the way to one node is refused by every other (its target is
in the MAC, and each node checks it against its own address); and a relay that forwards
bytes unchanged to a real node is neither trusted by the serving machine (the node signs
its own address, not the relay's) nor obeyed by the node (the request names the relay).
The rank group's secret is derived from the token (group_secret), never sent.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import re
import secrets
import threading
import time
from typing import Any

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


def endpoint(address: tuple[Any, ...]) -> str:
    """A socket address as signatures name it: `ip:port` (`[v6]:port`; an IPv4-mapped v6
    address as plain IPv4)."""
    ip, port = str(address[0]), int(address[1])
    ip = ip.split("%", 1)[0].removeprefix("::ffff:")
    return f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"


def sign_request(
    token: str,
    method: str,
    path: str,
    body: bytes = b"",
    now: float | None = None,
    target: str = "",
) -> tuple[dict[str, str], str]:
    """(the Authorization header of one request to `target` (endpoint() of the address
    the connection reached), its nonce: the answer must be bound to it)."""
    stamp = f"{time.time() if now is None else now:.3f}"
    nonce = secrets.token_hex(16)
    mac = _mac(token, "request", method.upper(), path, _body_hash(body), stamp, nonce, target)
    return {"Authorization": f"{SCHEME} ts={stamp}, nonce={nonce}, mac={mac}"}, nonce


def sign_response(
    token: str, nonce: str, status: int, body: bytes, local: str = ""
) -> dict[str, str]:
    """The answer's signature; `local`: endpoint() of the node's side of the connection."""
    mac = _mac(token, "response", nonce, str(status), _body_hash(body), local)
    return {SIGNATURE_HEADER: mac}


def response_signed(
    token: str, nonce: str, status: int, body: bytes, header: str | None, dialled: str = ""
) -> bool:
    """Whether an answer was signed by a holder of `token`, for the request with `nonce`,
    by the node at `dialled` (endpoint() of the address this side connected to)."""
    expected = _mac(token, "response", nonce, str(status), _body_hash(body), dialled)
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
        self,
        header: str | None,
        method: str,
        path: str,
        body: bytes,
        now: float | None = None,
        local: str = "",
    ) -> tuple[str | None, str | None]:
        """(the request's nonce, None) when it is authentic, new and meant for `local`
        (endpoint() of this side of its connection), else (None, why not)."""
        scheme, _, fields = (header or "").partition(" ")
        found = _FIELDS.match(fields.strip()) if scheme == SCHEME else None
        if found is None:
            return None, f"a request signed with {TOKEN_ENV} ({SCHEME}) is needed"
        stamp, nonce, mac = found.groups()
        digest = _body_hash(body)
        expected = _mac(self.token, "request", method.upper(), path, digest, stamp, nonce, local)
        if not hmac.compare_digest(mac.encode(), expected.encode()):
            why = f"wrong signature: {TOKEN_ENV} differs between the machines"
            if local:
                why += f", or it was signed for another address than {local} (relayed or replayed)"
            return None, why
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
