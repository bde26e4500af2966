"""Reading and parsing request bodies with a size limit, in protocol-neutral errors."""

from __future__ import annotations

import json
import re
import zlib
from collections.abc import Callable
from typing import Any

import falcon
from falcon.typing import ReadableIO

from pipeserve.errors import ApiError
from pipeserve.gevent_support import gevent_patched

READ_CHUNK = 64 * 1024
BODY_READ_TIMEOUT = 30.0  # default seconds without a byte of the announced body: 408
# A JSON `\uD800`-`\uDFFF` escape: only then can the parsed text hold a lone surrogate.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


def read_json_body(
    req: falcon.Request, max_bytes: int, read_timeout: float = BODY_READ_TIMEOUT
) -> Any:
    """Return the parsed JSON body; ApiError 413 when too large, 400 when malformed."""
    length = req.content_length
    if length is not None and length > max_bytes:
        raise ApiError(
            "too_large", f"request body of {length} bytes exceeds the limit of {max_bytes} bytes"
        )
    raw = _decode_content(req, _read_with_timeout(req, max_bytes, read_timeout), max_bytes)
    if not raw.strip():
        raise ApiError("invalid_request", "request body is empty; expected a JSON object")
    try:
        value = json.loads(raw, parse_constant=_reject_constant)
        if _SURROGATE_ESCAPE.search(raw):
            value = replace_lone_surrogates(value)
    except UnicodeDecodeError:
        raise ApiError("invalid_request", "request body is not valid UTF-8") from None
    except json.JSONDecodeError as exc:
        raise ApiError(
            "invalid_request",
            f"request body is not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}",
        ) from None
    except RecursionError:
        raise ApiError(
            "invalid_request", "request body is not valid JSON: nested too deeply"
        ) from None
    except ValueError as exc:  # an integer literal of more than 4300 digits; NaN / Infinity
        detail = str(exc).split(";")[0]  # not CPython's hint about sys.set_int_max_str_digits
        raise ApiError("invalid_request", f"request body is not valid JSON: {detail}") from None
    return value


def _reject_constant(name: str) -> Any:
    """`NaN`, `Infinity` and `-Infinity` are not JSON (RFC 8259), though Python parses them;
    refused here so no field without a range check ever carries one."""
    raise ValueError(f"{name} is not a JSON number")


def _decode_content(req: falcon.Request, raw: bytes, max_bytes: int) -> bytes:
    """Undo a gzip / deflate Content-Encoding, inflating to at most `max_bytes` (a small
    compressed body can expand to gigabytes); any other coding is refused by name."""
    coding = (req.get_header("Content-Encoding") or "identity").strip().lower()
    if coding in ("", "identity"):
        return raw
    if coding not in ("gzip", "x-gzip", "deflate"):
        raise ApiError(
            "invalid_request",
            f"Content-Encoding {coding!r} is not supported; send identity, gzip or deflate",
        )
    # wbits 47 reads a gzip or zlib header; a raw deflate stream (no header) needs -15.
    wbits = 47 if coding != "deflate" or raw[:1] == b"\x78" else -zlib.MAX_WBITS
    inflater = zlib.decompressobj(wbits)
    try:
        data = inflater.decompress(raw, max_bytes + 1)
    except zlib.error as exc:
        raise ApiError(
            "invalid_request", f"request body is not valid {coding} data: {exc}"
        ) from None
    if len(data) > max_bytes:
        raise ApiError(
            "too_large", f"request body inflates to more than the limit of {max_bytes} bytes"
        )
    if not inflater.eof:
        raise ApiError("invalid_request", f"request body is truncated {coding} data")
    return data


def _read_with_timeout(req: falcon.Request, max_bytes: int, timeout: float) -> bytes:
    """A client that announces more bytes than it sends would hold its connection and a
    greenlet forever: give up after `timeout` seconds of silence (gevent only;
    elsewhere the WSGI server's own socket timeout applies)."""
    stream = _body_stream(req)
    if not gevent_patched("socket"):
        return _read_limited(_framed(stream.read), max_bytes)
    import gevent

    def read(size: int) -> bytes:
        try:
            with gevent.Timeout(timeout):
                return stream.read(size)
        except gevent.Timeout:
            _close_after_response(req)
            raise ApiError(
                "body_timeout",
                f"no request body bytes arrived for {timeout:g} s (Content-Length larger than the body?)",
            ) from None

    return _read_limited(_framed(read), max_bytes)


def _framed(read: Callable[[int], bytes]) -> Callable[[int], bytes]:
    """The server's body reader raises its own errors on a malformed chunked body (bad
    chunk size, missing CRLF) or a body cut short by the client (EOF before
    Content-Length): those are the client's mistakes, a 400, never a 500."""

    def framed_read(size: int) -> bytes:
        try:
            return read(size)
        except ApiError:
            raise
        except OSError:  # gunicorn's NoMoreData, a reset socket
            raise ApiError(
                "invalid_request", "the connection ended before the whole request body arrived"
            ) from None
        except Exception as exc:  # gunicorn's ParseException: bad chunk size, missing CRLF
            detail = str(exc).strip() or type(exc).__name__
            raise ApiError("invalid_request", f"request body could not be read: {detail}") from None

    return framed_read


def _close_after_response(req: falcon.Request) -> None:
    """After a 408 the rest of the body may never come: tell gunicorn not to wait for it
    (it would drain the connection for its whole keep-alive time) but to close."""
    body: Any = req.env.get("wsgi.input")
    if hasattr(body, "failed"):
        body.failed = True


def _body_stream(req: falcon.Request) -> ReadableIO:
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


def replace_lone_surrogates(value: Any) -> Any:
    """JSON may escape unpaired UTF-16 surrogates (`"\\ud83d"`, e.g. a JS string cut in the
    middle of an emoji); they cannot be encoded or tokenized, so they become U+FFFD."""
    if isinstance(value, str):
        return _LONE_SURROGATE.sub("\ufffd", value)
    if isinstance(value, list):
        return [replace_lone_surrogates(item) for item in value]
    if isinstance(value, dict):
        return {replace_lone_surrogates(k): replace_lone_surrogates(v) for k, v in value.items()}
    return value
