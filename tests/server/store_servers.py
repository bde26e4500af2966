"""Servers with a response store for the stored-Responses tests (replay engine).

One store file in a temporary folder serves two servers in turn: a first server stores
a response and stops; the second (2 workers, the one the tests use) must still find it.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from openai import OpenAI
from openai.types.responses import Response

from tests.server.scenarios import QWEN3
from tests.server.serverproc import REPO, running_server

CONFIG = """\
pipelines_dir: {pipelines}
server:
  workers: {workers}
  responses_store: {store}
models:
  - {{name: replay-qwen3, source: "demo:qwen3", pipeline: qwen3, engine: replay}}
endpoints:
  - {{route: /v1/responses, api: openai-responses}}
"""


def store_config(folder: Path, workers: int, store: str | None = None) -> Path:
    """One replay model on /v1/responses, its store in `folder` (unless given)."""
    store = store or f"{{path: {folder / 'responses.sqlite3'}}}"
    path = folder / f"server-{workers}.yaml"
    path.write_text(CONFIG.format(pipelines=REPO / "pipelines", workers=workers, store=store))
    return path


@dataclass
class Servers:
    base: str
    client: OpenAI
    before_restart: Response  # stored by a server that has stopped since
    folder: Path


@contextmanager
def store_servers(folder: Path) -> Iterator[Servers]:
    with running_server(store_config(folder, workers=1)) as base:
        first = OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0)
        before = first.responses.create(
            model=QWEN3.model, input="Remember me", extra_body={"mock_response": QWEN3.reasoning}
        )
    with running_server(store_config(folder, workers=2)) as base:
        client = OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0)
        yield Servers(base, client, before, folder)
