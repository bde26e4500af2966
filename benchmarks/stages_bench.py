"""Per-token cost of the transform stages of each pipeline (thinking, tool_calls, stop_sequences).

Pushes 1k, 10k and 100k generated tokens through each pipeline's transform stages, built
from pipelines/*.yaml, and prints microseconds per token per stage. Each stage is timed
on its own, fed the recorded output of the stages before it. The cost should be flat in
the length of the output (no rescanning of accumulated text).

    python benchmarks/stages_bench.py [--sizes 1000,10000,100000] [--repeat 3]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import yaml

from pipeserve.events import Event, Finish, PromptReady, TokenText, Usage
from pipeserve.request import GenerationRequest, Message, ToolSpec
from pipeserve.stages.base import STAGE_REGISTRY, BuildEnv, RequestContext

ROOT = Path(__file__).resolve().parent.parent
TRANSFORMS = ("thinking", "tool_calls", "stop_sequences")
TOOLS = [
    ToolSpec(
        "get_weather",
        "",
        {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "days": {"type": "integer"},
                "metric": {"type": "boolean"},
            },
        },
    ),
]
STOP = ["<<NEVER>>", "\n\nUser:"]
PROSE = (
    "The quick brown fox jumps over the lazy dog while the committee deliberates "
    "about the weather in Zürich, 東京 and São Paulo; prices rose 3.5% overnight. "
)
ARGS = '{"city": "Paris", "days": "3", "metric": "true"}'

# One block of raw model output per text format; repeated to the wanted length.
BLOCKS = {
    "qwen3": [
        "<think>",
        *PROSE,
        "</think>",
        *PROSE[:40],
        "<tool_call>",
        *('\n{"name": "get_weather", "arguments": ' + ARGS + "}\n"),
        "</tool_call>",
        *PROSE[40:],
    ],
    "chatml": [
        *PROSE,
        "<tool_call>",
        *('\n{"name": "get_weather", "arguments": ' + ARGS + "}\n"),
        "</tool_call>",
        *PROSE,
    ],
    "glm": [
        "<think>",
        *PROSE,
        "</think>",
        *PROSE[:40],
        "<tool_call>",
        "get",
        "_weather",
        "<arg_key>",
        "city",
        "</arg_key>",
        "<arg_value>",
        "Paris",
        "</arg_value>",
        "<arg_key>",
        "days",
        "</arg_key>",
        "<arg_value>",
        "3",
        "</arg_value>",
        "</tool_call>",
        *PROSE[40:],
    ],
    "kimi": [
        "<think>",
        *PROSE,
        "</think>",
        *PROSE[:40],
        "<|tool_calls_section_begin|>",
        "<|tool_call_begin|>",
        "functions",
        ".get",
        "_weather",
        ":0",
        "<|tool_call_argument_begin|>",
        *ARGS,
        "<|tool_call_end|>",
        "<|tool_calls_section_end|>",
        *PROSE[40:],
    ],
}
_DS = ("<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>",
       "<｜tool▁calls▁end｜>")  # fmt: skip
ARRAY = '[{"name": "get_weather", "arguments": ' + ARGS + "}]"
BLOCKS.update(
    {
        "llama3": [*PROSE, "<|python_tag|>", *('{"name": "get_weather", "parameters": ' + ARGS + "}"),
                   *PROSE],
        "mistral": ["[THINK]", *PROSE, "[/THINK]", *PROSE[:40], "[TOOL_CALLS]", "get", "_weather",
                    "[ARGS]", *ARGS, *PROSE[40:]],
        "qwen3-coder": [*PROSE, "<tool_call>", "\n", "<function=", "get", "_weather", ">", "\n",
                        "<parameter=", "city", ">", *"\nParis\n", "</parameter>", "\n", "<parameter=",
                        "days", ">", *"\n3\n", "</parameter>", "\n", "</function>", "\n", "</tool_call>",
                        *PROSE],
        "deepseek": ["<think>", *PROSE, "</think>", *PROSE[:40], _DS[0], _DS[1], "function", _DS[2],
                     *("get_weather\n```json\n" + ARGS + "\n```"), _DS[3], _DS[4], *PROSE[40:]],
        "phi4": [*PROSE, "<|tool_call|>", *ARRAY, "<|/tool_call|>", *PROSE],
        "granite": [*PROSE, "<|tool_call|>", *ARRAY, *PROSE],
        "gemma": [*PROSE, *"```tool_code\nget_weather(city='Paris', days=3)\n```", *PROSE],
    }
)  # fmt: skip
HARMONY_BLOCK = (
    "<|channel|>analysis<|message|>" + PROSE + "<|end|>"
    "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
    + ARGS
    + "<|call|><|start|>assistant<|channel|>final<|message|>"
    + PROSE
    + "<|end|><|start|>assistant"
)


def chunk(chars: list[str], size: int = 4) -> list[str]:
    """Group plain characters into ~4-char tokens; markers (len > 1 items) stay whole."""
    out: list[str] = []
    buf = ""
    for item in chars:
        if len(item) > 1:
            if buf:
                out.append(buf)
                buf = ""
            out.append(item)
            continue
        buf += item
        if len(buf) >= size:
            out.append(buf)
            buf = ""
    return out + ([buf] if buf else [])


def token_stream(family: str, n: int) -> list[Event]:
    if family == "gpt-oss":
        from pipeserve.stages.toolfmt.harmony_format import load_encoding

        enc = load_encoding()
        ids = enc.encode(HARMONY_BLOCK, allowed_special="all")
        block = [TokenText(enc.decode([i]), i) for i in ids]
    else:
        block = [TokenText(t, 1000 + i) for i, t in enumerate(chunk(BLOCKS[family]))]
    tokens = (block * (n // len(block) + 1))[:n]
    return [PromptReady(100), *tokens, Finish("length"), Usage(100, n)]


def build(family: str) -> list[tuple[str, Any]]:
    doc = yaml.safe_load((ROOT / "pipelines" / f"{family}.yaml").read_text())
    env = BuildEnv(model_name="bench", family=family)
    stages = []
    for item in doc["stages"]:
        ((kind, params),) = item.items()
        if kind in TRANSFORMS:
            spec = STAGE_REGISTRY[kind]
            stages.append((kind, spec.factory(spec.params_model(**(params or {})), env)))
    return stages


def context() -> RequestContext:
    request = GenerationRequest(
        model="bench", messages=[Message("user", "hi")], tools=TOOLS, stop=STOP
    )
    return RequestContext(request=request, request_id="bench", model_name="bench")


def time_stage(stage: Any, events: list[Event], repeat: int) -> tuple[float, list[Event]]:
    best, out = float("inf"), []
    for _ in range(repeat):
        ctx = context()
        stage.prepare(ctx)
        t0 = time.perf_counter()
        out = list(stage(iter(events), ctx))
        best = min(best, time.perf_counter() - t0)
    return best, out


def bench(family: str, n: int, repeat: int) -> dict[str, float]:
    events = token_stream(family, n)
    result: dict[str, float] = {}
    for kind, stage in build(family):
        seconds, events = time_stage(stage, events, repeat)
        result[kind] = seconds / n * 1e6
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1000,10000,100000")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument(
        "--families",
        default="qwen3,chatml,glm,kimi,gpt-oss,llama3,mistral,qwen3-coder,deepseek,phi4,granite,gemma",
    )
    args = parser.parse_args(argv)
    for module in ("thinking", "tool_calls", "stop_sequences"):
        __import__(f"pipeserve.stages.{module}")
    sizes = [int(s) for s in args.sizes.split(",")]
    print(
        f"{'pipeline':<11} {'tokens':>7}  "
        + "  ".join(f"{k:>14}" for k in TRANSFORMS)
        + "   total  (us/token)"
    )
    for family in args.families.split(","):
        for n in sizes:
            r = bench(family, n, args.repeat)
            cells = "  ".join(f"{r[k]:>14.2f}" if k in r else f"{'-':>14}" for k in TRANSFORMS)
            print(f"{family:<11} {n:>7}  {cells}  {sum(r.values()):>6.2f}", flush=True)


if __name__ == "__main__":
    main()
