"""Validation of pipelines and server configs: every message positioned exactly."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipeserve.config import (
    ConfigError,
    LoadedConfig,
    load_pipeline,
    load_server_config,
    validate_paths,
)
from pipeserve.config.config_checks import KNOWN_APIS
from pipeserve.config.loader import load_yaml
from pipeserve.config.validate import detect_kind
from tests.config.conftest import GOOD_CONFIG, GOOD_PIPELINE, NoParams, ThinkingParams, Tree


def messages(*paths: Path) -> list[str]:
    return [str(p) for p in validate_paths(list(paths)).problems]


def with_pipeline(tree: Tree, text: str, name: str = "qwen3") -> Path:
    return tree.write(f"pipelines/{name}.yaml", text)


def test_good_files_load(tree: Tree) -> None:
    with_pipeline(tree, GOOD_PIPELINE)
    config = tree.write("configs/default.yaml", GOOD_CONFIG)
    assert messages(config, tree.root / "pipelines/qwen3.yaml") == []
    loaded = load_server_config(config)
    assert isinstance(loaded, LoadedConfig)
    assert loaded.config.models[0].name == "demo"
    pipeline = loaded.pipeline_for("demo")
    assert pipeline.name == "qwen3" and pipeline.family == "qwen3"
    assert [(s.kind, s.role) for s in pipeline.stages] == [
        ("test_render", "render"),
        ("test_generate", "generate"),
        ("test_thinking", "transform"),
        ("test_tool_calls", "transform"),
        ("test_stop", "transform"),
    ]
    assert pipeline.stages[2].params == ThinkingParams(start="<think>", end="</think>")
    assert isinstance(pipeline.stages[4].params, NoParams)  # `test_stop:` with no params


def test_unknown_top_level_key_in_config(tree: Tree) -> None:
    with_pipeline(tree, GOOD_PIPELINE)
    config = tree.write("configs/default.yaml", GOOD_CONFIG + "endpoint: []\n")
    assert messages(config) == [
        "configs/default.yaml:9:1: endpoint: unknown key 'endpoint'; did you mean 'endpoints'?"
    ]


def test_unknown_top_level_key_in_pipeline(tree: Tree) -> None:
    path = with_pipeline(tree, "famly: qwen3\n" + GOOD_PIPELINE)
    assert messages(path) == [
        "pipelines/qwen3.yaml:1:1: famly: unknown key 'famly'; did you mean 'family'?"
    ]


def test_unknown_nested_key_without_close_match_lists_the_known_keys(tree: Tree) -> None:
    with_pipeline(tree, GOOD_PIPELINE)
    config = tree.write(
        "configs/default.yaml", GOOD_CONFIG.replace("port: 8080", "port: 8080, zzz: 1")
    )
    (message,) = messages(config)
    assert message.startswith("configs/default.yaml:1:39: server.zzz: unknown key 'zzz' (known: ")
    assert "graceful_timeout, host" in message


def test_unknown_stage_kind_with_suggestion(tree: Tree) -> None:
    path = with_pipeline(tree, GOOD_PIPELINE.replace("test_thinking:", "test_thinkng:"))
    assert messages(path) == [
        "pipelines/qwen3.yaml:5:5: stages[2].test_thinkng: unknown stage kind 'test_thinkng'; did you mean 'test_thinking'?"
    ]


def test_missing_required_stage_parameter(tree: Tree) -> None:
    path = with_pipeline(tree, GOOD_PIPELINE.replace(', end: "</think>"', ""))
    assert messages(path) == [
        "pipelines/qwen3.yaml:5:20: stages[2].test_thinking.end: Field required"
    ]


def test_missing_parameters_of_a_stage_without_params_point_at_its_name(tree: Tree) -> None:
    path = with_pipeline(
        tree,
        GOOD_PIPELINE.replace(
            'test_thinking: {start: "<think>", end: "</think>"}', "test_thinking:"
        ),
    )
    assert messages(path) == [
        "pipelines/qwen3.yaml:5:5: stages[2].test_thinking.start: Field required",
        "pipelines/qwen3.yaml:5:5: stages[2].test_thinking.end: Field required",
    ]


def test_wrong_type(tree: Tree) -> None:
    path = with_pipeline(
        tree, GOOD_PIPELINE.replace("{format: json}", "{format: json, max_calls: [1]}")
    )
    assert messages(path) == [
        "pipelines/qwen3.yaml:6:48: stages[3].test_tool_calls.max_calls: Input should be a valid integer, got a list"
    ]


def test_wrong_literal_suggests_the_closest_value(tree: Tree) -> None:
    path = with_pipeline(tree, GOOD_PIPELINE.replace("{format: json}", "{format: jsn}"))
    assert messages(path) == [
        "pipelines/qwen3.yaml:6:31: stages[3].test_tool_calls.format: "
        "Input should be 'json', 'glm', 'kimi' or 'harmony'; did you mean 'json'?"
    ]


def test_unknown_stage_parameter(tree: Tree) -> None:
    path = with_pipeline(tree, GOOD_PIPELINE.replace('end: "</think>"', 'ends: "</think>"'))
    assert messages(path) == [
        "pipelines/qwen3.yaml:5:20: stages[2].test_thinking.end: Field required",
        "pipelines/qwen3.yaml:5:39: stages[2].test_thinking.ends: unknown key 'ends'; did you mean 'end'?",
    ]


def test_stage_item_must_be_a_single_key_mapping(tree: Tree) -> None:
    text = GOOD_PIPELINE.replace(
        "  - test_stop:\n", "  - test_stop\n  - {test_stop: {}, test_render: {}}\n"
    )
    path = with_pipeline(tree, text)
    assert messages(path) == [
        "pipelines/qwen3.yaml:7:5: stages[4]: a stage is a single-key mapping {kind: {params}}, "
        "got 'test_stop' (write '- test_stop: {}')",
        "pipelines/qwen3.yaml:8:5: stages[5]: a stage is a single-key mapping {kind: {params}}, got 2 keys",
    ]


def test_pipeline_without_generation_stage(tree: Tree) -> None:
    path = with_pipeline(tree, GOOD_PIPELINE.replace("  - test_generate: {}\n", ""))
    assert messages(path) == [
        "pipelines/qwen3.yaml:2:1: stages: the pipeline needs exactly one generation stage (e.g. '- generate: {}')"
    ]


def test_two_generation_stages_and_render_after_generate(tree: Tree) -> None:
    text = "family: x\nstages:\n  - test_generate:\n  - test_render:\n  - test_generate: {}\n"
    path = with_pipeline(tree, text)
    assert messages(path) == [
        "pipelines/qwen3.yaml:5:5: stages[2].test_generate: a second generation stage (the first is stages[0]); "
        "exactly one is allowed",
        "pipelines/qwen3.yaml:4:5: stages[1].test_render: the render stage must come before the generation stage "
        "(stages[0])",
    ]


def test_model_naming_a_missing_pipeline(tree: Tree) -> None:
    with_pipeline(tree, GOOD_PIPELINE)
    config = tree.write(
        "configs/default.yaml", GOOD_CONFIG.replace("pipeline: qwen3", "pipeline: qwen")
    )
    assert messages(config) == [
        "configs/default.yaml:5:15: models[0].pipeline: no pipeline 'qwen' in pipelines; did you mean 'qwen3'?"
    ]


def test_pipelines_dir_is_relative_to_the_config(tree: Tree) -> None:
    tree.write("elsewhere/families/qwen3.yaml", GOOD_PIPELINE)
    config = tree.write("elsewhere/server.yaml", "pipelines_dir: families\n" + GOOD_CONFIG)
    assert messages(config) == []
    missing = tree.write("configs/default.yaml", "pipelines_dir: nowhere\n" + GOOD_CONFIG)
    assert messages(missing) == [
        "configs/default.yaml:1:16: pipelines_dir: no such folder: configs/nowhere"
    ]


def test_duplicate_route(tree: Tree) -> None:
    with_pipeline(tree, GOOD_PIPELINE)
    text = GOOD_CONFIG + "  - route: /v1/messages/\n    api: anthropic-messages\n"
    config = tree.write("configs/default.yaml", text)
    assert messages(config) == [
        "configs/default.yaml:9:12: endpoints[2].route: duplicate route '/v1/messages/' (also endpoints[1].route at line 8)"
    ]


def test_unknown_api_duplicate_model_and_unknown_endpoint_model(tree: Tree) -> None:
    with_pipeline(tree, GOOD_PIPELINE)
    text = GOOD_CONFIG.replace("api: openai-chat}", "api: openai-chats, models: [demo, dmeo]}")
    text = text.replace("endpoints:", "  - {name: demo, source: x, pipeline: qwen3}\nendpoints:")
    config = tree.write("configs/default.yaml", text)
    assert messages(config) == [
        "configs/default.yaml:6:12: models[1].name: duplicate model name 'demo' (also models[0].name at line 3)",
        "configs/default.yaml:8:40: endpoints[0].api: unknown api 'openai-chats'; did you mean 'openai-chat'?",
        "configs/default.yaml:8:69: endpoints[0].models[1]: no model named 'dmeo'; did you mean 'demo'?",
    ]


def test_demo_source_must_match_the_pipeline_family(tree: Tree) -> None:
    with_pipeline(tree, GOOD_PIPELINE)
    config = tree.write("configs/default.yaml", GOOD_CONFIG.replace("demo:qwen3", "demo:glm"))
    assert messages(config) == [
        "configs/default.yaml:4:13: models[0].source: demo model family 'glm' does not match pipeline 'qwen3' "
        "(family 'qwen3'); its chat format and markers would not fit"
    ]


def test_unknown_demo_model(tree: Tree) -> None:
    pytest.importorskip("pipeserve.engine.weights.demo.build")
    with_pipeline(tree, GOOD_PIPELINE)
    config = tree.write("configs/default.yaml", GOOD_CONFIG.replace("demo:qwen3", "demo:qwen"))
    assert messages(config) == [
        "configs/default.yaml:4:13: models[0].source: unknown demo model 'demo:qwen'; did you mean 'qwen3'?"
    ]


def test_all_problems_reported_together(tree: Tree) -> None:
    pipeline = GOOD_PIPELINE.replace("test_generate: {}", "test_generat: {}").replace(
        "{format: json}", "{}"
    )
    with_pipeline(tree, pipeline)
    text = (
        GOOD_CONFIG.replace("port: 8080", "port: http")
        .replace("/v1/messages,", "/v1/chat/completions,")
        .replace("anthropic-messages", "anthropic")
        + "extra: 1\n"
    )
    config = tree.write("configs/default.yaml", text)
    with pytest.raises(ConfigError) as info:
        load_server_config(config)
    assert str(info.value).splitlines() == [
        "configs/default.yaml:1:33: server.port: Input should be a valid integer, unable to parse string as an integer",
        "configs/default.yaml:8:13: endpoints[1].route: duplicate route '/v1/chat/completions' "
        "(also endpoints[0].route at line 7)",
        "configs/default.yaml:8:40: endpoints[1].api: unknown api 'anthropic'; did you mean 'anthropic-messages'?",
        "configs/default.yaml:9:1: extra: unknown key 'extra' (known: endpoints, models, pipelines_dir, server)",
        "pipelines/qwen3.yaml:4:5: stages[1].test_generat: unknown stage kind 'test_generat'; "
        "did you mean 'test_generate'?",
        "pipelines/qwen3.yaml:6:22: stages[3].test_tool_calls.format: Field required",
    ]


def test_load_pipeline_raises_with_positions(tree: Tree) -> None:
    path = with_pipeline(tree, "family: 3\nstages: []\n")
    with pytest.raises(ConfigError) as info:
        load_pipeline(path)
    assert [str(p) for p in info.value.problems] == [
        "pipelines/qwen3.yaml:1:9: family: Input should be a valid string, got int 3",
        "pipelines/qwen3.yaml:2:9: stages: List should have at least 1 item after validation, not 0",
    ]
    assert load_pipeline(with_pipeline(tree, GOOD_PIPELINE)).family == "qwen3"


def test_a_pipeline_used_by_two_configs_is_reported_once(tree: Tree) -> None:
    with_pipeline(tree, GOOD_PIPELINE.replace("test_stop:", "test_stp:"))
    a = tree.write("configs/a.yaml", GOOD_CONFIG)
    b = tree.write("configs/b.yaml", GOOD_CONFIG)
    assert messages(a, b, tree.root / "pipelines/qwen3.yaml") == [
        "pipelines/qwen3.yaml:7:5: stages[4].test_stp: unknown stage kind 'test_stp'; did you mean 'test_stop'?"
    ]


def test_file_kind_from_keys_or_folder(tree: Tree) -> None:
    assert detect_kind(load_yaml(tree.write("x/a.yaml", "stages: []\n"))) == "pipeline"
    assert detect_kind(load_yaml(tree.write("x/b.yaml", "models: []\n"))) == "config"
    assert detect_kind(load_yaml(tree.write("pipelines/c.yaml", "stagez: []\n"))) == "pipeline"
    assert detect_kind(load_yaml(tree.write("configs/d.yaml", "modelz: []\n"))) == "config"
    unknown = tree.write("x/e.yaml", "what: 1\n")
    assert detect_kind(load_yaml(unknown)) is None
    assert messages(unknown) == [
        "x/e.yaml:1:1: (root): cannot tell a server config (models, endpoints) from a pipeline (family, stages)"
    ]


def test_known_apis_match_the_registered_protocols() -> None:
    from pipeserve.api import PROTOCOL_MODULES, load_builtin_protocols

    try:
        protocols = load_builtin_protocols()
    except ModuleNotFoundError as exc:  # a protocol module not written yet
        if not str(exc.name).startswith("pipeserve.api."):
            raise
        pytest.skip(f"protocol module missing: {exc.name}")
    assert len(PROTOCOL_MODULES) == len(KNOWN_APIS)
    assert set(protocols) == set(KNOWN_APIS)
