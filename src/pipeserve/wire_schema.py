"""Typed fields of the fixed JSON schemas that cross process boundaries, and a job's codec.

Two channels carry generation jobs between processes and never unpickle anything: the
sharded model's control channel (engine/sharding/frames.py, rank 0 to each rank) and the
engine host's wire (server/remote/wire.py, a gunicorn worker to the engine host). Both
decode a frame with `decode_object`, then check every field with the helpers below: the
exact type (a bool is not an int, an int is not a string), a range, a length; anything
else is a ProtocolError naming what was expected. A GenerationJob travels field for
field (`encode_job` / `decode_job`); its grammar constraint travels as its spec (the
grammar's text), since a matcher cannot cross processes.
"""

from __future__ import annotations

import json
from dataclasses import fields
from typing import Any

from pipeserve.engine.base import GenerationJob, ThinkingLimit
from pipeserve.request import SamplingParams

# Strings (a grammar, stop strings, a mock completion) are bounded by the frame's size
# only: whatever the HTTP API accepts must pass, or one request would break the channel.
TEXT = 1 << 30
INT64 = (-(1 << 63), 1 << 63)


class ProtocolError(ValueError):
    """A frame that does not follow its schema (or a handshake that fails)."""


def decode_object(data: bytes, what: str = "control frame") -> dict[str, Any]:
    """A frame's JSON object; ProtocolError for anything else (never an exception of
    another kind, whatever the bytes)."""
    try:
        body = json.loads(data)
    except (ValueError, RecursionError) as exc:
        raise ProtocolError(f"a {what} that is not JSON ({str(exc)[:80]})") from None
    if not isinstance(body, dict):
        raise ProtocolError(f"a {what} that is not a JSON object")
    return body


def encode_object(body: dict[str, Any]) -> bytes:
    return json.dumps(body, separators=(",", ":")).encode()


# ---------------------------------------------------------------- typed fields


def int_in(value: Any, low: int, high: int) -> int:
    if type(value) is not int or not low <= value < high:
        raise ProtocolError(f"expected an integer in [{low}, {high}), got {str(value)[:40]!r}")
    return value


def int64(value: Any) -> int:
    return int_in(value, *INT64)


def number(value: Any) -> float:
    if type(value) not in (int, float):  # (NaN and infinities pass, as Python wrote them)
        raise ProtocolError(f"expected a number, got {str(value)[:40]!r}")
    return float(value)


def optional_number(value: Any) -> float | None:
    return None if value is None else number(value)


def boolean(value: Any) -> bool:
    if type(value) is not bool:
        raise ProtocolError(f"expected true or false, got {str(value)[:40]!r}")
    return value


def text(value: Any, limit: int = TEXT) -> str:
    if not isinstance(value, str) or len(value) > limit:
        raise ProtocolError(f"expected a string of at most {limit} characters")
    return value


def optional_text(value: Any, limit: int = TEXT) -> str | None:
    return None if value is None else text(value, limit)


def array(value: Any, name: str) -> list[Any]:
    if not isinstance(value, list):
        raise ProtocolError(f"{name}: expected a list")
    return value


def fixed(value: Any, name: str, size: int) -> list[Any]:
    """A list of exactly `size` items (a tuple on the wire)."""
    items = array(value, name)
    if len(items) != size:
        raise ProtocolError(f"{name}: expected {size} items, got {len(items)}")
    return items


def obj(value: Any, name: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ProtocolError(f"{name}: expected an object")
    return value


def tokens(value: Any) -> list[int]:
    """A list of int64 token ids, checked in C (a prompt may hold 100k of them)."""
    items = array(value, "token ids")
    if items and not (
        set(map(type, items)) == {int} and INT64[0] <= min(items) and max(items) < INT64[1]
    ):
        raise ProtocolError("token ids: expected a list of 64-bit integers")
    return items


# ---------------------------------------------------------------- a job, field by field

_FLOATS = ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty",
           "frequency_penalty")  # fmt: skip
# Every GenerationJob field but `constraint` (its spec travels beside the job).
JOB_FIELDS = frozenset(f.name for f in fields(GenerationJob)) - {"constraint"}


def encode_job(job: GenerationJob) -> dict[str, Any]:
    if job.constraint is not None:
        raise ProtocolError("a job's constraint travels as its spec (outbound)")
    s = job.sampling
    return {
        "request_id": job.request_id,
        "prompt": list(job.prompt_token_ids),
        "sampling": {
            **{name: getattr(s, name) for name in _FLOATS},
            "top_k": s.top_k,
            "logit_bias": [[k, v] for k, v in s.logit_bias.items()],
            "seed": s.seed,
            "unset": sorted(s.unset),
        },
        "max_tokens": job.max_tokens,
        "stop_token_ids": sorted(job.stop_token_ids),
        "logprobs": job.logprobs,
        "top_logprobs": job.top_logprobs,
        "mock_completion": job.mock_completion,
        "keepalive_interval": job.keepalive_interval,
        "stop_strings": list(job.stop_strings),
        "prediction": job.prediction_token_ids,
        "thinking": _encode_thinking(job.thinking),
        "prompt_group": job.prompt_group,
        "group_size": job.group_size,
        "adapter": job.adapter,
    }


def decode_job(raw: Any) -> GenerationJob:
    job = obj(raw, "job")
    prediction = job.get("prediction")
    return GenerationJob(
        request_id=text(job.get("request_id")),
        prompt_token_ids=tokens(job.get("prompt")),
        sampling=_decode_sampling(job.get("sampling")),
        max_tokens=int_in(job.get("max_tokens"), 0, 1 << 62),
        stop_token_ids=frozenset(tokens(job.get("stop_token_ids"))),
        logprobs=boolean(job.get("logprobs")),
        top_logprobs=int_in(job.get("top_logprobs"), 0, 1 << 31),
        mock_completion=optional_text(job.get("mock_completion")),
        keepalive_interval=optional_number(job.get("keepalive_interval")),
        stop_strings=tuple(text(t) for t in array(job.get("stop_strings"), "stop_strings")),
        prediction_token_ids=None if prediction is None else tokens(prediction),
        thinking=_decode_thinking(job.get("thinking")),
        prompt_group=optional_text(job.get("prompt_group"), 256),
        group_size=int_in(job.get("group_size"), 1, 1 << 16),
        adapter=optional_text(job.get("adapter"), 256),
    )


def _decode_sampling(raw: Any) -> SamplingParams:
    s = obj(raw, "sampling")
    bias = {}
    for pair in array(s.get("logit_bias"), "logit_bias"):
        token, value = fixed(pair, "logit_bias", 2)
        bias[int64(token)] = number(value)
    seed = s.get("seed")
    return SamplingParams(
        **{name: number(s.get(name)) for name in _FLOATS},
        top_k=int64(s.get("top_k")),
        logit_bias=bias,
        seed=None if seed is None else int_in(seed, INT64[0], 1 << 64),
        unset=frozenset(text(n, 64) for n in array(s.get("unset"), "unset")),
    )


def _encode_thinking(limit: ThinkingLimit | None) -> dict[str, Any] | None:
    if limit is None:
        return None
    return {"budget": limit.budget, "start": list(limit.start_ids), "end": list(limit.end_ids),
            "close": list(limit.close_ids), "opened": limit.opened}  # fmt: skip


def _decode_thinking(raw: Any) -> ThinkingLimit | None:
    if raw is None:
        return None
    limit = obj(raw, "thinking")
    return ThinkingLimit(
        budget=int_in(limit.get("budget"), 0, 1 << 40),
        start_ids=tuple(tokens(limit.get("start"))),
        end_ids=tuple(tokens(limit.get("end"))),
        close_ids=tuple(tokens(limit.get("close"))),
        opened=boolean(limit.get("opened")),
    )


__all__ = [
    "INT64",
    "JOB_FIELDS",
    "TEXT",
    "ProtocolError",
    "array",
    "boolean",
    "decode_job",
    "decode_object",
    "encode_job",
    "encode_object",
    "fixed",
    "int64",
    "int_in",
    "number",
    "obj",
    "optional_number",
    "optional_text",
    "text",
    "tokens",
]
