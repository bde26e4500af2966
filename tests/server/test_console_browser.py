"""The web console at `/` in a real headless Chromium against a real server: the shipped
SmolLM2 answers "Paris" streamed over Chat Completions and over Messages, the Models
view draws the shipped pipeline's stages, Stop ends a long generation on the server,
model text with HTML (answer, reasoning, tool call; over Responses) renders as text, and a
server with API keys asks for one. The
screenshots go to PIPESERVE_SCREENSHOTS (docs/images for the README) or a temp folder."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from tests.server.browser import VIEWPORT, browser_or_skip, screenshot_dir
from tests.server.serverproc import REPO, running_server

pytestmark = [pytest.mark.server, pytest.mark.mlx, pytest.mark.browser]

QUESTION = "What is the capital of France?"
HOSTILE = (
    '<think>\nI think <img src="y" onerror="window.__pwned = 4">.\n</think>\n\n'
    "Here is <script>window.__pwned = 1</script> and "
    '<img src="x" onerror="window.__pwned = 2"> in **bold**.\n\n'
    "```html\n<script>window.__pwned = 3</script>\n```\n"
    '<tool_call>\n{"name": "lookup", "arguments": {"q": "<b onmouseover=alert(5)>"}}\n</tool_call>'
)
TOOLS = '[{"name": "lookup", "description": "Look up", "parameters": {"type": "object"}}]'
SLOW = {"completion": "word " * 3000, "delay": 0.05}  # ~150 s unless stopped


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    yield from browser_or_skip()


@pytest.fixture(scope="module")
def server(
    browser: Any,
    smollm2: tuple[Path, Path],
    minilm_dir: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[str]:
    """configs/default.yaml as shipped, plus a slow and a hostile replay model and an
    embedding model."""
    config = yaml.safe_load((REPO / "configs" / "default.yaml").read_text())
    replay = {"source": "demo:qwen3", "pipeline": "qwen3", "engine": "replay"}
    config["models"] += [
        {**replay, "name": "slow", "replay": SLOW},
        {**replay, "name": "hostile", "replay": {"completion": HOSTILE}},
        {"name": "minilm", "kind": "embedding", "source": str(minilm_dir)},
    ]
    config["endpoints"].append({"route": "/v1/embeddings", "api": "openai-embeddings"})
    config["pipelines_dir"] = str(REPO / "pipelines")
    path = tmp_path_factory.mktemp("console") / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    with running_server(path) as base:
        yield base


@pytest.fixture(scope="module")
def shots(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return screenshot_dir(tmp_path_factory.mktemp("screenshots"))


@pytest.fixture
def page(browser: Any, server: str) -> Iterator[Any]:
    context = browser.new_context(viewport=VIEWPORT)
    page = context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda error: errors.append(str(error)))
    page.goto(server + "/")
    yield page
    context.close()
    assert errors == []


def choose(page: Any, model: str, protocol: str | None = None) -> None:
    page.wait_for_selector(f'#chat-model option[value="{model}"]', state="attached")
    page.select_option("#chat-model", model)
    if protocol:
        page.select_option("#chat-protocol", protocol)


def ask(page: Any, text: str, route: str) -> Any:
    """Send `text`; the request's response (streamed) once it has started."""
    page.fill("#chat-input", text)
    with page.expect_response(lambda r: r.url.endswith(route)) as answer:
        page.click("#chat-send")
    return answer.value


def last_answer(page: Any) -> Any:
    return page.locator(".msg.assistant").last


def test_chat_streams_paris_over_chat_completions(page: Any, shots: Path) -> None:
    from playwright.sync_api import expect

    choose(page, "smollm2", "openai-chat")
    response = ask(page, QUESTION, "/v1/chat/completions")
    assert response.request.post_data_json["stream"] is True
    assert response.headers["content-type"].startswith("text/event-stream")
    expect(last_answer(page).locator(".answer")).to_contain_text("Paris", timeout=60_000)
    expect(last_answer(page).locator(".stats")).to_contain_text("tok/s", timeout=60_000)
    page.screenshot(path=str(shots / "console-chat.png"))


def test_chat_streams_paris_over_messages(page: Any) -> None:
    from playwright.sync_api import expect

    choose(page, "smollm2", "anthropic-messages")
    response = ask(page, QUESTION, "/v1/messages")
    assert response.request.post_data_json["stream"] is True
    assert response.request.headers["anthropic-version"]
    expect(last_answer(page).locator(".answer")).to_contain_text("Paris", timeout=60_000)
    expect(last_answer(page).locator(".who")).to_contain_text("Messages")


def test_models_view_draws_the_shipped_pipeline(page: Any, shots: Path) -> None:
    from playwright.sync_api import expect

    page.goto(page.url.split("#")[0] + "#models")
    card = page.locator('.model[data-model="smollm2"]')
    expect(card).to_contain_text("loaded", timeout=30_000)
    shipped = yaml.safe_load((REPO / "pipelines" / "chatml.yaml").read_text())
    kinds = [next(iter(stage)) for stage in shipped["stages"]]
    assert card.locator(".stage .kind").all_inner_texts() == kinds
    expect(card).to_contain_text("/v1/chat/completions")
    expect(card).to_contain_text("demo")  # its alias
    page.screenshot(path=str(shots / "console-models.png"))


def test_models_view_shows_an_embedding_model_and_chat_leaves_it_out(page: Any) -> None:
    from playwright.sync_api import expect

    page.wait_for_selector('#chat-model option[value="smollm2"]', state="attached")
    options = page.locator("#chat-model option").evaluate_all("os => os.map(o => o.value)")
    assert "minilm" not in options
    page.goto(page.url.split("#")[0] + "#models")
    card = page.locator('.model[data-model="minilm"]')
    expect(card).to_contain_text("384", timeout=30_000)
    expect(card).to_contain_text("mean, normalised")
    assert card.locator(".stage .kind").all_inner_texts() == [
        "tokenize",
        "encode",
        "pool (mean)",
        "normalise",
    ]
    expect(card).to_contain_text("/v1/embeddings")


def active(base: str, model: str) -> float:
    text = httpx.get(f"{base}/metrics", timeout=30).text
    found = re.search(rf'^pipeserve_active_sequences\{{model="{model}"\}} (\S+)$', text, re.M)
    return float(found.group(1)) if found else 0.0


def wait_for(check: Any, what: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"gave up waiting for {what}"
        time.sleep(0.1)


def test_stop_button_cancels_the_generation_on_the_server(page: Any, server: str) -> None:
    from playwright.sync_api import expect

    choose(page, "slow", "openai-chat")
    ask(page, "Talk for a long time.", "/v1/chat/completions")
    expect(last_answer(page).locator(".answer")).to_contain_text("word", timeout=30_000)
    assert active(server, "slow") == 1
    page.click("#chat-stop")
    wait_for(lambda: active(server, "slow") == 0, "the server to cancel the stream")
    expect(last_answer(page).locator(".stats")).to_contain_text("stopped")
    assert page.locator("#chat-send").is_enabled()


def test_model_text_with_html_renders_as_text(page: Any) -> None:
    """Over Responses, with reasoning and a tool call: every part shows as text."""
    from playwright.sync_api import expect

    choose(page, "hostile", "openai-responses")
    page.fill("#chat-tools", TOOLS)
    ask(page, "Say something nasty.", "/v1/responses")
    message = last_answer(page)
    answer = message.locator(".answer")
    expect(message.locator(".stats")).to_be_visible()
    expect(answer.locator("pre code")).to_contain_text("<script>window.__pwned = 3</script>")
    expect(answer).to_contain_text('<img src="x" onerror="window.__pwned = 2">')
    expect(answer).to_contain_text("<script>window.__pwned = 1</script>")
    assert answer.locator("strong").inner_text() == "bold"  # Markdown still renders
    reasoning = message.locator("details.reasoning")
    reasoning.locator("summary").click()
    expect(reasoning).to_contain_text('<img src="y" onerror="window.__pwned = 4">')
    expect(message.locator(".tool")).to_contain_text('{"q": "<b onmouseover=alert(5)>"}')
    assert message.locator("script, img, b").count() == 0
    assert page.evaluate("window.__pwned") is None


def test_live_view_charts_the_traffic(page: Any, shots: Path) -> None:
    from playwright.sync_api import expect

    page.goto(page.url.split("#")[0] + "#live")
    expect(page.locator("#live-charts svg")).to_have_count(3, timeout=30_000)
    requests = page.locator("#live-requests b")
    expect(requests).not_to_have_text("0")  # the chats above
    assert page.locator("#live-charts path").count() >= 1
    page.screenshot(path=str(shots / "console-live.png"))


@pytest.fixture(scope="module")
def keyed_server(browser: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    config = {
        "server": {"api_keys": ["sk-console-admin", {"key": "sk-console-team", "models": ["r"]}]},
        "pipelines_dir": str(REPO / "pipelines"),
        "models": [{"name": "r", "source": "demo:qwen3", "pipeline": "qwen3", "engine": "replay"}],
        "endpoints": [{"route": "/v1/chat/completions", "api": "openai-chat"}],
    }
    path = tmp_path_factory.mktemp("console-keys") / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    with running_server(path) as base:
        yield base


def test_console_with_keys_asks_for_one_and_refuses_without(
    browser: Any, keyed_server: str
) -> None:
    from playwright.sync_api import expect

    context = browser.new_context(viewport=VIEWPORT)
    page = context.new_page()
    page.goto(keyed_server + "/")
    expect(page.locator("#login")).to_be_visible()
    assert "sk-console" not in page.content()
    assert page.locator("#chat-model option").count() == 0
    page.fill("#login-key", "sk-wrong")
    page.click("#login-form button")
    expect(page.locator("#login-error")).to_contain_text("401")
    with page.expect_request(lambda r: r.url.endswith("/console/api/models")) as sent:
        page.fill("#login-key", "sk-console-admin")
        page.click("#login-form button")
    assert sent.value.headers["authorization"] == "Bearer sk-console-admin"
    page.wait_for_selector('#chat-model option[value="r"]', state="attached")
    context.close()
    # The console's endpoints obey the keys as the APIs do: none, a wrong one, a limited one.
    url = f"{keyed_server}/console/api"
    assert httpx.get(f"{url}/models").status_code == 401
    team = {"Authorization": "Bearer sk-console-team"}
    assert [m["name"] for m in httpx.get(f"{url}/models", headers=team).json()["models"]] == ["r"]
    assert httpx.get(f"{url}/live", headers=team).status_code == 403
    config = httpx.get(f"{url}/config", headers={"x-api-key": "sk-console-admin"}).json()
    assert "sk-console" not in config["text"] and "<redacted>" in config["text"]
