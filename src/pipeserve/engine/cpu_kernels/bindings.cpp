// Python bindings of pipeserve's CPU extension (nanobind, sharing MLX's array type).
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/variant.h>
#include <nanobind/stl/vector.h>

#include "kernels.h"
#include "prefill_attention.h"

namespace nb = nanobind;
using namespace nb::literals;

// (w, scales, biases, bias, group_size, bits) of one projection, as Python passes it.
using ProjectionArgs =
    std::tuple<mx::array, mx::array, mx::array, std::optional<mx::array>, int, int>;

NB_MODULE(_pipeserve_cpu, m) {
  m.doc() = "pipeserve's CPU kernels for MLX: quantized and few-row float32 matmul, fused ops";
  m.def("affine_qmm", &pipeserve::affine_qmm, "x"_a, "w"_a, "scales"_a, "biases"_a,
        "group_size"_a, "bits"_a, nb::kw_only(), "stream"_a = nb::none(),
        "x @ dequantize(w, scales, biases).T in float32, w never expanded.");
  m.def("rms_norm", &pipeserve::rms_norm, "x"_a, "weight"_a, "eps"_a, nb::kw_only(),
        "stream"_a = nb::none(), "mx.fast.rms_norm in one float32 op.");
  m.def("rope", &pipeserve::rope, "x"_a, "dims"_a, "traditional"_a, "base"_a, "scale"_a,
        "offset"_a, nb::kw_only(), "stream"_a = nb::none(),
        "mx.fast.rope in one float32 op (x: B, H, L, D; offset: int32, 1 or B values).");
  m.def("sdpa", &pipeserve::sdpa, "q"_a, "k"_a, "v"_a, "scale"_a, "mask"_a = nb::none(),
        "merge_heads"_a = false, "causal"_a = false, nb::kw_only(), "stream"_a = nb::none(),
        "Attention of a few query rows (float32; grouped-query heads; mask optional).");
  m.def("add_rms_norm", &pipeserve::add_rms_norm, "x"_a, "residual"_a, "weight"_a, "eps"_a,
        nb::kw_only(), "stream"_a = nb::none(), "(x + residual, rms_norm(x + residual)).");
  m.def("swiglu", &pipeserve::swiglu, "gate_up"_a, nb::kw_only(), "stream"_a = nb::none(),
        "silu(gate) * up of a fused (..., 2I) projection, gate half first.");
  m.def("split_heads", &pipeserve::split_heads, "qkv"_a, "q_heads"_a, "kv_heads"_a,
        "rope_dims"_a, "traditional"_a, "base"_a, "scale"_a, "offset"_a, "q_norm"_a = nb::none(),
        "k_norm"_a = nb::none(), "eps"_a = 1e-6f, nb::kw_only(), "stream"_a = nb::none(),
        "A fused q/k/v projection split into rotated (B, H, L, D) heads.");
  nb::class_<pipeserve::DecoderLayer>(m, "DecoderLayer",
      "A llama- or Gemma-style decoder layer whose decode step (1..16 tokens per row) is one op.")
      .def("__init__",
           [](pipeserve::DecoderLayer* self,
              const std::vector<std::vector<ProjectionArgs>>& stages,
              const mx::array& input_norm, const mx::array& post_norm,
              const std::optional<mx::array>& q_norm, const std::optional<mx::array>& k_norm,
              int q_heads, int kv_heads, int head_dim, int rope_dims, bool traditional,
              float rope_base, float rope_scale, float attn_scale, float norm_eps,
              float qk_norm_eps, const std::optional<mx::array>& attn_out_norm,
              const std::optional<mx::array>& mlp_out_norm, bool gelu) {
             std::vector<std::vector<pipeserve::Projection>> ps;
             for (const auto& stage : stages) {
               ps.emplace_back();
               for (const auto& [w, scales, biases, bias, group_size, bits] : stage) {
                 ps.back().push_back({w, scales, biases, bias, group_size, bits});
               }
             }
             new (self) pipeserve::DecoderLayer(
                 std::move(ps), input_norm, post_norm, q_norm, k_norm, attn_out_norm,
                 mlp_out_norm,
                 {q_heads, kv_heads, head_dim, rope_dims, traditional, rope_base, rope_scale,
                  attn_scale, norm_eps, qk_norm_eps, gelu});
           },
           "stages"_a, "input_norm"_a, "post_norm"_a, "q_norm"_a.none(), "k_norm"_a.none(),
           "q_heads"_a, "kv_heads"_a, "head_dim"_a, "rope_dims"_a, "traditional"_a,
           "rope_base"_a, "rope_scale"_a, "attn_scale"_a, "norm_eps"_a, "qk_norm_eps"_a,
           "attn_out_norm"_a.none() = nb::none(), "mlp_out_norm"_a.none() = nb::none(),
           "gelu"_a = false,
           "stages: qkv, o, gate_up, down, each a list of (w, scales, biases, bias or None, "
           "group_size, bits) whose outputs lie side by side (o and down: one).")
      .def("__call__", &pipeserve::DecoderLayer::operator(), "x"_a, "keys"_a, "values"_a,
           "index"_a, "positions"_a = nb::none(), "mask"_a = nb::none(), "seen"_a = -1,
           nb::kw_only(), "stream"_a = nb::none(),
           "(out, keys, values): the step's output and the cache buffers with index..index + L - 1"
           " written (seen >= 1: one token at index, attending to positions 0..seen - 1).")
      .def("quantized", &pipeserve::DecoderLayer::quantized_step, "x"_a, "keys"_a, "values"_a,
           "group_size"_a, "bits"_a, "index"_a, "positions"_a = nb::none(),
           "mask"_a = nb::none(), nb::kw_only(), "stream"_a = nb::none(),
           "The step over a quantized cache: keys / values (words, scales, biases) as"
           " mx.quantize makes them; (out, keys, values) with index..index + L - 1 written.");
  m.attr("DECODER_LAYER_MAX_TOKENS") = pipeserve::DECODER_LAYER_MAX_TOKENS;
  m.attr("DECODER_LAYER_MAX_PROMPT_TOKENS") = pipeserve::DECODER_LAYER_MAX_PROMPT_TOKENS;
  m.def("f32_matmul", &pipeserve::f32_matmul, "x"_a, "w"_a, "transposed"_a,
        "bias"_a = nb::none(), nb::kw_only(), "stream"_a = nb::none(),
        "x @ w (w stored (K, N): transposed) or x @ w.T (w (N, K)), float32, + bias; a few rows"
        " of x on the kernels' threads, more through MLX's matmul.");
  m.attr("F32_MATMUL_MAX_ROWS") = pipeserve::F32_MATMUL_MAX_ROWS;
  m.attr("F32_PANEL") = pipeserve::F32_PANEL;
  m.def("f32_panels", &pipeserve::f32_panels, "w"_a, "transposed"_a, nb::kw_only(),
        "stream"_a = nb::none(),
        "w (K, N) (transposed) or (N, K), float32, as (ceil(N / F32_PANEL), K, F32_PANEL)"
        " contiguous panels of output columns (zeros past N), for f32_matmul_panels.");
  m.def("f32_matmul_panels", &pipeserve::f32_matmul_panels, "x"_a, "panels"_a, "n"_a,
        "bias"_a = nb::none(), nb::kw_only(), "stream"_a = nb::none(),
        "x @ W (+ bias) for W (K, n) held as f32_panels' panels, any number of rows of x, on"
        " the kernels' threads.");
  m.def("cache_rows", &pipeserve::cache_rows, "buffers"_a, "rows"_a, "start"_a, "stop"_a,
        "capacity"_a, nb::kw_only(), "stream"_a = nb::none(),
        "Rows (ascending) of KV cache buffers (B, heads, capacity, depth), positions"
        " start..stop - 1, as (len(rows), heads, capacity, depth) buffers: in place where a"
        " buffer may be donated, else new ones (zeros after the copied positions).");
  m.def("roll_rows", &pipeserve::roll_rows, "buffers"_a, "shifts"_a, "starts"_a, "stop"_a,
        nb::kw_only(), "stream"_a = nb::none(),
        "KV cache buffers (rows, heads, capacity, depth) with row r's positions"
        " starts[r]..stop - shifts[r] - 1 moved right by shifts[r]: in place where a buffer"
        " may be donated, else a copy.");
  m.def("cache_copy_bytes", &pipeserve::cache_copy_bytes,
        "Bytes of KV cache the decoder layer op copied (its input could not be donated).");
  m.def("top_p", &pipeserve::top_p, "logprobs"_a, "top_p"_a, nb::kw_only(),
        "stream"_a = nb::none(),
        "Top-p (nucleus) filtering of float32 log-probabilities: outside the nucleus -inf.");
  m.def("categorical", &pipeserve::categorical, "logits"_a, "uniforms"_a, nb::kw_only(),
        "stream"_a = nb::none(),
        "One index per row drawn from softmax(logits) at two float32 uniforms (..., 2).");
  m.def("top_k", &pipeserve::top_k, "logprobs"_a, "k"_a, nb::kw_only(), "stream"_a = nb::none(),
        "The k largest float32 log-probabilities of each row kept, the rest -inf.");
  m.def("bert_encode", &pipeserve::bert_encode, "ids"_a, "types"_a, "starts"_a, "weights"_a,
        "heads"_a, "eps"_a, "offset"_a, nb::kw_only(), "stream"_a = nb::none(),
        "A BERT-style encoder over packed sequences (bert_encoder.cpp): (T, hidden) vectors.");
  m.def("set_threads", &pipeserve::set_threads, "threads"_a,
        "Threads the quantized matmul splits rows over.");
  m.def("threads", &pipeserve::threads);
  m.def("simd", &pipeserve::simd_name, "The instruction set this build uses.");
  m.def("prefill_gemm_built", &pipeserve::prefill_gemm_built,
        "Whether the int8 VNNI GEMM for prompt chunks is built (prefill_gemm.cpp).");
  m.def("set_prefill_gemm", &pipeserve::set_prefill_gemm, "on"_a,
        "Switches the int8 prompt-chunk GEMM on or off (off: the float path).");
  m.def("prefill_gemm_enabled", &pipeserve::prefill_gemm_enabled);
  m.def("set_prefill_int8", &pipeserve::set_prefill_int8, "on"_a,
        "Rounds prompt-chunk x to int8 per run of 32 instead of int16 (faster, coarser).");
  m.def("prefill_int8", &pipeserve::prefill_int8);
  m.def("set_prefill_amx", &pipeserve::set_prefill_amx, "on"_a,
        "Lets the int16 prompt GEMM use AMX tiles where the CPU allows (else AVX512-VNNI).");
  m.def("prefill_amx", &pipeserve::prefill_amx, "Whether the prompt GEMM uses AMX tiles.");
  m.def("set_prefill_attention", &pipeserve::set_prefill_attention, "on"_a,
        "Switches the blocked attention for prompt chunks (prefill_attention.cpp) on or off.");
  m.def("prefill_attention_enabled", &pipeserve::prefill_attention_enabled);
}
