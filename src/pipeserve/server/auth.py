"""API keys: which key a request carries, compared in constant time, and what it may use.

Keys come from `server.api_keys` (optionally scoped to models) and from the environment
(PIPESERVE_API_KEY, PIPESERVE_API_KEYS: every model). Only SHA-256 digests are kept,
and the given key's digest is compared with every one of them (hmac.compare_digest, no
early exit), so neither a key's length nor its position leaks through timing. A key
scoped to some models sees the others as not found, in the protocol's own shape. No key
is ever logged: a request log names the key by its `name` (or `key-N`).

Stored responses belong to the key that stored them (`Grant.owner`): an id derived from
the key itself (a keyed digest, so names, their order and the environment's keys cannot
make two keys one owner), never the key.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import falcon

from pipeserve.api.openai_common import openai_error_body
from pipeserve.config.models import ApiKeyEntry
from pipeserve.errors import ApiError
from pipeserve.server.request_log import annotate
from pipeserve.store.base import Owner

OWNER_CONTEXT = b"pipeserve response owner\0"

UNRESTRICTED = "this API key is limited to some models; {what} needs an unrestricted key"
MISSING_KEY = "invalid or missing API key (send Authorization: Bearer KEY or x-api-key)"


@dataclass(frozen=True)
class Grant:
    """What an authenticated request may use; `models` None means every model."""

    key_name: str | None = None
    models: frozenset[str] | None = None
    owner: str = ""  # whose stored responses it sees ("": the server has no keys)

    def scope(self, allowed: set[str] | None) -> set[str] | None:
        """The endpoint's model restriction narrowed to this key's models."""
        if self.models is None:
            return allowed
        return set(self.models) if allowed is None else allowed & self.models


OPEN = Grant()  # no keys configured


@dataclass(frozen=True)
class _Key:
    digest: bytes
    grant: Grant


class KeyRing:
    def __init__(self, keys: Sequence[_Key] = ()) -> None:
        self._keys = tuple(keys)

    @classmethod
    def build(cls, entries: Sequence[ApiKeyEntry], env_keys: Iterable[str] = ()) -> KeyRing:
        keys = [
            _Key(
                _digest(entry.key.get_secret_value()),
                Grant(
                    entry.name or f"key-{i + 1}",
                    frozenset(entry.models) if entry.models is not None else None,
                    _owner(_digest(entry.key.get_secret_value())),
                ),
            )
            for i, entry in enumerate(entries)
        ]
        keys += [_Key(_digest(key), Grant("env-key", owner=_owner(_digest(key))))
                 for key in env_keys if key]  # fmt: skip
        return cls(keys)

    @property
    def enabled(self) -> bool:
        return bool(self._keys)

    def authenticate(self, req: falcon.Request) -> Grant:
        """The grant of the request's key; ApiError 401 when keys are set and it has none."""
        if not self._keys:
            return OPEN
        found: Grant | None = None
        for given in map(_digest, presented_keys(req)):
            for key in self._keys:  # every key is compared, match or not
                if hmac.compare_digest(given, key.digest) and found is None:
                    found = key.grant
        if found is None:
            raise ApiError("authentication", MISSING_KEY)
        return found


def presented_keys(req: falcon.Request) -> tuple[str, str]:
    """The x-api-key header (Anthropic clients) and the Bearer token (OpenAI, Ollama)."""
    bearer = req.get_header("Authorization") or ""
    token = bearer[7:] if bearer[:7].lower() == "bearer " else ""
    return (req.get_header("x-api-key") or "").strip(), token.strip()


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()


def _owner(digest: bytes) -> str:
    """The store's owner id of a key: not its digest (a store's reader learns nothing
    that the key ring compares against)."""
    return "k:" + hashlib.sha256(OWNER_CONTEXT + digest).hexdigest()[:32]


def store_owner(grant: Grant, allowed: set[str] | None) -> Owner:
    """Whose stored responses a request may see: its key's, of the models it may use on
    the route (`allowed`: the endpoint's models, None for every one)."""
    scope = grant.scope(allowed)
    return Owner(grant.owner, None if scope is None else frozenset(scope))


def openai_auth(req: falcon.Request, resp: falcon.Response, keys: KeyRing) -> Grant | None:
    """The request's grant, or None after answering 401 (OpenAI's shape: these routes are
    shared by both SDKs, which read `error.message` alike)."""
    try:
        grant = keys.authenticate(req)
    except ApiError as error:
        resp.status = falcon.HTTP_401
        resp.media = openai_error_body(error)
        return None
    annotate(req, key=grant.key_name)
    return grant


def unrestricted(req: falcon.Request, resp: falcon.Response, keys: KeyRing, what: str) -> bool:
    """True for a request whose key may see every model (what names every model: /metrics,
    /v1/cluster, the console's live and config views); else it is answered 401 / 403."""
    grant = openai_auth(req, resp, keys)
    if grant is None:
        return False
    if grant.models is not None:
        resp.status = falcon.HTTP_403
        resp.media = openai_error_body(ApiError("permission", UNRESTRICTED.format(what=what)))
        return False
    return True


__all__ = [
    "MISSING_KEY",
    "OPEN",
    "UNRESTRICTED",
    "Grant",
    "KeyRing",
    "openai_auth",
    "presented_keys",
    "store_owner",
    "unrestricted",
]
