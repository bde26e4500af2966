"""LoRA adapters through a real server: the openai SDK names `<model>:<adapter>` (or the
adapter's own name) and gets mlx-lm's own greedy text with that adapter; an unknown
adapter is a 404 naming `model` on every protocol, in its own error shape; /v1/models
lists the adapters; a key scoped to an adapter reaches it alone; an adapter whose files
are bad is refused with its reason while the base serves."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from anthropic import Anthropic
from anthropic import NotFoundError as AnthropicNotFound
from openai import APIStatusError, NotFoundError, OpenAI

from tests.engine.helpers import reference_ids
from tests.lora import broken_copy
from tests.server.serverproc import REPO, running_server

pytestmark = [pytest.mark.server, pytest.mark.mlx]

PROMPT = "Arr matey, the treasure"
MAX_TOKENS = 10


def drop_b(config: dict[str, Any], weights: dict[str, Any]) -> None:
    del weights[next(k for k in weights if k.endswith("lora_b"))]


@pytest.fixture(scope="module")
def server(
    lora_adapters: dict[str, Path],
    demo_model_dir: Callable[[str], Path],
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[str]:
    folder = tmp_path_factory.mktemp("lora-server")
    bad = broken_copy(lora_adapters["pirate"], folder / "bad", drop_b)
    adapters = [{"name": n, "path": str(p)} for n, p in lora_adapters.items()]
    config = {
        "pipelines_dir": str(REPO / "pipelines"),
        "server": {"api_keys": [{"key": "all"}, {"key": "chef-only", "models": ["chef"]}]},
        "models": [
            {
                "name": "m",
                "source": str(demo_model_dir("qwen3")),
                "pipeline": "qwen3",
                "options": {"max_batch": 4},
                "adapters": [*adapters, {"name": "bad", "path": str(bad)}],
            },
        ],  # fmt: skip
        "endpoints": [
            {"route": "/v1/chat/completions", "api": "openai-chat"},
            {"route": "/v1/completions", "api": "openai-completions"},
            {"route": "/v1/responses", "api": "openai-responses"},
            {"route": "/v1/messages", "api": "anthropic-messages"},
            {"route": "/api", "api": "ollama"},
        ],
    }
    path = folder / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    with running_server(path) as base:
        yield base


def client(server: str, key: str = "all") -> OpenAI:
    return OpenAI(base_url=f"{server}/v1", api_key=key, max_retries=0)


def expected_text(folder: Path, adapter: Path | None) -> str:
    import mlx_lm

    model, tokenizer = mlx_lm.load(
        str(folder), adapter_path=None if adapter is None else str(adapter)
    )
    ids = tokenizer.encode(PROMPT, add_special_tokens=False)
    # mlx-lm's greedy tokens, decoded whole (its streaming text drops a leading space)
    return str(tokenizer.decode(reference_ids(model, tokenizer, ids, MAX_TOKENS)))


def complete(server: str, model: str, key: str = "all") -> str:
    reply = client(server, key).completions.create(
        model=model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0,
        extra_body={"repetition_penalty": 1.0},
    )  # fmt: skip
    return reply.choices[0].text


def test_openai_sdk_names_base_colon_adapter(server, lora_adapters, demo_model_dir) -> None:
    folder = demo_model_dir("qwen3")
    pirate = complete(server, "m:pirate")
    assert pirate == expected_text(folder, lora_adapters["pirate"])
    assert complete(server, "chef") == expected_text(folder, lora_adapters["chef"])
    assert complete(server, "m") == expected_text(folder, None) != pirate
    chat = client(server).chat.completions.create(
        model="m:chef", messages=[{"role": "user", "content": "hi"}], max_tokens=4, temperature=0
    )
    assert chat.model == "m:chef" and chat.usage is not None and chat.usage.completion_tokens > 0


def test_unknown_adapter_is_a_404_naming_model_on_every_protocol(server: str) -> None:
    with pytest.raises(NotFoundError) as chat:
        client(server).chat.completions.create(
            model="m:nope", messages=[{"role": "user", "content": "hi"}], max_tokens=4
        )
    assert chat.value.body["param"] == "model"  # type: ignore[index]
    assert "model 'm' has no adapter 'nope'; its adapters: pirate, chef, bad" in chat.value.message
    with pytest.raises(NotFoundError):
        client(server).completions.create(model="m:nope", prompt="x", max_tokens=4)
    with pytest.raises(NotFoundError):
        client(server).responses.create(model="m:nope", input="x", max_output_tokens=4)
    claude = Anthropic(base_url=server, api_key="all", max_retries=0)
    with pytest.raises(AnthropicNotFound) as messages:
        claude.messages.create(
            model="m:nope", max_tokens=4, messages=[{"role": "user", "content": "x"}]
        )
    assert "no adapter 'nope'" in messages.value.message
    ollama = httpx.post(
        f"{server}/api/generate", json={"model": "m:nope", "prompt": "x", "stream": False},
        headers={"Authorization": "Bearer all"},
    )  # fmt: skip
    assert ollama.status_code == 404 and "no adapter 'nope'" in ollama.json()["error"]


def test_models_list_adapters_and_scopes_apply(server: str) -> None:
    ids = [m.id for m in client(server).models.list()]
    assert ids == ["m", "m:pirate", "m:chef", "m:bad"]
    card = httpx.get(f"{server}/v1/models/m:chef", headers={"Authorization": "Bearer all"}).json()
    assert card["parent"] == "m" and card["adapter"] == "chef"
    assert [m.id for m in client(server, "chef-only").models.list()] == ["m:chef"]
    tags = httpx.get(f"{server}/api/tags", headers={"Authorization": "Bearer chef-only"}).json()
    assert [t["name"] for t in tags["models"]] == ["m:chef"]  # Ollama's list too
    assert complete(server, "m:chef", "chef-only")
    for other in ("m", "m:pirate"):
        with pytest.raises(NotFoundError):
            complete(server, other, "chef-only")


def test_bad_adapter_is_refused_and_the_base_serves(server: str) -> None:
    with pytest.raises(APIStatusError) as raised:
        complete(server, "m:bad")
    assert raised.value.status_code == 503
    assert "adapter 'bad' is not loaded: adapter 'bad': missing key" in raised.value.message
    assert complete(server, "m")
    assert complete(server, "pirate")
    cards = {m.id: m for m in client(server).models.list()}
    assert "missing key" in str(getattr(cards["m:bad"], "load_error", ""))
    assert not hasattr(cards["m:chef"], "load_error")
    console = httpx.get(f"{server}/console/api/models", headers={"Authorization": "Bearer all"})
    (model,) = console.json()["models"]
    shown = {a["name"]: a for a in model["adapters"]}
    assert shown["chef"]["request_name"] == "m:chef" and shown["chef"]["error"] is None
    assert "missing key" in shown["bad"]["error"]


def test_two_workers_carry_the_adapter_to_the_engine_host(
    lora_adapters: dict[str, Path],
    demo_model_dir: Callable[[str], Path],
    tmp_path: Path,
) -> None:
    """With `server.workers: 2` the engine runs in the host process: the job crosses the
    engine host's wire, adapter and all (a dropped field would answer with the base)."""
    folder = demo_model_dir("qwen3")
    config = {
        "pipelines_dir": str(REPO / "pipelines"),
        "server": {"workers": 2},
        "models": [
            {
                "name": "m",
                "source": str(folder),
                "pipeline": "qwen3",
                "adapters": [{"name": "pirate", "path": str(lora_adapters["pirate"])}],
            }
        ],
        "endpoints": [{"route": "/v1/completions", "api": "openai-completions"}],
    }
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    with running_server(path) as base:
        assert complete(base, "m:pirate") == expected_text(folder, lora_adapters["pirate"])
        assert complete(base, "m") == expected_text(folder, None)
