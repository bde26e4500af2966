"""The Vercel AI SDK's default multi-turn chat and tool loop over Responses.

With default settings the SDK relies on the store: each later turn sends the earlier
reasoning and assistant messages as `item_reference`s. Two tests:

- the request bytes the SDK sent (recorded once into fixtures/vercel_ai_responses.json by
  vercel_ai/conversation.mjs) are replayed in order, the ids of stored items mapped to
  this run's; this always runs;
- when node (>= 20) and npm are present, the SDK itself (ai 7, @ai-sdk/openai 4,
  installed once into PIPESERVE_HOME/node) runs the same conversation; else skipped.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.server.scenarios import QWEN3
from tests.server.store_servers import Servers

pytestmark = pytest.mark.server

HERE = Path(__file__).resolve().parent
FIXTURE = json.loads((HERE / "fixtures" / "vercel_ai_responses.json").read_text())
SCRIPT = HERE / "vercel_ai" / "conversation.mjs"
PACKAGES = ("ai@7", "@ai-sdk/openai@4")


def final_response(response: httpx.Response) -> dict[str, Any]:
    """The Response object of a JSON answer, or of a stream's response.completed event."""
    if not response.headers["content-type"].startswith("text/event-stream"):
        body: dict[str, Any] = response.json()
        return body
    for line in reversed(response.text.splitlines()):
        if line.startswith("data: ") and '"response.completed"' in line:
            event: dict[str, Any] = json.loads(line[6:])
            return event["response"]
    raise AssertionError(f"no response.completed event in:\n{response.text[-2000:]}")


def serve_recorded_requests(bases: list[str]) -> None:
    """Replay the recorded SDK requests in order, alternating over `bases` (servers
    sharing one store), and check every answer."""
    ids: dict[str, str] = {}  # recorded item id -> the id this run's server gave it
    answers = []
    with httpx.Client(timeout=60) as client:
        for n, exchange in enumerate(FIXTURE["exchanges"]):
            body = exchange["body"]
            for old, new in ids.items():
                body = body.replace(f'"{old}"', f'"{new}"')
            headers = {
                "content-type": "application/json",
                "x-mock-response": json.dumps(exchange["mock"]),
            }
            url = f"{bases[n % len(bases)]}/v1/responses"
            response = client.post(url, content=body, headers=headers)
            assert response.status_code == 200, response.text
            final = final_response(response)
            assert final["status"] == "completed"
            output_ids = [item["id"] for item in final["output"]]
            assert len(output_ids) == len(exchange["output_ids"])
            ids.update(zip(exchange["output_ids"], output_ids, strict=True))
            texts = [
                part["text"]
                for item in final["output"]
                if item["type"] == "message"
                for part in item["content"]
            ]
            answers += texts
    references = [e["body"].count('"item_reference"') for e in FIXTURE["exchanges"]]
    assert references[1] == 2 and references[3] >= 1  # the chat's 2nd turn, the loop's 2nd step
    assert answers == FIXTURE["answers"]


def test_recorded_sdk_requests_are_served(servers: Servers) -> None:
    serve_recorded_requests([servers.base])


def node_sdk() -> Path:
    """A folder holding the SDK packages and the script (installed on first use)."""
    node, npm = shutil.which("node"), shutil.which("npm")
    if node is None or npm is None:
        pytest.skip("node and npm are not installed")
    version = subprocess.run([node, "--version"], capture_output=True, text=True, check=False)
    if int(version.stdout.strip().lstrip("v").split(".")[0] or 0) < 20:
        pytest.skip(f"node {version.stdout.strip()} is older than 20")
    folder = Path(os.environ["PIPESERVE_HOME"]) / "node" / "ai-sdk-7"
    if not (folder / "node_modules" / "@ai-sdk" / "openai").is_dir():
        folder.mkdir(parents=True, exist_ok=True)
        command = [npm, "install", "--no-audit", "--no-fund", "--silent", "--prefix", str(folder)]
        try:
            installed = subprocess.run(
                [*command, *PACKAGES], capture_output=True, text=True, timeout=180, check=False
            )
        except subprocess.TimeoutExpired:
            pytest.skip("npm install of the AI SDK took over 180 s")
        if installed.returncode != 0:
            pytest.skip(f"npm install of the AI SDK failed: {installed.stderr[-500:]}")
    shutil.copy(SCRIPT, folder / SCRIPT.name)
    return folder


def run_the_sdk(bases: list[str]) -> None:
    """The SDK's chat and tool loop, its requests alternating over `bases`."""
    folder = node_sdk()
    ran = subprocess.run(
        ["node", SCRIPT.name, ",".join(bases), QWEN3.model],
        cwd=folder,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert ran.returncode == 0, ran.stderr[-3000:]
    result = json.loads(ran.stdout)
    assert result["answers"] == ["Hello Ada!", "Your name is Ada.", "It is sunny in Paris."]
    assert result["steps"] == 2
    statuses = [exchange["status"] for exchange in result["exchanges"]]
    assert statuses == [200] * 4, result["exchanges"]
    second_turn = json.loads(result["exchanges"][1]["body"])
    referenced = [
        item["id"] for item in second_turn["input"] if item.get("type") == "item_reference"
    ]
    assert referenced == result["exchanges"][0]["output_ids"]
    servers = [exchange["server"] for exchange in result["exchanges"]]
    assert servers == [bases[n % len(bases)] for n in range(len(servers))]


def test_the_sdk_itself_chats_and_loops_over_tools(servers: Servers) -> None:
    run_the_sdk([servers.base])
