"""`pipeline: auto`: pick a model's pipeline from its folder, by the pipelines' `detect:` rules.

Evidence is read from the folder's JSON and template files only (config.json, tokenizer
files, chat templates), or from a GGUF file's metadata (its architecture, chat template
and control tokens; no tensor is read): this runs in the gunicorn master too, where MLX
must never run.
A rule that matched on config.json facts (model_type, architectures) outranks one that
matched on the vocabulary or template only; among equals, the rule that checked more facts
wins. When no rule matches, the pipeline marked `fallback: true` is chosen with a warning.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipeserve.config.detect_rules import DetectRule

AUTO = "auto"


@dataclass(frozen=True)
class ModelEvidence:
    """What a model folder says about its family."""

    folder: Path
    model_types: frozenset[str] = frozenset()
    architectures: frozenset[str] = frozenset()
    template: str = ""
    special_tokens: frozenset[str] = frozenset()
    config_name: str = "config.json"  # where model_type was read (a GGUF: its metadata)


@dataclass(frozen=True)
class Detection:
    """The pipeline chosen for one model, and why."""

    pipeline: str
    evidence: tuple[str, ...]
    fallback: bool = False
    others: tuple[str, ...] = ()  # other pipelines that matched, weaker

    def describe(self) -> str:
        why = "; ".join(self.evidence)
        if self.fallback:
            return f"{self.pipeline} (fallback: no pipeline's detect rules matched; {why})"
        also = f"; also matched, weaker: {', '.join(self.others)}" if self.others else ""
        return f"{self.pipeline} ({why}{also})"


@dataclass(frozen=True)
class _Match:
    pipeline: str
    strength: tuple[int, int]
    facts: tuple[str, ...] = field(default_factory=tuple)


class DetectionError(ValueError):
    """No rule matched and no pipeline is marked `fallback: true`."""


# GGUF `general.architecture` names -> the Hugging Face model_type(s) they stand for.
GGUF_MODEL_TYPES: dict[str, tuple[str, ...]] = {
    "qwen2moe": ("qwen2_moe",),
    "qwen3moe": ("qwen3_moe",),
    "deepseek2": ("deepseek_v2", "deepseek_v3"),
    "glm4moe": ("glm4_moe",),
    "gpt-oss": ("gpt_oss",),
    "granitehybrid": ("granitemoehybrid",),
}
_GGUF_SPECIAL_TYPES = (3, 4)  # llama.cpp token types CONTROL and USER_DEFINED


def read_evidence(folder: Path) -> ModelEvidence:
    """The evidence of a model folder, or of a `.gguf` file."""
    if folder.suffix.lower() == ".gguf" and folder.is_file():
        return read_gguf_evidence(folder)
    config = _json(folder / "config.json")
    text_config: Any = (
        config.get("text_config") if isinstance(config.get("text_config"), dict) else {}
    )
    types = {t for t in (config.get("model_type"), text_config.get("model_type")) if t}
    archs: Any = (
        config.get("architectures") if isinstance(config.get("architectures"), list) else []
    )
    return ModelEvidence(
        folder=folder,
        model_types=frozenset(str(t) for t in types),
        architectures=frozenset(str(a) for a in archs),
        template=chat_template_text(folder),
        special_tokens=frozenset(special_tokens(folder)),
    )


def read_gguf_evidence(path: Path) -> ModelEvidence:
    """Architecture, chat template and control tokens of a GGUF file's metadata (read by
    the converter's own header reader: about a second for a 262k-token vocabulary)."""
    from pipeserve.engine.weights.gguf.header import read_header

    try:
        meta, _ = read_header(path)
    except (OSError, ValueError) as exc:  # HeaderError is a ValueError
        raise DetectionError(f"{path} is not a readable GGUF file: {exc}") from exc

    def value(key: str) -> Any:
        return meta.get(key)

    arch = str(value("general.architecture") or "")
    tokens = value("tokenizer.ggml.tokens") or []
    types = value("tokenizer.ggml.token_type") or []
    special = {t for t, kind in zip(tokens, types) if kind in _GGUF_SPECIAL_TYPES}
    template = value("tokenizer.chat_template")
    return ModelEvidence(
        folder=path,
        model_types=frozenset({arch, *GGUF_MODEL_TYPES.get(arch, ())} - {""}),
        template=template if isinstance(template, str) else "",
        special_tokens=frozenset(str(t) for t in special),
        config_name="GGUF general.architecture",
    )


def chat_template_text(folder: Path) -> str:
    """Every chat template the folder ships (tokenizer_config, chat_template.json/.jinja)."""
    parts: list[str] = []
    for source in (_json(folder / "tokenizer_config.json"), _json(folder / "chat_template.json")):
        parts += _templates(source.get("chat_template"))
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        parts.append(jinja.read_text(encoding="utf-8", errors="replace"))
    return "\n".join(parts)


def _templates(value: Any) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, list):  # [{"name": ..., "template": ...}]
        return [str(v.get("template", "")) for v in value if isinstance(v, dict)]
    return []


def special_tokens(folder: Path) -> set[str]:
    """Added/special tokens of the vocabulary (tokenizer.json and tokenizer_config.json)."""
    found: set[str] = set()
    tokenizer = _json(folder / "tokenizer.json")
    for item in tokenizer.get("added_tokens") or []:
        if isinstance(item, dict) and isinstance(item.get("content"), str):
            found.add(item["content"])
    config = _json(folder / "tokenizer_config.json")
    for item in (config.get("added_tokens_decoder") or {}).values():
        if isinstance(item, dict) and isinstance(item.get("content"), str):
            found.add(item["content"])
    found.update(t for t in config.get("additional_special_tokens") or [] if isinstance(t, str))
    for value in _json(folder / "special_tokens_map.json").values():
        content = value.get("content") if isinstance(value, dict) else value
        if isinstance(content, str):
            found.add(content)
    return found


def _json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def rule_facts(
    rule: DetectRule, evidence: ModelEvidence
) -> tuple[tuple[int, int], list[str]] | None:
    """(strength, matched facts) when every condition of the rule holds, else None."""
    facts: list[str] = []
    config_facts = 0
    if rule.model_type:
        hit = sorted(evidence.model_types & set(rule.model_type))
        if not hit:
            return None
        facts.append(f"{evidence.config_name} model_type={hit[0]}")
        config_facts += 1
    if rule.architectures:
        hit = sorted(evidence.architectures & set(rule.architectures))
        if not hit:
            return None
        facts.append(f"{evidence.config_name} architectures has {hit[0]}")
        config_facts += 1
    if rule.template:
        if not all(marker in evidence.template for marker in rule.template):
            return None
        facts.append("chat template has " + ", ".join(rule.template))
    if rule.tokens:
        if not all(token in evidence.special_tokens for token in rule.tokens):
            return None
        facts.append("special tokens " + ", ".join(rule.tokens))
    return (config_facts, len(rule.template) + len(rule.tokens)), facts


def detect_pipeline(evidence: ModelEvidence, pipelines: Mapping[str, Any]) -> Detection:
    """The best-matching pipeline among `pipelines` (name -> LoadedPipeline with .detect)."""
    matches = sorted(
        _matches(evidence, pipelines), key=lambda m: (-m.strength[0], -m.strength[1], m.pipeline)
    )
    if matches:
        best = matches[0].pipeline
        # The evidence is every fact of every rule of the chosen pipeline that matched.
        facts = (fact for m in matches if m.pipeline == best for fact in m.facts)
        others = tuple(dict.fromkeys(m.pipeline for m in matches if m.pipeline != best))
        return Detection(best, tuple(dict.fromkeys(facts)), others=others)
    fallback = [name for name, p in sorted(pipelines.items()) if p.detect and p.detect.fallback]
    seen = describe_evidence(evidence)
    if not fallback:
        raise DetectionError(
            f"no pipeline's detect rules match {evidence.folder} ({seen}) and none is marked "
            "`detect: {fallback: true}`; name the pipeline in the config"
        )
    return Detection(fallback[0], (seen,), fallback=True)


def _matches(evidence: ModelEvidence, pipelines: Mapping[str, Any]) -> Iterable[_Match]:
    for name, pipeline in pipelines.items():
        section = getattr(pipeline, "detect", None)
        for rule in section.rules if section else ():
            outcome = rule_facts(rule, evidence)
            if outcome is not None:
                yield _Match(name, outcome[0], tuple(outcome[1]))


def describe_evidence(evidence: ModelEvidence) -> str:
    types = ", ".join(sorted(evidence.model_types)) or "none"
    archs = ", ".join(sorted(evidence.architectures)) or "none"
    template = "a chat template" if evidence.template else "no chat template"
    return (
        f"model_type {types}; architectures {archs}; {template}; "
        f"{len(evidence.special_tokens)} special tokens"
    )
