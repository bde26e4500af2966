"""Reading and parsing request bodies with a size limit, in protocol-neutral errors."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any, BinaryIO

import falcon

from pipeserve.errors import ApiError
from pipeserve.gevent_support import gevent_patched

READ_CHUNK = 64 * 1024
BODY_READ_TIMEOUT = 30.0  # default seconds without a byte of the announced body: 408
# A JSON `\uD800`-`\uDFFF` escape: only then can the parsed text hold a lone surrogate.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


def read_json_body(req: falcon.Request, max_bytes: int, read_timeout: float = BODY_READ_TIMEOUT) -> Any:
    """Return the parsed JSON body; ApiError 413 when too large, 400 when malformed."""
    length = req.content_length
    if length is not None and length > max_bytes:
        raise ApiError("too_large", f"request body of {length} bytes exceeds the limit of {max_bytes} bytes")
    raw = _read_with_timeout(req, max_bytes, read_timeout)
    if not raw.strip():
        raise ApiError("invalid_request", "request body is empty; expected a JSON object")
    try:
        value = json.loads(raw)
        if _SURROGATE_ESCAPE.search(raw):
            value = _replace_lone_surrogates(value)
    except UnicodeDecodeError:
        raise ApiError("invalid_request", "request body is not valid UTF-8") from None
    except json.JSONDecodeError as exc:
        raise ApiError("invalid_request", f"request body is not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}") from None
    except RecursionError:
        raise ApiError("invalid_request", "request body is not valid JSON: nested too deeply") from None
    return value


def _read_with_timeout(req: falcon.Request, max_bytes: int, timeout: float) -> bytes:
    """A client that announces more bytes than it sends would hold its connection and a
    greenlet forever: give up after `timeout` seconds of silence (gevent only;
    elsewhere the WSGI server's own socket timeout applies)."""
    stream = _body_stream(req)
    if not gevent_patched("socket"):
        return _read_limited(stream.read, max_bytes)
    import gevent

    def read(size: int) -> bytes:
        try:
            with gevent.Timeout(timeout):
                return stream.read(size)
        except gevent.Timeout:
            raise ApiError(
                "body_timeout",
                f"no request body bytes arrived for {timeout:g} s (Content-Length larger than the body?)",
            ) from None

    return _read_limited(read, max_bytes)


def _body_stream(req: falcon.Request) -> BinaryIO:
    """A chunked body has no Content-Length: read the server's de-chunking input to EOF
    (Falcon's bounded stream would read nothing). gunicorn ends it at the last chunk."""
    chunked = "chunked" in (req.get_header("Transfer-Encoding") or "").lower()
    if req.content_length is None and chunked:
        return req.stream
    return req.bounded_stream


def _read_limited(read: Callable[[int], bytes], max_bytes: int) -> bytes:
    chunks: list[bytes] = []
    total = 0
    while True:
        chunk = read(READ_CHUNK)
        if not chunk:
            return b"".join(chunks)
        total += len(chunk)
        if total > max_bytes:
            raise ApiError("too_large", f"request body exceeds the limit of {max_bytes} bytes")
        chunks.append(chunk)


def _replace_lone_surrogates(value: Any) -> Any:
    """JSON may escape unpaired UTF-16 surrogates (`"\\ud83d"`, e.g. a JS string cut in the
    middle of an emoji); they cannot be encoded or tokenized, so they become U+FFFD."""
    if isinstance(value, str):
        return _LONE_SURROGATE.sub("\ufffd", value)
    if isinstance(value, list):
        return [_replace_lone_surrogates(item) for item in value]
    if isinstance(value, dict):
        return {_replace_lone_surrogates(k): _replace_lone_surrogates(v) for k, v in value.items()}
    return value
