"""Tokenizer routes a protocol declares below its endpoint (llama.cpp's `/tokenize` and
`/detokenize`): the protocol decodes the body and shapes the answer; the model's own
tokenizer does the work. A conversation (`messages`) is rendered by the model's chain
as a dry run, exactly as a generation request would be (count_tokens does the same),
so its tokens are the prompt the model would be given."""

from __future__ import annotations

import logging
from typing import Any

import falcon
from mlx_lm.tokenizer_utils import BPEStreamingDetokenizer, SPMStreamingDetokenizer

from pipeserve.api.base import WireProtocol, context_overflow
from pipeserve.context import RequestContext
from pipeserve.errors import ApiError
from pipeserve.request import TokenizeRequest
from pipeserve.server.body import read_json_body
from pipeserve.server.generation import HttpOptions, ProtocolRoute, request_id
from pipeserve.server.registry import ModelTable, ServedModel
from pipeserve.server.request_log import annotate

log = logging.getLogger("pipeserve.http")


class TokenizerResource(ProtocolRoute):
    """One tokenizer path: the body decoded by the protocol, answered by `answer`."""

    def on_post(self, req: falcon.Request, resp: falcon.Response) -> None:
        annotate(req, protocol=self.protocol.name)
        try:
            grant = self.options.keys.authenticate(req)
            annotate(req, key=grant.key_name)
            body = read_json_body(req, self.options.max_body_bytes, self.options.body_read_timeout)
            resp.media = self.answer(req, body, grant.scope(self.allowed))
        except ApiError as error:
            annotate(req, error=error.kind)
            self.errors.render(resp, error)
        except Exception as exc:  # a bug: still answer in protocol shape
            log.exception("%s failed", self.route)
            self.errors.render(resp, ApiError("internal", f"internal error: {type(exc).__name__}"))

    def answer(self, req: falcon.Request, body: Any, scope: set[str] | None) -> dict[str, Any]:
        raise NotImplementedError


class TokenizeResource(TokenizerResource):
    def answer(self, req: falcon.Request, body: Any, scope: set[str] | None) -> dict[str, Any]:
        request = self.protocol.tokenize_body(body)
        served = self.resolve(request.model, scope)
        annotate(req, model=served.name)
        if request.chat is not None:
            tokens = conversation_tokens(served, request, request_id(req))
        else:
            tokens = text_tokens(hf_tokenizer(served), request)
        pieces = token_pieces(served.runtime.tokenizer, tokens) if request.with_pieces else None
        return self.protocol.tokenize_response(tokens, pieces)


class DetokenizeResource(TokenizerResource):
    def answer(self, req: falcon.Request, body: Any, scope: set[str] | None) -> dict[str, Any]:
        request = self.protocol.detokenize_body(body)
        served = self.resolve(request.model, scope)
        annotate(req, model=served.name)
        tokenizer = hf_tokenizer(served)
        size = len(tokenizer)
        outside = sorted({t for t in request.tokens if not 0 <= t < size})
        if outside:
            message = f"token ids {outside[:5]} are outside this model's vocabulary (0-{size - 1})."
            raise ApiError("invalid_request", message, "tokens")
        return self.protocol.detokenize_response(tokenizer.decode(request.tokens))


def hf_tokenizer(served: ServedModel) -> Any:
    tokenizer = served.runtime.tokenizer
    return getattr(tokenizer, "_tokenizer", tokenizer)


def text_tokens(tokenizer: Any, request: TokenizeRequest) -> list[int]:
    """`content` as the (Hugging Face) tokenizer encodes it: with its BOS when
    add_special, and special-token spellings read as text unless parse_special."""
    text = request.content or ""
    split = not request.parse_special
    ids = tokenizer.encode(text, add_special_tokens=False, split_special_tokens=split)
    return [*leading_specials(tokenizer), *ids] if request.add_special else list(ids)


def leading_specials(tokenizer: Any) -> list[int]:
    """What the tokenizer puts before a text by default (its BOS), as llama.cpp's
    add_special does; nothing for tokenizers that add no BOS."""
    bos = getattr(tokenizer, "bos_token_id", None)
    leading = tokenizer.encode("", add_special_tokens=True)[:1]
    return [t for t in leading if bos is not None and t == bos]


def conversation_tokens(served: ServedModel, request: TokenizeRequest, rid: str) -> list[int]:
    """The prompt generation would give the model for the conversation (a prompt over
    the context length is still tokenized: clients tokenize to learn how much to trim)."""
    assert request.chat is not None
    request.chat.model = served.name
    ctx = RequestContext(request=request.chat, request_id=rid, model_name=served.name, dry_run=True)
    try:
        served.chain.prepare(ctx)
    except ApiError as error:
        if context_overflow(error) is None:
            raise
    tokens = list(ctx.prompt_token_ids or [])
    if ctx.assistant_prefill:  # a forced tool call is prefilled (stages/generate.py)
        tokens += hf_tokenizer(served).encode(ctx.assistant_prefill, add_special_tokens=False)
    return tokens


def token_pieces(tokenizer: Any, tokens: list[int]) -> list[str | list[int]]:
    """Each token's bytes: its text where they are UTF-8, else the byte values (a
    character split over several byte-level tokens), as llama.cpp's with_pieces."""
    detokenizer = tokenizer.detokenizer
    out: list[str | list[int]] = []
    for token in tokens:
        raw = token_bytes(detokenizer, tokenizer, token)
        try:
            out.append(raw.decode("utf-8"))
        except UnicodeDecodeError:
            out.append(list(raw))
    return out


def token_bytes(detokenizer: Any, tokenizer: Any, token: int) -> bytes:
    """The bytes one token stands for, from mlx-lm's token map where it has one."""
    if isinstance(detokenizer, BPEStreamingDetokenizer):
        from mlx_lm.tokenizer_utils import _byte_decoder

        decoder = _byte_decoder()
        piece: str = detokenizer.tokenmap[token]
        return b"".join(bytes([decoder[c]]) if c in decoder else c.encode() for c in piece)
    if isinstance(detokenizer, SPMStreamingDetokenizer):
        return bytes(detokenizer.tokenmap[token]).replace(SPMStreamingDetokenizer._sep, b" ")
    return str(hf_decode(tokenizer, token)).encode()


def hf_decode(tokenizer: Any, token: int) -> str:
    return str(getattr(tokenizer, "_tokenizer", tokenizer).decode([token]))


def add_tokenizer_routes(
    app: falcon.App[falcon.Request, falcon.Response],
    route: str,
    protocol: WireProtocol,
    models: ModelTable,
    allowed: set[str] | None,
    options: HttpOptions,
) -> None:
    """One resource per tokenizer path the protocol declares."""
    kinds: dict[str, type[TokenizerResource]] = {
        "tokenize": TokenizeResource,
        "detokenize": DetokenizeResource,
    }
    for path, kind in protocol.token_paths.items():
        app.add_route(route + path, kinds[kind](route + path, protocol, models, allowed, options))
