// The ops pipeserve's CPU extension adds to MLX (bindings.cpp exposes them to Python).
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "mlx/array.h"
#include "mlx/utils.h"

namespace mx = mlx::core;

namespace pipeserve {

// x @ dequantize(w, scales, biases).T for MLX's affine layout, float32 out (affine_qmm.cpp).
// An empty `biases`: a symmetric format (Q8_0, Q4_0, Q5_0), each bias -2^(bits - 1) x its
// scale, computed from the scales instead of read.
mx::array affine_qmm(
    const mx::array& x,
    const mx::array& w,
    const mx::array& scales,
    const mx::array& biases,
    int group_size,
    int bits,
    mx::StreamOrDevice s = {});

// One quantized product on raw buffers, run on the calling thread with the kernels' pool
// (affine_qmm.cpp): out (M, N) = x (M, K) @ dequantize(w, scales, biases).T, everything
// row-contiguous, the layout affine_qmm takes. For ops that chain several products.
struct QmmRows {
  const float* x;
  const void* w;  // uint32 words (N, K * bits / 32)
  const void* scales;  // (N, K / group_size), float16 (half_scales) or float32
  const void* biases;  // as scales, or null: symmetric, bias = -2^(bits - 1) x scale
  float* out;
  int M, K, N, group_size, bits;
  bool half_scales;
};
void affine_qmm_rows(const QmmRows& args);

// The same product for prompt chunks as an int8 AVX512-VNNI GEMM (prefill_gemm.cpp):
// false (nothing written) where it is not built, switched off, or x is not finite.
bool prefill_qmm(const QmmRows& args);
bool prefill_gemm_built();
void set_prefill_gemm(bool on);
bool prefill_gemm_enabled();
// x rounded to int8 per run (llama.cpp's Q8_0) instead of the default int16.
void set_prefill_int8(bool on);
bool prefill_int8();
// AMX tiles for the int16 x where this CPU and kernel allow them (else AVX512-VNNI).
void set_prefill_amx(bool on);
bool prefill_amx();

// mx.fast.rms_norm as one CPU op, float32 (fused.cpp).
mx::array rms_norm(const mx::array& x, const mx::array& weight, float eps, mx::StreamOrDevice s = {});

// mx.fast.rope as one CPU op, float32 (fused.cpp): x (B, H, L, D), any strides; offset an
// int32 array of 1 or B positions.
mx::array rope(
    const mx::array& x,
    int dims,
    bool traditional,
    float base,
    float scale,
    const mx::array& offset,
    mx::StreamOrDevice s = {});

// Attention of a few query rows against a cache (fused.cpp): q (B, Hq, L, D), k and v
// (B, Hk, S, D), any strides; mask None, boolean or additive, broadcastable to
// (B, Hq, L, S). merge_heads: out (B, L, Hq * D) instead of (B, Hq, L, D); causal:
// query row l sees keys up to position S - L + l (and the mask, if any).
mx::array sdpa(
    const mx::array& q,
    const mx::array& k,
    const mx::array& v,
    float scale,
    const std::optional<mx::array>& mask,
    bool merge_heads = false,
    bool causal = false,
    mx::StreamOrDevice s = {});

// h = x + residual and rms_norm(h) * weight in one pass, float32 (fused_step.cpp).
std::tuple<mx::array, mx::array> add_rms_norm(
    const mx::array& x,
    const mx::array& residual,
    const mx::array& weight,
    float eps,
    mx::StreamOrDevice s = {});

// silu(gate) * up of a fused projection (..., 2I), gate half first (fused_step.cpp).
mx::array swiglu(const mx::array& gate_up, mx::StreamOrDevice s = {});

// A fused q/k/v projection (B, L, (Hq + 2 Hk) * D) split into q (B, Hq, L, D) and k, v
// (B, Hk, L, D), q and k normalised per head (optional weights) and rotated like
// mx.fast.rope (offset: int32, 1 or B positions) (fused_step.cpp).
std::tuple<mx::array, mx::array, mx::array> split_heads(
    const mx::array& qkv,
    int q_heads,
    int kv_heads,
    int rope_dims,
    bool traditional,
    float base,
    float scale,
    const mx::array& offset,
    const std::optional<mx::array>& q_norm,
    const std::optional<mx::array>& k_norm,
    float eps,
    mx::StreamOrDevice s = {});

// One kernel projection of a layer (a KernelLinear): MLX's affine layout, optional bias.
struct Projection {
  mx::array w, scales, biases;
  std::optional<mx::array> bias;
  int group_size, bits;
};

struct LayerShape {
  int q_heads, kv_heads, head_dim, rope_dims;
  bool traditional;
  float rope_base, rope_scale, attn_scale, norm_eps, qk_norm_eps;
  bool gelu = false;  // the gate's activation: tanh-approximated GELU (Gemma), else SiLU
};

// A quantized KV buffer as MLX keeps it: (uint32 words, scales, biases).
using QuantizedParts = std::tuple<mx::array, mx::array, mx::array>;

// Most new tokens per row a DecoderLayer step takes (a decode step: 1; a speculative
// verification: its width); prefills take the per-op path.
constexpr int DECODER_LAYER_MAX_TOKENS = 16;
// Most new tokens per row the op itself takes: a short prompt chunk as one op per layer
// (Gemma's prompt path, gemma_layers.py); the rows of its matmuls stay on affine_qmm's
// integer path (up to 64 rows).
constexpr int DECODER_LAYER_MAX_PROMPT_TOKENS = 64;

// A llama- or Gemma-style decoder layer whose decode step of L = 1..16 tokens per row is
// ONE op (fused_layer.cpp): rms_norm -> qkv -> heads (+ per-head norm) + RoPE -> the L new
// keys / values written into the cache buffers at index..index + L - 1 -> attention of
// token l over positions 0..index + l -> o (-> rms_norm: Gemma's attn_out_norm) ->
// residual add + rms_norm -> gate_up -> SwiGLU or GeGLU -> down (-> rms_norm: Gemma's
// mlp_out_norm) -> residual add. Stages: qkv, o, gate_up (gate half first), down, each
// one projection or several whose outputs lie side by side (q, k, v of different
// quantizations; gate, up). The weights are taken (made contiguous) at construction.
class DecoderLayer {
 public:
  DecoderLayer(
      std::vector<std::vector<Projection>> stages,
      mx::array input_norm,
      mx::array post_norm,
      std::optional<mx::array> q_norm,
      std::optional<mx::array> k_norm,
      std::optional<mx::array> attn_out_norm,
      std::optional<mx::array> mlp_out_norm,
      LayerShape shape);

  // x (B, L, hidden); keys / values the cache buffers (B, Hk, capacity, D), index + L <=
  // capacity; positions: int32, 1 or B RoPE positions of each row's first new token
  // (None: index); mask: boolean or additive, broadcastable to (B, Hq, L, index + L), on
  // top of the causal order of the new tokens. seen >= 1 (a sliding window's ring
  // buffer, L = 1): the token is written at index < seen and attends to positions
  // 0..seen - 1 of the buffer (the mask then broadcasts to (B, Hq, 1, seen)). Returns
  // (out, keys, values): the cache buffers with the new positions written (the input
  // buffers, donated, where MLX allows; copies otherwise).
  std::tuple<mx::array, mx::array, mx::array> operator()(
      const mx::array& x,
      const mx::array& keys,
      const mx::array& values,
      int index,
      const std::optional<mx::array>& positions,
      const std::optional<mx::array>& mask,
      int seen = -1,
      mx::StreamOrDevice s = {}) const;

  // The same step over a quantized cache (`options.kv_cache`; attention_quantized.cpp):
  // keys / values each MLX's affine triple (uint32 words (B, Hk, capacity, D * bits / 32),
  // float32 scales and biases (B, Hk, capacity, D / group_size)), the new rows quantized
  // as mx.quantize does, attention read from the codes. Returns (out, keys, values).
  std::tuple<mx::array, QuantizedParts, QuantizedParts> quantized_step(
      const mx::array& x,
      const QuantizedParts& keys,
      const QuantizedParts& values,
      int group_size,
      int bits,
      int index,
      const std::optional<mx::array>& positions,
      const std::optional<mx::array>& mask,
      mx::StreamOrDevice s = {}) const;

 private:
  void check_x(const mx::array& x, mx::StreamOrDevice s) const;
  std::vector<mx::array> step(const mx::array& x, const std::vector<mx::array>& caches,
                              int index, const std::optional<mx::array>& positions,
                              const std::optional<mx::array>& mask, int seen, int group_size,
                              int bits, mx::StreamOrDevice s) const;

  mx::array none_;  // an empty input: no positions / no mask
  std::vector<mx::array> weights_;  // norms, then each projection's w, scales, biases, bias
  std::vector<std::vector<Projection>> stages_;
  bool q_norm_, k_norm_, attn_out_norm_, mlp_out_norm_;
  LayerShape shape_;
};

// Output columns per panel of f32_matmul's panels layout (f32_panels): 8 vectors of
// this build's widest float SIMD, or 16 scalars.
#if defined(__AVX512F__)
constexpr int F32_PANEL = 128;
#elif defined(__AVX2__) && defined(__FMA__)
constexpr int F32_PANEL = 32;
#else
constexpr int F32_PANEL = 16;
#endif

// Most rows of x f32_matmul runs itself; more go to MLX's matmul (the BLAS). At 8 rows
// the kernel won on a quiet machine but lost under load, when its second thread seldom
// runs (docs/cpu-kernels.md); up to 4 it won or tied either way.
constexpr int F32_MATMUL_MAX_ROWS = 4;

// x @ w for a float32 weight stored (K, N) (transposed) or x @ w.T for one stored (N, K),
// plus bias (N) if given (f32_matmul.cpp). Up to F32_MATMUL_MAX_ROWS rows of x (all axes
// but the last): the weight read once for all rows, columns split across the kernels'
// threads; each output one FMA chain over k in order, so both layouts give the same
// numbers. More rows, or x not float32: MLX's matmul (addmm with a bias).
mx::array f32_matmul(
    const mx::array& x,
    const mx::array& w,
    bool transposed,
    const std::optional<mx::array>& bias = std::nullopt,
    mx::StreamOrDevice s = {});

// w (K, N) (transposed) or (N, K) as (ceil(N / F32_PANEL), K, F32_PANEL): each panel
// its F32_PANEL output columns' weights in one contiguous block, (k, column) row-major,
// the columns past N zero. For f32_matmul_panels.
mx::array f32_panels(const mx::array& w, bool transposed, mx::StreamOrDevice s = {});

// x @ W (+ bias) for a weight W (K, n) held as f32_panels' panels, any number of rows of
// x (the BLAS cannot read panels; x and bias cast to float32), on the kernels' threads:
// the same numbers as f32_matmul's few-row kernel in either layout.
mx::array f32_matmul_panels(
    const mx::array& x,
    const mx::array& panels,
    int n,
    const std::optional<mx::array>& bias = std::nullopt,
    mx::StreamOrDevice s = {});

// The same product over plain pointers, for other ops: out (M, N) = x (M, K) @ w, rows of
// x / w / out ldx / ldw / ldo floats apart, bias (N) or null. f32_matmul_rows splits the
// columns across the kernels' threads (not from inside a parallel_for job: the pool
// runs one call at a time); f32_matmul_columns computes columns [n0, n1) on the calling
// thread. Any M (rows are taken 2 at a time per pass over a panel of the weight).
void f32_matmul_rows(const float* x, int64_t ldx, int M, int K, const float* w, int64_t ldw,
                     int N, bool transposed, const float* bias, float* out, int64_t ldo);
void f32_matmul_columns(const float* x, int64_t ldx, int M, int K, const float* w, int64_t ldw,
                        bool transposed, const float* bias, float* out, int64_t ldo, int n0,
                        int n1);

// Rows `rows` (ascending) of each KV cache buffer (float32 (B, heads, capacity, depth),
// any strides), positions start..stop - 1, as buffers (len(rows), heads, `capacity`,
// depth) holding them at 0..stop - start - 1: one op for all the buffers
// (cache_rows.cpp). A buffer that may be donated (same capacity, at least half its rows
// kept) is compacted in place; otherwise a new buffer gets the rows and zeros after them.
std::vector<mx::array> cache_rows(const std::vector<mx::array>& buffers,
                                  const std::vector<int>& rows, int start, int stop,
                                  int capacity, mx::StreamOrDevice s = {});

// A verification's rollback (roll_rows.cpp): in each KV cache buffer (float32 (rows,
// heads, capacity, depth)), row r's positions starts[r]..stop - shifts[r] - 1 moved right
// by shifts[r] (rows with shift 0 stay): one op for all the buffers, in place where a
// buffer may be donated, else into a copy.
std::vector<mx::array> roll_rows(const std::vector<mx::array>& buffers,
                                 const std::vector<int>& shifts, const std::vector<int>& starts,
                                 int stop, mx::StreamOrDevice s = {});

// Bytes of KV cache the decoder layer op copied because its input buffer could not be
// donated (something else held it): counted for tests and benchmarks.
void count_cache_copy(int64_t bytes);
int64_t cache_copy_bytes();

// A BERT-style encoder over packed sequences as one op (bert_encoder.cpp): ids and types
// (T,) of the sequences laid end to end, starts (S + 1,) their first rows (starts[S] = T);
// weights: word, position and type embeddings, their LayerNorm weight and bias, then per
// layer qkv (packed), its bias, output (packed), bias, LayerNorm w, b, up (packed), bias,
// down (packed), bias, LayerNorm w, b; a packed weight (N / 32, K, 32) is w.T's 32-column
// panels. Returns the last layer's token vectors (T, hidden), float32.
mx::array bert_encode(const mx::array& ids, const mx::array& types, const mx::array& starts,
                      const std::vector<mx::array>& weights, int heads, float eps, int offset,
                      mx::StreamOrDevice s = {});

// Top-p (nucleus) and top-k filtering of log-probabilities (..., V), float32, as mlx-lm's
// apply_top_p / apply_top_k: entries outside become -inf (sampling_filters.cpp).
mx::array top_p(const mx::array& logprobs, float top_p, mx::StreamOrDevice s = {});
mx::array top_k(const mx::array& logprobs, int k, mx::StreamOrDevice s = {});
// One index per row of logits (..., V) drawn from softmax(logits), by inverting the
// cumulative distribution at uniforms (..., 2), two float32 uniforms per row
// (sampling_filters.cpp).
mx::array categorical(const mx::array& logits, const mx::array& uniforms,
                      mx::StreamOrDevice s = {});

// Runs job(0) .. job(chunks - 1) on the kernels' thread pool (affine_qmm.cpp), the
// calling thread included, and returns when all are done; rethrows a job's exception.
void parallel_for(int chunks, const std::function<void(int)>& job);

void set_threads(int threads);
int threads();
std::string simd_name();

}  // namespace pipeserve
