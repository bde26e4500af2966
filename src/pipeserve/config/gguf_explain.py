"""`validate --explain` for a `.gguf` source: what the file holds, read from its header
without converting it (engine/weights/gguf/inspect.py). What `pipeline: auto` detects
from a GGUF is config/detect.py's `read_gguf_evidence`, as at serve time."""

from __future__ import annotations

from pathlib import Path

from pipeserve.config.models import ModelEntry
from pipeserve.engine.weights.gguf.inspect import GgufSummary, inspect_gguf


def gguf_summary(entry: ModelEntry) -> GgufSummary | None:
    """The header summary of the entry's `.gguf` source; None for other sources."""
    from pipeserve.engine.weights.gguf.files import is_gguf_source

    if not is_gguf_source(entry.source) or entry.source.startswith("pypi:"):
        return None
    return inspect_gguf(Path(entry.source).expanduser())


def gguf_lines(entry: ModelEntry, summary: GgufSummary) -> list[str]:
    lines = [f"    {line}" for line in summary.lines()]
    kv = entry.options.kv_cache
    if kv is not None:
        lines.append(f"    KV cache quantized ({kv.bits} bits, group {kv.group_size}): "
                     f"{kv.bytes_per_token(summary.kv_bytes_per_token) * 1024 / 2**20:.1f}"
                     " MiB per 1024 tokens")  # fmt: skip
    if not summary.chat_template and not summary.encoder:
        if entry.chat_template is not None:
            lines.append(f"    chat template from the config: {entry.chat_template}")
        else:
            lines.append(
                "    WARNING: no chat template: chat requests will answer 400; set "
                "`chat_template:` on this model (a .jinja file or a built-in name)"
            )
    return lines
