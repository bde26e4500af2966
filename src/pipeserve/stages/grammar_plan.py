"""From a request's output format and the family's markers to one llguidance grammar.

The grammar is llguidance's JSON form: a Lark "envelope" (how this family frames
reasoning and the answer, built from marker text declared in the pipeline) that
refers to the answer as the sub-grammar `@answer` (the client's JSON schema, regex or
Lark grammar). Markers become Lark pieces by tokenizing them: a special token is
referred to by id (`<[151668]>`), other text is a string literal, so the same code
serves every tokenizer and every family.

With reasoning, the envelope lets the model reason freely first: any text up to the
reasoning close marker (special tokens cannot occur inside free text), and only then
the answer is constrained (qwen3 / glm / kimi: after `</think>`; Harmony: reasoning on
the analysis channel, the answer in the final channel).
"""

from __future__ import annotations

import json
from typing import Any

from pipeserve.constraint import Envelope, Tokens
from pipeserve.request import OutputFormat

# Compact, conventional JSON (`{"a": 1, "b": [2, 3]}`): no free whitespace, which a
# sampling model could otherwise repeat until max_tokens.
JSON_STYLE: dict[str, Any] = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
}
ANY_TEXT = "/(?s:.*)/"
_REGEX_META = set("\\.+*?()|[]{}^$#&-~/")


def lark_string(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def regex_escape(text: str) -> str:
    return "".join("\\" + c if c in _REGEX_META else c for c in text)


def marker_pieces(tokens: Tokens, text: str) -> list[tuple[bool, str]]:
    """(is_special, lark piece) runs of a marker: `<[id]>` for special tokens, else text."""
    pieces: list[tuple[bool, str]] = []
    run: list[int] = []
    for token in tokens.encode(text):
        if tokens.is_special(token):
            if run:
                pieces.append((False, tokens.decode_bytes(run).decode("utf-8", "replace")))
                run = []
            pieces.append((True, f"<[{token}]>"))
        else:
            run.append(token)
    if run:
        pieces.append((False, tokens.decode_bytes(run).decode("utf-8", "replace")))
    return pieces


def marker_lark(tokens: Tokens, text: str) -> str:
    """A marker as a Lark sequence (empty string for no marker)."""
    return " ".join(p if special else lark_string(p) for special, p in marker_pieces(tokens, text))


def free_text_until(tokens: Tokens, close: str, rule: str) -> list[str]:
    """Lark rules: `rule` matches any text followed by the `close` marker.

    Free text never contains a special token, so a special close marker ends it; a
    plain-text close marker ends a lazy lexeme (the shortest text ending in it).
    """
    pieces = marker_pieces(tokens, close)
    if not pieces:
        return [f"{rule}: {ANY_TEXT}"]
    first_special, first = pieces[0]
    rest = " ".join(p if s else lark_string(p) for s, p in pieces[1:])
    if first_special:
        return [f"{rule}: {ANY_TEXT} {first} {rest}".rstrip()]
    lazy = f"/(?s:.*){regex_escape(first)}/"
    return [f"{rule}_text[lazy]: {lazy}", f"{rule}: {rule}_text {rest}".rstrip()]


def envelope_lark(
    tokens: Tokens,
    envelope: Envelope | None,
    opened: bool,
    answer: str | None = None,
    rules: tuple[str, ...] = (),
) -> str:
    """The top-level Lark grammar: optional reasoning, then the answer.

    `opened`: the prompt already opened the reasoning block (generation starts in it).
    `answer`: the answer's Lark (default: `@answer` in the envelope's answer frame);
    `rules`: the rules it refers to.
    """
    body: list[str] = []
    reasoning: list[str] = []
    if envelope is not None and envelope.reasoning_close:
        reasoning += free_text_until(tokens, envelope.reasoning_close, "reason_body")
        open_ = marker_lark(tokens, envelope.reasoning_open)
        reasoning.append(f"reason: {open_} reason_body".replace(":  ", ": "))
        if opened:
            first = "reason_body"
            body.append(f"{first} reason*" if envelope.repeat else first)
        else:
            body.append("reason*" if envelope.repeat else "reason?")
    body.append(answer if answer is not None else framed_answer(tokens, envelope, "@answer"))
    return "\n".join([f"start: {' '.join(body)}", *reasoning, *rules]) + "\n"


def framed_answer(tokens: Tokens, envelope: Envelope | None, inner: str) -> str:
    """`inner` between the envelope's answer markers (Harmony's final channel)."""
    if envelope is None:
        return inner
    pieces = [marker_lark(tokens, envelope.answer_open), inner]
    pieces.append(marker_lark(tokens, envelope.answer_close))
    return " ".join(piece for piece in pieces if piece)


def answer_grammar(fmt: OutputFormat) -> dict[str, Any]:
    """The answer sub-grammar (named `answer`) for a client's output format."""
    if fmt.kind in ("json_schema", "json_object"):
        schema = fmt.definition if fmt.kind == "json_schema" else {"type": "object"}
        return {"name": "answer", "json_schema": styled_schema(schema)}
    if fmt.kind == "regex":
        import llguidance

        pattern = llguidance.regex_to_lark(str(fmt.definition), "dw")
        return {"name": "answer", "lark_grammar": f"start: ANSWER\nANSWER: /{pattern}/\n"}
    return {"name": "answer", "lark_grammar": str(fmt.definition)}


def styled_schema(schema: Any) -> Any:
    """The schema with our JSON layout (a schema's own x-guidance options win)."""
    if not isinstance(schema, dict):
        return schema
    style = dict(JSON_STYLE)
    own = schema.get("x-guidance")
    if isinstance(own, dict):
        style.update(own)
    return {**schema, "x-guidance": style}


def response_grammar(
    tokens: Tokens, fmt: OutputFormat, envelope: Envelope | None, opened: bool
) -> str:
    """The whole grammar (llguidance JSON) for a structured answer."""
    top = {"lark_grammar": envelope_lark(tokens, envelope, opened)}
    return json.dumps({"grammars": [top, answer_grammar(fmt)]}, ensure_ascii=False)
