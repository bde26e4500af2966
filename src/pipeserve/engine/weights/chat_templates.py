"""A model entry's `chat_template:` option: a chat template for a model whose tokenizer
has none (a base model's GGUF) or replaces the one it has.

    chat_template: gemma              # a built-in: engine/weights/demo/templates/<name>.jinja
    chat_template: ./my-model.jinja   # a file (relative to the working directory, as sources)

A value that ends in `.jinja` or holds a `/` is a file; anything else names a built-in.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path


class ChatTemplateError(ValueError):
    """The option names no built-in and no readable file (message: one line)."""


def builtin_templates() -> list[str]:
    folder = resources.files("pipeserve.engine.weights.demo").joinpath("templates")
    return sorted(
        p.name.removesuffix(".jinja") for p in folder.iterdir() if p.name.endswith(".jinja")
    )


def is_file_value(value: str) -> bool:
    return value.endswith(".jinja") or "/" in value


def chat_template_text(value: str) -> str:
    """The template the option names; ChatTemplateError when there is none."""
    if is_file_value(value):
        path = Path(value).expanduser()
        try:
            return path.read_text(encoding="utf-8")
        except OSError as exc:
            raise ChatTemplateError(
                f"chat template file {value} cannot be read ({exc.strerror})"
            ) from None
    if value not in builtin_templates():
        known = ", ".join(builtin_templates())
        raise ChatTemplateError(f"no built-in chat template {value!r} (built-in: {known})")
    folder = resources.files("pipeserve.engine.weights.demo").joinpath("templates")
    return folder.joinpath(f"{value}.jinja").read_text("utf-8")


def no_template_message(model: str) -> str:
    """What a chat request to a model without a chat template is told (HTTP 400)."""
    return (
        f"Model {model!r} has no chat template (a base model): send a plain prompt to "
        "/v1/completions or Ollama's /api/generate with raw: true, or give the model a "
        "template with `chat_template:` in its config entry (a .jinja file or a built-in: "
        f"{', '.join(builtin_templates())})."
    )


def set_chat_template(tokenizer: object, value: str) -> None:
    """Give the (mlx-lm wrapped) Hugging Face tokenizer the template the option names."""
    hf = getattr(tokenizer, "_tokenizer", tokenizer)
    hf.chat_template = chat_template_text(value)  # type: ignore[attr-defined]
