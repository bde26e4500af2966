"""Reading and parsing request bodies with a size limit, in protocol-neutral errors."""

from __future__ import annotations

import json
from typing import Any

import falcon

from pipeserve.errors import ApiError

READ_CHUNK = 64 * 1024


def read_json_body(req: falcon.Request, max_bytes: int) -> Any:
    """Return the parsed JSON body; ApiError 413 when too large, 400 when malformed."""
    length = req.content_length
    if length is not None and length > max_bytes:
        raise ApiError("too_large", f"request body of {length} bytes exceeds the limit of {max_bytes} bytes")
    raw = _read_limited(req, max_bytes)
    if not raw.strip():
        raise ApiError("invalid_request", "request body is empty; expected a JSON object")
    try:
        return json.loads(raw)
    except UnicodeDecodeError:
        raise ApiError("invalid_request", "request body is not valid UTF-8") from None
    except json.JSONDecodeError as exc:
        raise ApiError("invalid_request", f"request body is not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}") from None


def _read_limited(req: falcon.Request, max_bytes: int) -> bytes:
    chunks: list[bytes] = []
    total = 0
    while True:
        chunk = req.bounded_stream.read(READ_CHUNK)
        if not chunk:
            return b"".join(chunks)
        total += len(chunk)
        if total > max_bytes:
            raise ApiError("too_large", f"request body exceeds the limit of {max_bytes} bytes")
        chunks.append(chunk)
