"""The `detect:` section of a pipeline file: which model folders this pipeline fits.

A rule matches when every condition it lists holds; a pipeline matches a model when any of
its rules does. Rules are data, evaluated generically by pipeserve.config.detect.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator


class DetectRule(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model_type: list[str] = Field(
        default_factory=list,
        description="config.json model_type (or text_config.model_type) is one of these.",
    )
    architectures: list[str] = Field(
        default_factory=list, description="config.json architectures names one of these."
    )
    template: list[str] = Field(
        default_factory=list, description="The chat template contains every one of these markers."
    )
    tokens: list[str] = Field(
        default_factory=list,
        description="The vocabulary has every one of these as a special (added) token.",
    )

    @model_validator(mode="after")
    def _not_empty(self) -> DetectRule:
        if not (self.model_type or self.architectures or self.template or self.tokens):
            raise ValueError(
                "a detect rule needs at least one of model_type, architectures, template, tokens"
            )
        return self


class DetectSection(BaseModel):
    model_config = ConfigDict(extra="forbid")

    rules: list[DetectRule] = Field(
        default_factory=list, description="Any matching rule makes this pipeline a candidate."
    )
    fallback: bool = Field(
        False,
        description="Chosen (with a warning) for `pipeline: auto` when no pipeline's rules match.",
    )
