"""LoRA adapters on the MLX engine (engine/mlx/lora.py): adapters trained with mlx_lm.lora
give, per request, mlx-lm's own greedy tokens (`load(..., adapter_path=...)` + generate);
rows of two adapters and the base decode in one batch, each as it does alone; the prefix
cache keeps each adapter's KV apart; speculation and prompt groups carry the adapter; the
memory added is the adapters' matrices; a bad adapter is refused at load with its reason
while the base and the other adapters serve."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten

from pipeserve.config.models import AdapterEntry, EngineOptions, ModelEntry, SpeculativeOptions
from pipeserve.engine.base import ModelRuntime
from pipeserve.engine.runtime import build_runtime
from pipeserve.errors import ApiError
from tests.engine.helpers import collect, job, reference_ids
from tests.lora import broken_copy

pytestmark = pytest.mark.mlx

MAX_TOKENS = 12
PROMPTS = {
    "pirate": [9707, 11, 279, 4265, 315],
    "chef": [785, 1156, 3019, 374, 2474, 13],
    None: [9707, 11, 279, 4265, 315],
}


def lora_entry(adapters: dict[str, Path], **options: Any) -> ModelEntry:
    return ModelEntry(
        name="m",
        source="demo:qwen3",
        pipeline="qwen3",
        options=EngineOptions(**options),
        adapters=[AdapterEntry(name=n, path=str(p)) for n, p in adapters.items()],
    )


@pytest.fixture(scope="module")
def runtime(
    lora_adapters: dict[str, Path], demo_model_dir: Callable[[str], Path]
) -> Iterator[ModelRuntime]:
    demo_model_dir("qwen3")
    built = build_runtime(lora_entry(lora_adapters))
    yield built
    built.engine.close()


@pytest.fixture(scope="module")
def expected(
    lora_adapters: dict[str, Path], demo_model_dir: Callable[[str], Path]
) -> dict[str | None, list[int]]:
    """mlx-lm's own greedy ids per adapter (None: the base), on each one's prompt."""
    import mlx_lm

    folder = str(demo_model_dir("qwen3"))
    out: dict[str | None, list[int]] = {}
    for name, prompt in PROMPTS.items():
        path = None if name is None else str(lora_adapters[name])
        model, tokenizer = mlx_lm.load(folder, adapter_path=path)
        out[name] = reference_ids(model, tokenizer, prompt, MAX_TOKENS)
    return out


def run(runtime: ModelRuntime, adapter: str | None, **fields: Any) -> list[int]:
    request = job(PROMPTS[adapter], MAX_TOKENS, runtime.eos_token_ids)
    request.adapter = adapter
    for key, value in fields.items():
        setattr(request, key, value)
    return collect(runtime.engine.submit(request)).ids


def test_each_adapter_equals_mlx_lm_with_its_adapter(runtime, expected) -> None:
    for adapter in PROMPTS:
        assert run(runtime, adapter) == expected[adapter], adapter
    # The adapters change the answers (else equality above would prove nothing).
    base_on_pirate_prompt = expected[None]
    assert expected["pirate"] != base_on_pirate_prompt


def test_two_adapters_and_the_base_in_one_batch(runtime, expected) -> None:
    stats = runtime.engine.stats
    steps = stats()["decode_steps"]
    jobs = []
    for adapter in [*PROMPTS, *PROMPTS]:  # each twice: six rows
        request = job(PROMPTS[adapter], MAX_TOKENS, runtime.eos_token_ids)
        request.adapter = adapter
        jobs.append((adapter, runtime.engine.submit(request)))
    for adapter, stream in jobs:
        assert collect(stream).ids == expected[adapter], adapter
    # One batch: the six rows took about one request's steps, not six requests' steps.
    assert stats()["decode_steps"] - steps < 2 * (MAX_TOKENS + 2)


def test_prefix_cache_is_keyed_by_adapter(runtime, expected) -> None:
    prompt = [11, 22, 33, 44, 55, 66, 77, 88, 99, 111, 222, 333, 444, 555, 666, 777, 888] * 4
    answers = {}
    for adapter in ("pirate", None, "chef", "pirate"):
        request = job(prompt, 6)
        request.adapter = adapter
        got = collect(runtime.engine.submit(request))
        answers.setdefault(adapter, []).append((got.ids, got.ready.cached_tokens))
    (pirate_first, pirate_again) = answers["pirate"]
    assert answers[None][0][1] == 0 and answers["chef"][0][1] == 0  # not the pirate's KV
    assert pirate_again[1] > 0 and pirate_again[0] == pirate_first[0]
    assert len({tuple(ids) for ids, _ in (pirate_first, answers[None][0], answers["chef"][0])}) == 3


def test_prompt_group_and_speculation_carry_the_adapter(
    lora_adapters: dict[str, Path], expected: dict[str | None, list[int]]
) -> None:
    speculative = SpeculativeOptions(method="prompt_lookup", tokens=3)
    built = build_runtime(lora_entry(lora_adapters, speculative=speculative))
    try:
        for adapter in PROMPTS:
            streams = []
            for _ in range(3):
                request = job(PROMPTS[adapter], MAX_TOKENS, built.eos_token_ids)
                request.adapter, request.prompt_group, request.group_size = (
                    adapter,
                    "g" + str(adapter),
                    3,
                )
                streams.append(built.engine.submit(request))
            for stream in streams:
                assert collect(stream).ids == expected[adapter], adapter
        assert built.engine.stats()["shared_prompt_rows_total"] > 0
    finally:
        built.engine.close()


def test_memory_added_is_the_adapters_matrices(
    lora_adapters: dict[str, Path], demo_model_dir
) -> None:
    from pipeserve.engine.mlx.lora import AdapterSource, MultiLoRALinear, rows_of
    from pipeserve.engine.weights.loader import load_model

    folder = demo_model_dir("qwen3")
    sources = [AdapterSource(n, p) for n, p in lora_adapters.items()]
    mx.synchronize()
    before = mx.get_active_memory()
    plain = load_model(folder, "auto", True)
    mx.eval(plain.parameters())
    plain_bytes = mx.get_active_memory() - before
    adapted = load_model(folder, "auto", True, sources)
    mx.eval(adapted.parameters())
    adapted_bytes = mx.get_active_memory() - before - plain_bytes
    rows = rows_of(adapted)
    assert rows is not None and set(rows.slots) == set(lora_adapters)
    stacked = sum(
        m.lora_a.nbytes + m.lora_b.nbytes
        for _, m in adapted.named_modules()
        if isinstance(m, MultiLoRALinear)
    )
    params = lambda model: sum(v.nbytes for _, v in tree_flatten(model.parameters()))  # noqa: E731
    # The base's weights are not copied: what the adapters add is their stacked matrices
    # (zeros where an adapter skips a module, or has a lower rank), at most twice the
    # adapters' own bytes here.
    assert params(adapted) - params(plain) == stacked
    assert rows.nbytes <= stacked <= 2 * rows.nbytes
    assert abs(adapted_bytes - plain_bytes - stacked) < 0.1 * plain_bytes
    # The CPU kernels' fused blocks cannot add the products: none in a model with adapters.
    from pipeserve.engine.cpu_kernels import kernels
    from pipeserve.engine.cpu_kernels.fused_layers import FusedBlock

    fused = lambda model: sum(isinstance(m, FusedBlock) for _, m in model.named_modules())  # noqa: E731
    assert fused(adapted) == 0
    assert fused(plain) == (len(plain.layers) if kernels() is not None else 0)
    print(f"model {plain_bytes} B; adapters add {adapted_bytes - plain_bytes} B"
          f" (stacked {stacked} B, files {rows.nbytes} B)")  # fmt: skip


def test_bad_adapter_is_refused_at_load_and_the_rest_serve(
    lora_adapters: dict[str, Path], expected: dict[str | None, list[int]], tmp_path: Path
) -> None:
    def wide(config: dict[str, Any], weights: dict[str, mx.array]) -> None:
        key = next(k for k in weights if k.endswith("q_proj.lora_a"))
        weights[key] = mx.zeros((weights[key].shape[0] + 1, weights[key].shape[1]))

    bad = broken_copy(lora_adapters["pirate"], tmp_path / "bad", wide)
    built = build_runtime(lora_entry({"pirate": lora_adapters["pirate"], "bad": bad}))
    try:
        request = job(PROMPTS[None], MAX_TOKENS)
        request.adapter = "bad"
        with pytest.raises(ApiError) as raised:
            built.engine.submit(request)
        assert raised.value.param == "model" and "adapter 'bad'" in raised.value.message
        assert "wrong shapes" in raised.value.message and "q_proj" in raised.value.message
        assert run(built, None) == expected[None]
        assert run(built, "pirate") == expected["pirate"]
    finally:
        built.engine.close()


def synthetic_adapter(model_dir: Path, out: Path) -> Path:
    """An adapter folder as mlx_lm.lora writes it (its own linear_to_lora_layers on the
    loaded model, every trainable matrix saved), with random lora_b instead of training."""
    import mlx_lm
    from mlx_lm.tuner.utils import linear_to_lora_layers

    model, _ = mlx_lm.load(str(model_dir))
    model.freeze()
    params = {
        "rank": 4,
        "scale": 4.0,
        "dropout": 0.0,
        "keys": ["self_attn.q_proj", "mlp.down_proj"],
    }
    mx.random.seed(7)  # lora_a's random start: the same adapter in every run
    linear_to_lora_layers(model, 4, params)
    adapters = dict(tree_flatten(model.trainable_parameters()))
    key = mx.random.key(7)
    for name in list(adapters):
        if name.endswith("lora_b"):
            key, sub = mx.random.split(key)
            adapters[name] = 0.3 * mx.random.normal(adapters[name].shape, key=sub)
    out.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out / "adapters.safetensors"), adapters)
    config = {"fine_tune_type": "lora", "num_layers": 4, "lora_parameters": params}
    (out / "adapter_config.json").write_text(json.dumps(config))
    return out


@pytest.mark.parametrize("dtype", ["quantized", "auto"])
def test_quantized_base_smollm2_equals_mlx_lm(
    smollm2: tuple[Path, Path], tmp_path: Path, dtype: str
) -> None:
    """SmolLM2-135M Q4_1 kept quantized (mlx's QuantizedLinear, or with dtype auto on the
    CPU the kernels' layers, inside the wrappers): an adapter's greedy tokens equal
    mlx-lm's with the same adapter."""
    import mlx_lm

    folder = smollm2[1]
    adapter = synthetic_adapter(folder, tmp_path / "syn")
    model, tokenizer = mlx_lm.load(str(folder), adapter_path=str(adapter))
    base_model, _ = mlx_lm.load(str(folder))
    prompt = tokenizer.encode("The capital of France is")
    want = reference_ids(model, tokenizer, prompt, MAX_TOKENS)
    assert want != reference_ids(base_model, tokenizer, prompt, MAX_TOKENS)
    entry = ModelEntry(
        name="s", source=str(folder), pipeline="chatml",
        options=EngineOptions(dtype=dtype), adapters=[AdapterEntry(name="syn", path=str(adapter))],
    )  # fmt: skip
    built = build_runtime(entry)
    try:
        request = job(prompt, MAX_TOKENS, built.eos_token_ids)
        request.adapter = "syn"
        assert collect(built.engine.submit(request)).ids == want
    finally:
        built.engine.close()


def test_on_demand_adapter_is_added_at_its_first_request(
    lora_adapters: dict[str, Path], expected: dict[str | None, list[int]]
) -> None:
    entry = lora_entry(lora_adapters)
    entry.adapters[1].load = "on_demand"  # chef
    built = build_runtime(entry)
    try:
        assert run(built, "pirate") == expected["pirate"]
        assert run(built, None) == expected[None]
        jobs = []
        for adapter in ["chef", "pirate", None, "chef"]:  # chef's first request in a batch
            request = job(PROMPTS[adapter], MAX_TOKENS, built.eos_token_ids)
            request.adapter = adapter
            jobs.append((adapter, built.engine.submit(request)))
        for adapter, stream in jobs:
            assert collect(stream).ids == expected[adapter], adapter
    finally:
        built.engine.close()


def test_on_demand_adapter_holds_no_matrices_until_asked(
    lora_adapters: dict[str, Path], demo_model_dir: Callable[[str], Path]
) -> None:
    from pipeserve.engine.mlx.lora import AdapterSource, rows_of
    from pipeserve.engine.weights.loader import load_model

    sources = [
        AdapterSource("pirate", lora_adapters["pirate"]),
        AdapterSource("chef", lora_adapters["chef"], on_demand=True),
    ]
    model = load_model(demo_model_dir("qwen3"), "auto", True, sources)
    rows = rows_of(model)
    assert rows is not None and set(rows.slots) == {"pirate"} and rows.names == {"pirate", "chef"}
    before = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
    rows.ensure("chef")
    assert set(rows.slots) == {"pirate", "chef"} and not rows.pending
    after = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
    assert after - before == 65536  # the stack's second slot: rank 8 over pirate's modules
