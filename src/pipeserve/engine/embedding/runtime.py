"""A model entry of kind embedding or rerank -> its ModelRuntime (tokenizer + engine).

The engine starts like a generation engine's (directly, or when the fleet loads it on
demand); the runtime's tokenizer is an InputTokenizer (inputs.py), which the embeddings
and rerank routes use to turn a request's inputs into token sequences."""

from __future__ import annotations

import logging
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

from pipeserve.config.models import ModelEntry
from pipeserve.engine.base import Engine, ModelRuntime
from pipeserve.engine.embedding.backbone import Backbone, is_encoder, load_backbone
from pipeserve.engine.embedding.bert import BertConfig
from pipeserve.engine.embedding.decoder import single_token
from pipeserve.engine.embedding.engine import EmbeddingEngine
from pipeserve.engine.embedding.inputs import InputTokenizer
from pipeserve.engine.embedding.spec import EmbeddingSpec, build_spec, read_json
from pipeserve.engine.embedding.yielding import Yielding
from pipeserve.gevent_support import OsThreadHost

log = logging.getLogger("pipeserve.engine")


def model_facts(model_dir: Path) -> tuple[int, int]:
    """(hidden size, vocabulary size) from config.json (text_config for VLM folders)."""
    config = read_json(model_dir / "config.json")
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    assert isinstance(text, dict)
    if is_encoder(model_dir):
        bert = BertConfig.read(model_dir)
        return bert.hidden_size, bert.vocab_size
    return int(text["hidden_size"]), int(text["vocab_size"])


def build_embedding_runtime(
    entry: ModelEntry,
    model_dir: Path,
    manage: Callable[[Callable[[], Engine], Path], Engine] | None = None,
    chat_running: Callable[[], bool] | None = None,
) -> ModelRuntime:
    """chat_running: whether a generation model of the server decodes now (the engine
    then gives way to it, EmbeddingOptions.chat_share)."""
    width, vocab = model_facts(model_dir)
    spec = build_spec(model_dir, entry.embedding, not is_encoder(model_dir), width)
    tokenizer = InputTokenizer(model_dir, spec.max_length, vocab)
    yes_no = yes_no_ids(entry, tokenizer) if entry.kind == "rerank" else (None, None)
    yielding = Yielding(chat_running or (lambda: False), entry.embedding.chat_share)
    start = partial(start_embedding_engine, entry, model_dir, spec, yes_no, yielding)
    engine = manage(start, model_dir) if manage is not None else start()
    return ModelRuntime(
        name=entry.name,
        family=entry.kind,
        model_dir=model_dir,
        tokenizer=tokenizer,
        engine=engine,
        eos_token_ids=frozenset(),
        context_length=spec.max_length,
        embedding=spec,
    )


def yes_no_ids(entry: ModelEntry, tokenizer: InputTokenizer) -> tuple[int | None, int | None]:
    """A decoder reranker's yes / no token ids (each must be one token)."""
    options = entry.embedding
    yes, no = (
        single_token(tokenizer.plain, options.yes_token),
        single_token(tokenizer.plain, options.no_token),
    )
    return yes, no


def start_embedding_engine(
    entry: ModelEntry,
    model_dir: Path,
    spec: EmbeddingSpec,
    yes_no: tuple[int | None, int | None],
    yielding: Yielding,
    host: OsThreadHost | None = None,
) -> Engine:
    options = entry.options

    def load() -> Backbone:
        from pipeserve.engine.weights.loader import load_model

        decoder = partial(load_model, model_dir, options.dtype, options.cpu_pretranspose)
        backbone = load_backbone(model_dir, decoder, yes_no)
        if entry.kind == "rerank" and not backbone.classifies:
            raise ValueError(
                f"model {entry.name} (kind rerank) has no classifier head, and its tokenizer"
                f" has no single tokens {entry.embedding.yes_token!r} / {entry.embedding.no_token!r}"
            )
        return backbone

    batch_tokens = entry.embedding.batch_tokens
    engine = EmbeddingEngine(entry.name, load, spec, options, batch_tokens, host, yielding)
    log.info("model %s: %s engine on %s (%s)", entry.name, entry.kind, model_dir, spec.describe())
    return engine


def describe_spec(spec: EmbeddingSpec | None) -> dict[str, Any]:
    return spec.describe() if spec is not None else {}
