"""Model load: the log names the device, and a warm-up runs batch 1 and max_batch once."""

from __future__ import annotations

import logging

import mlx.core as mx
import pytest

from pipeserve.engine.runtime import build_runtime
from tests.engine.helpers import collect, entry, job, reference_ids

pytestmark = pytest.mark.mlx


def engine_messages(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "pipeserve.engine"]


def test_load_names_the_device_and_warms_up(demo_model_dir, demo_model, caplog) -> None:
    demo_model_dir("qwen3")
    caplog.set_level(logging.INFO, logger="pipeserve.engine")
    runtime = build_runtime(entry("demo:qwen3", max_batch=3))
    try:
        # The load's and the warm-up's freed buffers went back (engine/weights/memory.py).
        assert mx.get_cache_memory() == 0
        messages = engine_messages(caplog)
        kind = "gpu" if mx.default_device().type == mx.DeviceType.gpu else "cpu"
        assert any(m.startswith(f"model m: runs on {kind}") for m in messages), messages
        assert any(m.startswith("warm-up at batch 1 and 3:") for m in messages), messages
        # The warm-up leaves no trace: no counted steps, nothing cached, exact first answer.
        stats = runtime.engine.stats()
        assert stats["decode_steps"] == 0 and stats["prefix_cache_entries"] == 0
        model, tokenizer = demo_model("qwen3")
        prompt = list(runtime.tokenizer.encode("Warm or cold, the same answer."))
        got = collect(runtime.engine.submit(job(prompt, max_tokens=12)))
        assert got.ids == reference_ids(model, tokenizer, prompt, 12)
    finally:
        runtime.engine.close()


def test_warmup_can_be_turned_off(demo_model_dir, caplog) -> None:
    demo_model_dir("qwen3")
    caplog.set_level(logging.INFO, logger="pipeserve.engine")
    runtime = build_runtime(entry("demo:qwen3", warmup=False))
    runtime.engine.close()
    assert not any(m.startswith("warm-up") for m in engine_messages(caplog))
