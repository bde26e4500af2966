"""llama.cpp server bodies -> protocol-neutral requests.

- `/infill` (input_prefix, input_suffix, input_extra, prompt): a raw fill-in-the-middle
  prompt in llama.cpp's repository-level layout (render_template / stages/fim.py); the
  sampling fields left out take the model's defaults (llama.cpp's own defaults are its
  server's, not the model's); `n_predict` -1 or absent: the model's default_max_tokens;
  `seed` -1 (or 4294967295, llama.cpp's "random"): unseeded. `n_probs` above 0 is a 400
  (token probabilities are not served on this route).
- `/tokenize`: `content` (text) or `messages` (an OpenAI Chat conversation, with `tools`
  and `chat_template_kwargs` as Chat reads them, rendered as generation renders it);
  exactly one of the two. `add_special` (BOS) applies to `content` only.
- `/detokenize`: `tokens`.
`model` may be left out where the route serves one model (llama.cpp serves one).
"""

from __future__ import annotations

from typing import Any

from pipeserve.api.llama_cpp.schema import DetokenizeIn, InfillIn, TokenizeIn
from pipeserve.api.openai_chat.decode import decode_chat
from pipeserve.api.openai_common import check, seed_value, unsupported, validate
from pipeserve.errors import invalid
from pipeserve.request import (
    DetokenizeRequest,
    FillInMiddle,
    GenerationRequest,
    RawPrompt,
    TokenizeRequest,
    sampling_params,
)

RANDOM_SEEDS = (-1, 0xFFFFFFFF)


def decode_infill(body: Any) -> GenerationRequest:
    req = validate(InfillIn, body)
    if req.n_probs:
        raise unsupported("n_probs", "token probabilities are not served on /infill")
    for i, stop in enumerate(req.stop or []):
        check(stop != "", f"stop[{i}]", "stop strings must not be empty")
    extra = tuple((f.filename, f.text) for f in req.input_extra)
    fim = FillInMiddle(
        suffix=req.input_suffix, param="model", repo_level=True, extra=extra, prompt=req.prompt
    )
    return GenerationRequest(
        model=req.model or "",
        messages=[],
        raw_prompt=RawPrompt(text=req.input_prefix, fim=fim),
        sampling=sampling_params(
            temperature=req.temperature,
            top_k=None if req.top_k is None else max(req.top_k, 0),
            top_p=req.top_p,
            min_p=req.min_p,
            repetition_penalty=None if req.repeat_penalty is None else req.repeat_penalty or 1.0,
            presence_penalty=req.presence_penalty,
            frequency_penalty=req.frequency_penalty,
            seed=None if req.seed in (None, *RANDOM_SEEDS) else seed_value(req.seed),
        ),
        max_tokens=max_tokens(req),
        stop=list(dict.fromkeys(req.stop or [])),
        stream=bool(req.stream),
        mock_response=req.mock_response,
    )


def max_tokens(req: InfillIn) -> int | None:
    if req.n_predict is not None and req.n_predict > 0:
        return req.n_predict
    if req.n_predict == 0:
        raise invalid("Invalid value for 'n_predict': must be -1 or at least 1.", "n_predict")
    return req.max_tokens


def decode_tokenize(body: Any) -> TokenizeRequest:
    req = validate(TokenizeIn, body)
    has_content, has_messages = req.content is not None, req.messages is not None
    if has_content == has_messages:
        problem = "both were sent" if has_content else "neither was sent"
        message = (
            f"Send exactly one of 'content' (text) and 'messages' (a conversation): {problem}."
        )
        raise invalid(message, "content")
    if has_content:
        return TokenizeRequest(
            model=req.model,
            content=req.content,
            add_special=req.add_special,
            parse_special=req.parse_special,
            with_pieces=req.with_pieces,
        )
    check(not req.add_special, "add_special", "the rendered conversation holds the template's "
          "special tokens already; send it without add_special")  # fmt: skip
    assert isinstance(body, dict)
    chat = decode_chat({**body, "model": req.model or "-"})
    return TokenizeRequest(model=req.model, chat=chat, with_pieces=req.with_pieces)


def decode_detokenize(body: Any) -> DetokenizeRequest:
    req = validate(DetokenizeIn, body)
    return DetokenizeRequest(model=req.model, tokens=list(req.tokens))


__all__ = ["decode_detokenize", "decode_infill", "decode_tokenize"]
