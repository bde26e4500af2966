"""From a configured model entry to a running ModelRuntime (tokenizer + engine): the one
factory that chooses the engine (replay, MLX, sharded over processes, sharded over
`pipeserve node` machines).

runtime = build_runtime(entry)      # loads the tokenizer (and the model for mlx)
stream = runtime.engine.submit(job) # from any request greenlet / thread
runtime.engine.close()              # at worker shutdown
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

from pipeserve.config.models import EngineOptions, ModelEntry
from pipeserve.engine.base import Engine, ModelRuntime
from pipeserve.engine.sampling.grammar import GrammarCompiler
from pipeserve.engine.weights.loader import (
    context_length,
    eos_token_ids,
    load_tokenizer,
    read_config,
    resolve_source,
    sampling_defaults,
    take_preloaded_tokenizer,
)
from pipeserve.errors import LoadRefused
from pipeserve.gevent_support import OsThreadHost

log = logging.getLogger("pipeserve.engine")


def draft_entry(models: Iterable[ModelEntry], entry: ModelEntry) -> ModelEntry | None:
    """The model that `entry`'s speculative method draft names (validated to exist)."""
    spec = entry.options.speculative
    if spec is None or spec.method != "draft":
        return None
    return next((m for m in models if m.name == spec.draft), None)


def build_runtime(
    entry: ModelEntry,
    manage: Callable[[Callable[[], Engine], Path], Engine] | None = None,
    tokenizers: dict[Path, Any] | None = None,
    draft: ModelEntry | None = None,
) -> ModelRuntime:
    """Resolve the source, load the tokenizer (and the weights for engine mlx), start the engine.

    manage(start, model_dir), when given, decides when the engine starts (load on demand:
    pipeserve.server.fleet); it returns the engine the runtime uses. tokenizers, when
    given, is a cache by model folder (engines copy their detokenizers, so models of one
    folder can share the tokenizer). draft: the model its speculative method draft
    names (draft_entry), loaded with it.
    """
    model_dir = resolve_source(entry.source, entry.sha256)
    tokenizer = _tokenizer(entry, model_dir, tokenizers)
    eos = eos_token_ids(tokenizer, model_dir)
    options = entry.options
    start = partial(start_engine, entry, model_dir, tokenizer, eos, draft=draft)
    engine = manage(start, model_dir) if manage is not None else start()
    return ModelRuntime(
        name=entry.name,
        family=entry.pipeline,
        model_dir=model_dir,
        tokenizer=tokenizer,
        engine=engine,
        eos_token_ids=eos,
        context_length=options.context_length or context_length(model_dir),
        default_max_tokens=options.default_max_tokens,
        grammar=GrammarCompiler(tokenizer, read_config(model_dir).get("vocab_size"), eos),
        sampling_defaults=sampling_defaults(
            model_dir, entry.sampling.model_dump(exclude_none=True)
        ),
        reasoning=entry.reasoning,
    )


def _tokenizer(entry: ModelEntry, model_dir: Path, tokenizers: dict[Path, Any] | None) -> Any:
    """The folder's tokenizer (shared through `tokenizers`), or one of the entry's own
    when it sets `chat_template:` (engine/weights/chat_templates.py)."""
    if entry.chat_template is not None:
        from pipeserve.engine.weights.chat_templates import set_chat_template

        tokenizer = load_tokenizer(model_dir)
        set_chat_template(tokenizer, entry.chat_template)
        return tokenizer
    tokenizer = tokenizers.get(model_dir) if tokenizers is not None else None
    if tokenizer is None:
        tokenizer = take_preloaded_tokenizer(model_dir)
    if tokenizer is None:
        tokenizer = load_tokenizer(model_dir)
        if tokenizers is not None:
            tokenizers[model_dir] = tokenizer
    return tokenizer


def start_engine(
    entry: ModelEntry,
    model_dir: Path,
    tokenizer: Any,
    eos: frozenset[int],
    host: OsThreadHost | None = None,
    draft: ModelEntry | None = None,
) -> Engine:
    """The entry's engine over its tokenizer; engine mlx loads the weights (blocking), on
    `host`'s thread when given (pipeserve.server.fleet reuses one per on_demand model),
    and its draft model's (speculative method draft) on the same thread."""
    options = entry.options
    if entry.engine == "replay":
        from pipeserve.engine.replay import ReplayEngine

        engine: Engine = ReplayEngine(
            entry.name, tokenizer, eos, entry.replay.completion, entry.replay.delay,
            capacity=options.max_batch + options.queue_size,
        )  # fmt: skip
        engine.max_tokens_limit = options.max_tokens_limit
    else:
        load_draft = draft_loader(entry, tokenizer, draft)
        engine = build_mlx_engine(
            entry.name,
            model_dir,
            tokenizer,
            options,
            host=host,
            load_draft=load_draft,
            adapters=[
                (a.name, Path(a.path).expanduser(), a.load == "on_demand") for a in entry.adapters
            ],
        )
    log.info(
        "model %s: %s engine on %s (%d EOS ids)", entry.name, entry.engine, model_dir, len(eos)
    )
    return engine


def draft_loader(
    entry: ModelEntry, tokenizer: Any, draft: ModelEntry | None
) -> Callable[[], Any] | None:
    """The loader of `entry`'s draft model's weights (None without method draft), after
    checking that the draft shares the tokenizer (LoadRefused: the model is unavailable
    with the reason). The draft loads inside this model's engine, a copy of its own
    beside any engine that serves the draft model itself."""
    spec = entry.options.speculative
    if spec is None or spec.method != "draft":
        return None
    if draft is None:
        raise LoadRefused(f"model {entry.name}: draft model {spec.draft!r} is not configured")
    from pipeserve.engine.speculative.draft import check_draft
    from pipeserve.engine.weights.loader import load_model

    draft_dir = resolve_source(draft.source, draft.sha256)
    check_draft(entry.name, draft.name, tokenizer, load_tokenizer(draft_dir))
    options = draft.options
    return partial(load_model, draft_dir, options.dtype, options.cpu_pretranspose)


def build_mlx_engine(
    name: str,
    model_dir: Path,
    tokenizer: Any,
    options: EngineOptions,
    host: OsThreadHost | None = None,
    load_draft: Callable[[], Any] | None = None,
    adapters: Sequence[tuple[str, Path, bool]] = (),
    **kwargs: Any,
) -> Engine:
    """An engine over the MLX model in `model_dir`: sharded over `pipeserve node`
    machines (sharding.nodes), over processes (sharding), or one engine thread.
    host: the thread to run on (a model loaded on demand reuses one across loads);
    load_draft: method draft's loader of the draft model (run on the engine thread);
    adapters: the LoRA adapters (name, folder, on demand) served with the model
    (engine/mlx/lora.py).
    The engines are imported here only: each brings MLX, which a process that only
    validates or replays never loads."""
    if options.sharding is not None and options.sharding.nodes is not None:
        from pipeserve.cluster.launch import ClusterShardedEngine

        return ClusterShardedEngine(name, model_dir, tokenizer, options, **kwargs)
    if options.sharding is not None:  # loaded once at start-up: no host
        from pipeserve.engine.sharding.engine import ShardedEngine

        return ShardedEngine(name, model_dir, tokenizer, options, **kwargs)
    from pipeserve.engine.mlx.engine import MlxEngine
    from pipeserve.engine.mlx.lora import AdapterSource
    from pipeserve.engine.weights.loader import load_model

    sources = [AdapterSource(name, path, lazy) for name, path, lazy in adapters]
    return MlxEngine(
        name,
        lambda: load_model(model_dir, options.dtype, options.cpu_pretranspose, sources),
        tokenizer,
        options,
        host=host,
        load_draft=load_draft,
        **kwargs,
    )
