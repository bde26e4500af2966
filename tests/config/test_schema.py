"""`pipeserve schema`: valid draft 2020-12 JSON Schema that accepts the shipped YAML."""

from __future__ import annotations

import json
from typing import Any

import pytest
import yaml
from jsonschema import Draft202012Validator

from pipeserve.cli import main
from pipeserve.config.pipeline_checks import embed_stage_registry, stage_registry
from pipeserve.config.schema import json_schema
from tests.config.conftest import GOOD_CONFIG, GOOD_PIPELINE
from tests.config.shipped import require_shipped_and_real_stages


def cli_schema(kind: str, capsys: pytest.CaptureFixture[str]) -> dict[str, Any]:
    assert main(["schema", "--kind", kind]) == 0
    schema: dict[str, Any] = json.loads(capsys.readouterr().out)
    return schema


@pytest.mark.parametrize("kind", ["config", "pipeline", "all"])
def test_schema_is_valid_json_schema(kind: str, capsys: pytest.CaptureFixture[str]) -> None:
    schema = cli_schema(kind, capsys)
    assert schema["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    Draft202012Validator.check_schema(schema)


def test_stage_items_are_one_of_the_registered_kinds(capsys: pytest.CaptureFixture[str]) -> None:
    schema = cli_schema("pipeline", capsys)
    stage_items = schema["$defs"]["PipelineFile"]["properties"]["stages"]["items"]["oneOf"]
    kinds = {**stage_registry(), **embed_stage_registry()}  # chat and embedding stages
    assert [item["title"] for item in stage_items] == sorted(kinds)
    thinking = next(i for i in stage_items if i["title"] == "test_thinking")
    assert thinking["required"] == ["test_thinking"] and thinking["additionalProperties"] is False
    params = schema["$defs"][thinking["properties"]["test_thinking"]["$ref"].split("/")[-1]]
    assert params["required"] == ["start", "end"]
    generate = next(i for i in stage_items if i["title"] == "test_generate")
    assert {"type": "null"} in generate["properties"]["test_generate"][
        "anyOf"
    ]  # `- generate:` is fine


def errors(schema: dict[str, Any], text: str) -> list[str]:
    return [e.message for e in Draft202012Validator(schema).iter_errors(yaml.safe_load(text))]


def test_good_and_bad_files_against_the_schema(capsys: pytest.CaptureFixture[str]) -> None:
    everything = cli_schema("all", capsys)
    pipeline = json_schema("pipeline")
    config = json_schema("config")
    assert errors(everything, GOOD_PIPELINE) == errors(pipeline, GOOD_PIPELINE) == []
    assert errors(everything, GOOD_CONFIG) == errors(config, GOOD_CONFIG) == []
    assert errors(pipeline, GOOD_PIPELINE.replace("test_stop:", "test_stp:"))
    assert errors(pipeline, GOOD_PIPELINE.replace('start: "<think>", ', ""))
    assert errors(pipeline, GOOD_PIPELINE.replace("{format: json}", "{format: jsn}"))
    assert errors(pipeline, GOOD_PIPELINE + "extra: 1\n")
    assert errors(config, GOOD_CONFIG.replace("port: 8080", "port: 99999"))
    assert errors(config, GOOD_PIPELINE)
    assert errors(everything, "family: x\nmodels: []\n")


def test_shipped_yaml_validates_against_the_schema() -> None:
    files = require_shipped_and_real_stages()
    validator = Draft202012Validator(json_schema("all"))
    for path in files:
        problems = [
            f"{path.name}: {e.message}"
            for e in validator.iter_errors(yaml.safe_load(path.read_text()))
        ]
        assert problems == []
