"""Server config and pipeline YAML: loading with positions, validation, JSON Schema.

The server calls `load_server_config(path)`, which returns a LoadedConfig (the validated
ServerConfig plus each pipeline its models use) or raises ConfigError listing every
problem as `FILE:LINE:COL: dotted.path: message`.
"""

from pipeserve.config.config_checks import KNOWN_APIS, LoadedConfig
from pipeserve.config.loader import YamlDoc, load_yaml
from pipeserve.config.models import EndpointEntry, ModelEntry, PipelineFile, ServerConfig
from pipeserve.config.pipeline_checks import LoadedPipeline, StageEntry, stage_registry
from pipeserve.config.problems import ConfigError, Problem
from pipeserve.config.validate import load_pipeline, load_server_config, validate_paths

__all__ = [
    "KNOWN_APIS",
    "ConfigError",
    "EndpointEntry",
    "LoadedConfig",
    "LoadedPipeline",
    "ModelEntry",
    "PipelineFile",
    "Problem",
    "ServerConfig",
    "StageEntry",
    "YamlDoc",
    "load_pipeline",
    "load_server_config",
    "load_yaml",
    "stage_registry",
    "validate_paths",
]
