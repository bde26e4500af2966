"""Server-sent events framing shared by the streaming encoders.

One event is `event: NAME` (optional) + `data: JSON` + a blank line. JSON is compact
and never contains a raw newline (json.dumps escapes them), so one `data:` line always
suffices.
"""

from __future__ import annotations

import json
from typing import Any


def sse_event(data: dict[str, Any] | str, event: str | None = None) -> bytes:
    """Frame one SSE event; `data` is a JSON-able dict or a preformatted string (`[DONE]`)."""
    if isinstance(data, str):
        payload = data
    else:
        payload = json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {payload}\n\n".encode()


def sse_comment(text: str = "") -> bytes:
    """An SSE comment line (ignored by clients; keeps idle connections alive)."""
    lines = text.split("\n") if text else [""]
    return "".join(f": {line}\n" if line else ":\n" for line in lines).encode() + b"\n"


__all__ = ["sse_comment", "sse_event"]
