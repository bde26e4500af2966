// A llama- or Gemma-style decoder layer's decode step (1..16 new tokens per row: a decode
// step or a speculative verification) as ONE MLX op.
//
// Even with the layer's glue fused (fused_step.cpp), a decode step of a small model runs
// ~12 ops per layer, and on the CPU every op costs a dispatch on the stream's thread, a
// Python call while the graph is built and, for the matmuls, a fork / join of the
// kernels' pool: in SmolLM2-135M (30 layers) that overhead was as large as the matmuls.
// Here the whole layer is one primitive whose job runs the stages back to back on the
// stream's thread, each stage split over the kernels' pool (parallel_for, affine_qmm_rows).
//
// The KV cache keeps MLX's functional semantics: the op takes the cache's key / value
// buffers as inputs and returns them with positions index..index + L - 1 written. Where MLX allows
// (the input is contiguous and nothing else holds it) the output shares the input's
// buffer, as MLX's own slice update does; otherwise the buffer is copied first.

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <optional>
#include <stdexcept>
#include <tuple>
#include <unordered_map>
#include <vector>

#include "mlx/backend/cpu/encoder.h"
#include "mlx/ops.h"
#include "mlx/primitives.h"
#include "mlx/transforms.h"

#include "attention.h"
#include "attention_quantized.h"
#include "kernels.h"
#include "strided.h"

namespace pipeserve {

namespace {

void fail(const std::string& message) {
  throw std::invalid_argument("decoder_layer: " + message);
}

enum Stage { QKV = 0, O = 1, GATE_UP = 2, DOWN = 3 };
enum Input { X = 0, KEYS = 1, VALUES = 2, POSITIONS = 3, MASK = 4, WEIGHTS = 5 };

// A projection as raw buffers.
struct ProjectionView {
  const void* w;
  const void* scales;
  const void* biases;
  const float* bias;  // null: none
  int N, K, group_size, bits;
  bool half;
};

// A stage: one projection, or several whose outputs lie side by side (N: their sum).
struct StageView {
  std::vector<ProjectionView> parts;
  int N = 0;
};

// A quantized cache's buffers (MLX's affine layout, attention_quantized.h): the words
// of keys / values (B, Hk, capacity, D * bits / 32) and their scales / biases (B, Hk,
// capacity, D / group_size). bits 0: the cache is float32 (Job's keys / values).
struct QuantizedCache {
  uint32_t *k_words = nullptr, *v_words = nullptr;
  float *k_scales = nullptr, *k_biases = nullptr, *v_scales = nullptr, *v_biases = nullptr;
  int group_size = 0, bits = 0;
};

// Everything the dispatched job reads and writes, as raw pointers.
struct Job {
  LayerShape s;
  int B, L, hidden, index, capacity;  // L new tokens per row: positions index..index + L - 1
  const float* x;
  std::vector<int64_t> x_rows;  // each of the B * L rows' first element
  int64_t x_step;
  const int32_t* positions;  // null: every row at `index`
  int n_positions;
  const void* mask;  // null: none
  bool bool_mask;
  int64_t mask_b, mask_h, mask_l, mask_s;  // broadcast strides (0 on size-1 axes)
  int seen;  // > 0: positions every token attends to (a ring buffer); else index + l + 1
  const float *input_norm, *post_norm, *q_norm, *k_norm;
  const float *attn_out_norm, *mlp_out_norm;  // null: none (Gemma's norms after o / down)
  StageView proj[4];
  float *keys, *values, *out;  // keys / values: (B, Hk, capacity, D), contiguous
  QuantizedCache quant;  // bits > 0: the cache is quantized (keys / values unused)
};

void project(const ProjectionView& p, const float* x, int M, float* out) {
  affine_qmm_rows({x, p.w, p.scales, p.biases, out, M, p.K, p.N, p.group_size, p.bits, p.half});
  if (p.bias == nullptr) return;
  for (int m = 0; m < M; ++m) {
    float* row = out + static_cast<size_t>(m) * p.N;
    for (int n = 0; n < p.N; ++n) row[n] += p.bias[n];
  }
}

// out (M, stage.N): each part's outputs at its columns.
void project(const StageView& stage, const float* x, int M, float* out) {
  if (stage.parts.size() == 1) return project(stage.parts[0], x, M, out);
  thread_local std::vector<float> part_out;
  int at = 0;
  for (const auto& p : stage.parts) {
    if (M == 1) {
      project(p, x, 1, out + at);
    } else {
      part_out.resize(static_cast<size_t>(M) * p.N);
      project(p, x, M, part_out.data());
      for (int m = 0; m < M; ++m) {
        std::memcpy(out + static_cast<size_t>(m) * stage.N + at,
                    part_out.data() + static_cast<size_t>(m) * p.N, p.N * sizeof(float));
      }
    }
    at += p.N;
  }
}

inline float inverse_rms(const float* row, int d, float eps) {
  float sum = dot(row, 1, row, 1, d);
  return 1.0f / std::sqrt(sum / d + eps);
}

void rms_norm_rows(const float* in, const float* w, float eps, int rows, int d, float* out) {
  for (int r = 0; r < rows; ++r) {
    const float* x = in + static_cast<size_t>(r) * d;
    const float inv = inverse_rms(x, d, eps);
    float* o = out + static_cast<size_t>(r) * d;
    for (int i = 0; i < d; ++i) o[i] = x[i] * inv * w[i];
  }
}

// cos / sin of a position, like mx.fast.rope (and split_heads); the tables are kept, as
// every layer of a step rotates the same positions (cleared when the RoPE changes).
struct RopeTables {
  int dims = 0;
  float base = 0.0f, scale = 0.0f;
  std::unordered_map<int, std::vector<float>> tables;  // position -> cos (half), sin (half)

  const float* at(int pos, const LayerShape& s) {
    if (dims != s.rope_dims || base != s.rope_base || scale != s.rope_scale ||
        tables.size() > 1024) {
      tables.clear();
      dims = s.rope_dims, base = s.rope_base, scale = s.rope_scale;
    }
    auto [it, fresh] = tables.try_emplace(pos);
    if (!fresh) return it->second.data();
    const int half = dims / 2;
    auto& table = it->second;
    table.resize(2 * half);
    const float p = static_cast<float>(pos) * scale;
    for (int i = 0; i < half; ++i) {
      const float angle = p * std::pow(base, -2.0f * i / dims);
      table[i] = std::cos(angle);
      table[half + i] = std::sin(angle);
    }
    return table.data();
  }
};

// The tables of this layer's RoPE: one set per RoPE kept, so that Gemma's layers, which
// alternate two bases (local and global), do not recompute every position at each switch.
RopeTables& rope_tables(const LayerShape& s) {
  thread_local std::array<RopeTables, 2> sets;
  thread_local size_t next = 0;
  for (auto& set : sets) {
    if (set.dims == s.rope_dims && set.base == s.rope_base && set.scale == s.rope_scale) return set;
  }
  next = (next + 1) % sets.size();
  return sets[next];
}

// One head: optional RMSNorm (weight w), then optional RoPE.
void head_out(const float* in, float* out, const LayerShape& s, const float* w,
              const float* rope) {
  const int d = s.head_dim;
  const float inv = w ? inverse_rms(in, d, s.qk_norm_eps) : 1.0f;
  for (int i = 0; i < d; ++i) out[i] = w ? in[i] * inv * w[i] : in[i];
  if (rope == nullptr) return;
  const int half = s.rope_dims / 2;
  for (int i = 0; i < half; ++i) {
    const int i1 = s.traditional ? 2 * i : i;
    const int i2 = s.traditional ? 2 * i + 1 : i + half;
    const float x1 = out[i1], x2 = out[i2];
    const float c = rope[i], sn = rope[half + i];
    out[i1] = x1 * c - x2 * sn;
    out[i2] = x1 * sn + x2 * c;
  }
}

// A new key (normalised, rotated) and value quantized into cache position `at` (of all
// rows' positions), as mx.quantize would.
void write_quantized(const Job& j, size_t at, const float* k, const float* v,
                     const float* table) {
  const auto& c = j.quant;
  const int D = j.s.head_dim, words = D * c.bits / 32, groups = D / c.group_size;
  thread_local std::vector<float> key;
  key.resize(D);
  head_out(k, key.data(), j.s, j.k_norm, table);
  quantize_row(key.data(), D, c.group_size, c.bits, c.k_words + at * words,
               c.k_scales + at * groups, c.k_biases + at * groups);
  quantize_row(v, D, c.group_size, c.bits, c.v_words + at * words, c.v_scales + at * groups,
               c.v_biases + at * groups);
}

// Row b's kv head kh of a quantized cache (positions 0..capacity - 1).
QuantizedHead quantized_head(const Job& j, int b, int kh) {
  const auto& c = j.quant;
  const int D = j.s.head_dim, words = D * c.bits / 32, groups = D / c.group_size;
  const size_t first = (static_cast<size_t>(b) * j.s.kv_heads + kh) * j.capacity;
  return {{c.k_words + first * words, c.k_scales + first * groups, c.k_biases + first * groups,
           words, groups},
          {c.v_words + first * words, c.v_scales + first * groups, c.v_biases + first * groups,
           words, groups},
          D, c.group_size, c.bits};
}

// qkv rows (B * L) -> rotated q (B * L, Hq, D), and row b's token l's key / value written
// into the cache at index + l, rotated at the row's position + l.
void heads(const Job& j, const float* qkv, float* q) {
  const auto& s = j.s;
  const int D = s.head_dim, width = (s.q_heads + 2 * s.kv_heads) * D;
  RopeTables& rope = rope_tables(s);
  for (int b = 0; b < j.B; ++b) {
    const int first = j.positions ? j.positions[j.n_positions == 1 ? 0 : b] : j.index;
    for (int l = 0; l < j.L; ++l) {
      const size_t m = static_cast<size_t>(b) * j.L + l;
      const float* table = rope.at(first + l, s);
      const float* row = qkv + m * width;
      for (int h = 0; h < s.q_heads; ++h) {
        head_out(row + h * D, q + (m * s.q_heads + h) * D, s, j.q_norm, table);
      }
      for (int h = 0; h < s.kv_heads; ++h) {
        const size_t at = (static_cast<size_t>(b) * s.kv_heads + h) * j.capacity + j.index + l;
        const float* k = row + (s.q_heads + h) * D;
        const float* v = row + (s.q_heads + s.kv_heads + h) * D;
        if (j.quant.bits > 0) {
          write_quantized(j, at, k, v, table);
        } else {
          head_out(k, j.keys + at * D, s, j.k_norm, table);
          head_out(v, j.values + at * D, s, nullptr, nullptr);
        }
      }
    }
  }
}

// Query head h of row b's token l against the cache's positions 0..index + l (causal
// among the new tokens; the mask on top): out (D).
void attend(const Job& j, const float* q, int b, int l, int h, float* out) {
  const auto& s = j.s;
  const int D = s.head_dim;
  const int kh = h / (s.q_heads / s.kv_heads);
  const size_t base = (static_cast<size_t>(b) * s.kv_heads + kh) * j.capacity * D;
  QueryMask mask;
  if (j.mask != nullptr) {
    const int64_t at = b * j.mask_b + h * j.mask_h + l * j.mask_l;
    mask.is_bool = j.bool_mask;
    mask.base = j.bool_mask ? static_cast<const void*>(static_cast<const bool*>(j.mask) + at)
                            : static_cast<const void*>(static_cast<const float*>(j.mask) + at);
    mask.step = j.mask_s;
  }
  if (j.quant.bits > 0) {
    attend_query_quantized(quantized_head(j, b, kh), q, j.index + l + 1, s.attn_scale, mask, out);
    return;
  }
  const HeadKeysValues head{j.keys + base, j.values + base, D, D, D};
  attend_query(head, q, j.seen > 0 ? j.seen : j.index + l + 1, s.attn_scale, mask, out);
}

// Over the kernels' pool by for_each_query_run (attention.cpp); the queries of a pair
// are its new tokens x the query heads of the kv head's group.
void attention(const Job& j, const float* q, float* out) {
  const int Hq = j.s.q_heads, Hk = j.s.kv_heads, group = Hq / Hk, D = j.s.head_dim;
  const int64_t work =
      static_cast<int64_t>(j.B) * j.L * Hq * (j.seen > 0 ? j.seen : j.index + j.L) * D;
  for_each_query_run(j.B, Hk, j.L * group, work, [&](int b, int kh, int first, int last) {
    for (int i = first; i < last; ++i) {
      const int l = i / group, h = kh * group + i % group;
      const size_t at = ((static_cast<size_t>(b) * j.L + l) * Hq + h) * D;
      attend(j, q + at, b, l, h, out + at);
    }
  });
}

void run(const Job& j) {
  const auto& s = j.s;
  const int B = j.B * j.L, H = j.hidden, D = s.head_dim;  // B: rows of every matmul
  const int qkv_width = j.proj[QKV].N, heads_width = s.q_heads * D;
  const int inter = j.proj[DOWN].parts[0].K;
  thread_local std::vector<float> scratch;
  scratch.resize(static_cast<size_t>(B) * (5 * H + qkv_width + 2 * heads_width + 3 * inter));
  float* x = scratch.data();
  float* normed = x + B * H;
  float* h = normed + B * H;
  float* delta = h + B * H;
  float* qkv = delta + B * H;
  float* q = qkv + B * qkv_width;
  float* attended = q + B * heads_width;
  float* gate_up = attended + B * heads_width;
  float* act = gate_up + 2 * B * inter;
  for (int b = 0; b < B; ++b) {
    const float* row = j.x + j.x_rows[b];
    for (int i = 0; i < H; ++i) x[b * H + i] = row[i * j.x_step];
  }
  rms_norm_rows(x, j.input_norm, s.norm_eps, B, H, normed);
  project(j.proj[QKV], normed, B, qkv);
  heads(j, qkv, q);
  attention(j, q, attended);
  project(j.proj[O], attended, B, delta);
  if (j.attn_out_norm) rms_norm_rows(delta, j.attn_out_norm, s.norm_eps, B, H, delta);
  for (int i = 0; i < B * H; ++i) h[i] = x[i] + delta[i];
  rms_norm_rows(h, j.post_norm, s.norm_eps, B, H, normed);
  project(j.proj[GATE_UP], normed, B, gate_up);
  thread_local std::vector<int64_t> gate_rows;
  gate_rows.resize(B);
  for (int b = 0; b < B; ++b) gate_rows[b] = static_cast<int64_t>(b) * 2 * inter;
  swiglu_rows(gate_up, gate_rows, 1, inter, act, s.gelu);
  project(j.proj[DOWN], act, B, delta);
  if (j.mlp_out_norm) rms_norm_rows(delta, j.mlp_out_norm, s.norm_eps, B, H, delta);
  for (int i = 0; i < B * H; ++i) j.out[i] = h[i] + delta[i];
}

// The cache buffer the op writes: the input's own where it may be donated, else a
// fresh buffer (filled by the job from `source`, any strides). 4-byte elements (float32
// values, or a quantized cache's uint32 words, scales and biases), copied as bits.
struct CacheCopy {
  const uint32_t* source = nullptr;  // null: donated, nothing to copy
  uint32_t* dest = nullptr;
  std::vector<int64_t> rows;
  int64_t step = 1;
  int width = 0;

  void run() const {
    if (source == nullptr) return;
    for (size_t r = 0; r < rows.size(); ++r) {
      const uint32_t* in = source + rows[r];
      uint32_t* o = dest + r * width;
      for (int i = 0; i < width; ++i) o[i] = in[i * step];
    }
  }
};

CacheCopy take_cache(const mx::array& in, mx::array& out) {
  if (in.flags().row_contiguous && in.is_donatable()) {
    out.copy_shared_buffer(in);
    return {};
  }
  out.set_data(mx::allocator::malloc(out.nbytes()));
  count_cache_copy(static_cast<int64_t>(out.nbytes()));
  return {in.data<uint32_t>(), out.data<uint32_t>(), row_offsets(in), in.strides().back(),
          in.shape(-1)};
}

class DecodeLayer : public mx::Primitive {
 public:
  DecodeLayer(mx::Stream stream, const std::vector<std::vector<Projection>>& stages,
              std::array<bool, 4> norms, LayerShape shape, int index, int seen,
              int group_size = 0, int bits = 0)
      : mx::Primitive(stream), norms_(norms), shape_(shape), index_(index), seen_(seen),
        group_size_(group_size), bits_(bits) {
    for (const auto& stage : stages) {
      kinds_.emplace_back();
      for (const auto& p : stage) kinds_.back().push_back({p.group_size, p.bits, p.bias.has_value()});
    }
  }

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs)
      override {
    auto& encoder = mx::cpu::get_command_encoder(stream());
    for (const auto& a : inputs) encoder.set_input_array(a);
    outputs[0].set_data(mx::allocator::malloc(outputs[0].nbytes()));
    const std::vector<int> caches = cache_inputs(inputs.size());
    release_sibling_inputs(inputs, outputs, caches);
    std::vector<CacheCopy> copies;
    for (size_t c = 0; c < caches.size(); ++c) {
      copies.push_back(take_cache(inputs[caches[c]], outputs[1 + c]));
    }
    for (auto& out : outputs) encoder.set_output_array(out);
    Job job = describe(inputs, outputs);
    encoder.dispatch([job = std::move(job), copies = std::move(copies)]() {
      for (const auto& copy : copies) copy.run();
      run(job);
    });
  }

  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error("decoder_layer runs on the CPU only");
  }
  const char* name() const override {
    return "PipeserveDecodeLayer";
  }
  bool is_equivalent(const mx::Primitive&) const override {
    return false;  // writes the cache: never merged with another
  }

 private:
  // Each output of a multi-output op holds its own copy of the inputs (make_arrays), so
  // the cache buffers would never look donatable (is_donatable: one holder). The other
  // outputs' copies are dropped here: MLX clears every sibling's inputs once the op is
  // evaluated anyway (array::detach). Not for tracers (compile, transforms).
  static void release_sibling_inputs(const std::vector<mx::array>& inputs,
                                     std::vector<mx::array>& outputs,
                                     const std::vector<int>& caches) {
    for (auto& out : outputs) {
      if (out.is_tracer()) return;
    }
    for (auto& out : outputs) {
      auto& held = out.inputs();
      if (&held == &inputs || held.size() != inputs.size()) continue;
      for (int c : caches) held[c] = inputs[X];
    }
  }

  // The inputs holding the cache, in the order of outputs 1..: keys and values (a
  // quantized cache: their words), then a quantized cache's scales and biases (the last
  // four inputs: keys' scales, biases, values' scales, biases).
  std::vector<int> cache_inputs(size_t n_inputs) const {
    std::vector<int> caches = {KEYS, VALUES};
    if (bits_ > 0) {
      for (int i = 4; i >= 1; --i) caches.push_back(static_cast<int>(n_inputs) - i);
    }
    return caches;
  }

  struct Kind {
    int group_size, bits;
    bool bias;
  };

  Job describe(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) const {
    const auto& x = inputs[X];
    Job j{};
    j.s = shape_;
    j.B = x.shape(0);
    j.L = x.shape(1);
    j.hidden = x.shape(-1);
    j.index = index_;
    j.seen = seen_;
    j.capacity = inputs[KEYS].shape(2);
    j.x = x.data<float>();
    j.x_rows = row_offsets(x);
    j.x_step = x.strides().back();
    const auto& positions = inputs[POSITIONS];
    j.positions = positions.size() > 0 ? positions.data<int32_t>() : nullptr;
    j.n_positions = static_cast<int>(positions.size());
    const auto& mask = inputs[MASK];
    if (mask.size() > 0) {
      j.mask = mask.data<void>();
      j.bool_mask = mask.dtype() == mx::bool_;
      auto stride = [&](int axis) { return mask.shape(axis) == 1 ? 0 : mask.strides()[axis]; };
      j.mask_b = stride(0), j.mask_h = stride(1), j.mask_l = stride(2), j.mask_s = stride(3);
    }
    int at = WEIGHTS;
    j.input_norm = inputs[at++].data<float>();
    j.post_norm = inputs[at++].data<float>();
    const float* optional[4];
    for (int n = 0; n < 4; ++n) optional[n] = norms_[n] ? inputs[at++].data<float>() : nullptr;
    j.q_norm = optional[0], j.k_norm = optional[1];
    j.attn_out_norm = optional[2], j.mlp_out_norm = optional[3];
    for (int p = 0; p < 4; ++p) {
      for (const Kind& kind : kinds_[p]) {
        const auto& w = inputs[at];
        const auto& scales = inputs[at + 1];
        const auto& biases = inputs[at + 2];
        ProjectionView v{w.data<void>(), scales.data<void>(),
                         biases.size() > 0 ? biases.data<void>() : nullptr,
                         nullptr, w.shape(0), w.shape(1) * 32 / kind.bits, kind.group_size,
                         kind.bits, scales.dtype() == mx::float16};
        at += 3;
        if (kind.bias) v.bias = inputs[at++].data<float>();
        j.proj[p].parts.push_back(v);
        j.proj[p].N += v.N;
      }
    }
    j.out = outputs[0].data<float>();
    if (bits_ == 0) {
      j.keys = outputs[1].data<float>();
      j.values = outputs[2].data<float>();
      return j;
    }
    j.quant = {outputs[1].data<uint32_t>(), outputs[2].data<uint32_t>(), outputs[3].data<float>(),
               outputs[4].data<float>(), outputs[5].data<float>(), outputs[6].data<float>(),
               group_size_, bits_};
    return j;
  }

  std::array<bool, 4> norms_;  // q_norm, k_norm, attn_out_norm, mlp_out_norm present
  LayerShape shape_;
  int index_, seen_;
  int group_size_, bits_;  // a quantized cache's; bits 0: float32
  std::vector<std::vector<Kind>> kinds_;  // per stage, per part
};

void check_vector(const mx::array& a, int n, const char* what) {
  if (a.dtype() != mx::float32 || a.ndim() != 1 || a.shape(0) != n) {
    fail(std::string(what) + " must be float32 (" + std::to_string(n) + ",)");
  }
}

void check_projection(const Projection& p, int n, int k, const char* what);

// A stage's parts: together n outputs of k inputs (o and down: one part; a part's n
// within [1, n]).
void check_stage(const std::vector<Projection>& parts, int n, int k, size_t most,
                 const char* what) {
  if (parts.empty() || parts.size() > most) fail(std::string(what) + ": bad number of parts");
  int total = 0;
  for (const auto& p : parts) {
    const int rows = p.w.ndim() == 2 ? p.w.shape(0) : 0;
    check_projection(p, rows, k, what);
    total += rows;
  }
  if (total != n) fail(std::string(what) + ": the parts' outputs must add up to " +
                       std::to_string(n));
}

void check_projection(const Projection& p, int n, int k, const char* what) {
  const bool ok = (p.bits == 4 || p.bits == 5 || p.bits == 8) && p.group_size % 32 == 0 &&
      p.w.dtype() == mx::uint32 && p.w.ndim() == 2 && p.w.shape(0) == n &&
      static_cast<int64_t>(p.w.shape(1)) * 32 == static_cast<int64_t>(k) * p.bits &&
      k % p.group_size == 0 && p.scales.shape() == mx::Shape({n, k / p.group_size}) &&
      (p.biases.size() == 0 ||  // symmetric
       (p.biases.shape() == p.scales.shape() && p.scales.dtype() == p.biases.dtype())) &&
      (p.scales.dtype() == mx::float16 || p.scales.dtype() == mx::float32);
  if (!ok) fail(std::string(what) + ": not an affine quantized (" + std::to_string(n) + ", " +
                std::to_string(k) + ") projection");
  if (p.bias) check_vector(*p.bias, n, what);
}

}  // namespace

DecoderLayer::DecoderLayer(
    std::vector<std::vector<Projection>> stages,
    mx::array input_norm,
    mx::array post_norm,
    std::optional<mx::array> q_norm,
    std::optional<mx::array> k_norm,
    std::optional<mx::array> attn_out_norm,
    std::optional<mx::array> mlp_out_norm,
    LayerShape shape)
    : none_(mx::zeros({0}, mx::int32, mx::Device::cpu)),
      q_norm_(q_norm.has_value()),
      k_norm_(k_norm.has_value()),
      attn_out_norm_(attn_out_norm.has_value()),
      mlp_out_norm_(mlp_out_norm.has_value()),
      shape_(shape) {
  const auto& s = shape;
  if (stages.size() != 4) fail("four stages: qkv, o, gate_up, down");
  if (s.q_heads <= 0 || s.kv_heads <= 0 || s.q_heads % s.kv_heads != 0 || s.head_dim <= 0 ||
      s.rope_dims % 2 != 0 || s.rope_dims > s.head_dim) {
    fail("bad head shape");
  }
  const int hidden = input_norm.ndim() == 1 ? input_norm.shape(0) : 0;
  if (stages[DOWN].size() != 1 || stages[DOWN][0].w.ndim() != 2) fail("down: one projection");
  const auto& down = stages[DOWN][0];
  const int inter = down.w.shape(1) * 32 / std::max(1, down.bits);
  check_vector(input_norm, hidden, "input_norm");
  check_vector(post_norm, hidden, "post_norm");
  if (q_norm) check_vector(*q_norm, s.head_dim, "q_norm");
  if (k_norm) check_vector(*k_norm, s.head_dim, "k_norm");
  if (attn_out_norm) check_vector(*attn_out_norm, hidden, "attn_out_norm");
  if (mlp_out_norm) check_vector(*mlp_out_norm, hidden, "mlp_out_norm");
  check_stage(stages[QKV], (s.q_heads + 2 * s.kv_heads) * s.head_dim, hidden, 3, "qkv");
  check_stage(stages[O], hidden, s.q_heads * s.head_dim, 1, "o");
  check_stage(stages[GATE_UP], 2 * inter, hidden, 2, "gate_up");
  check_stage(stages[DOWN], hidden, inter, 1, "down");
  std::vector<mx::array> weights = {input_norm, post_norm};
  for (const auto* norm : {&q_norm, &k_norm, &attn_out_norm, &mlp_out_norm}) {
    if (*norm) weights.push_back(**norm);
  }
  for (const auto& stage : stages) {
    for (const auto& p : stage) {
      weights.insert(weights.end(), {p.w, p.scales, p.biases});
      if (p.bias) weights.push_back(*p.bias);
    }
  }
  mx::eval(weights);
  for (auto& w : weights) {  // a row-contiguous view (an offset into a larger buffer) is kept
    if (!w.flags().row_contiguous) w = mx::contiguous(w, false, mx::Device::cpu);
  }
  mx::eval(weights);
  mx::eval(none_);
  weights_ = std::move(weights);
  stages_ = std::move(stages);
}

void DecoderLayer::check_x(const mx::array& x, mx::StreamOrDevice s) const {
  if (mx::to_stream(s).device != mx::Device::cpu) fail("runs on the CPU only");
  const int hidden = weights_[0].shape(0);
  if (x.dtype() != mx::float32 || x.ndim() != 3 || x.shape(1) < 1 ||
      x.shape(1) > DECODER_LAYER_MAX_PROMPT_TOKENS || x.shape(2) != hidden) {
    fail("x must be float32 (B, L, hidden), L = 1.." +
         std::to_string(DECODER_LAYER_MAX_PROMPT_TOKENS));
  }
}

std::tuple<mx::array, mx::array, mx::array> DecoderLayer::operator()(
    const mx::array& x,
    const mx::array& keys,
    const mx::array& values,
    int index,
    const std::optional<mx::array>& positions,
    const std::optional<mx::array>& mask,
    int seen,
    mx::StreamOrDevice s) const {
  check_x(x, s);
  const int B = x.shape(0);
  const mx::Shape cache_shape = {B, shape_.kv_heads, keys.ndim() == 4 ? keys.shape(2) : 0,
                                 shape_.head_dim};
  for (const auto* a : {&keys, &values}) {
    if (a->dtype() != mx::float32 || a->shape() != cache_shape) {
      fail("keys and values must be float32 (B, kv_heads, capacity, head_dim)");
    }
  }
  auto outs = step(x, {keys, values}, index, positions, mask, seen, 0, 0, s);
  return {outs[0], outs[1], outs[2]};
}

std::tuple<mx::array, QuantizedParts, QuantizedParts> DecoderLayer::quantized_step(
    const mx::array& x,
    const QuantizedParts& keys,
    const QuantizedParts& values,
    int group_size,
    int bits,
    int index,
    const std::optional<mx::array>& positions,
    const std::optional<mx::array>& mask,
    mx::StreamOrDevice s) const {
  check_x(x, s);
  const int B = x.shape(0), D = shape_.head_dim;
  if (!quantized_shape_ok(D, group_size, bits)) {
    fail("a quantized cache: bits 4 or 8, group_size 32, 64 or 128 dividing the head size");
  }
  const auto& words = std::get<0>(keys);
  const int capacity = words.ndim() == 4 ? words.shape(2) : 0;
  const mx::Shape words_shape = {B, shape_.kv_heads, capacity, D * bits / 32};
  const mx::Shape groups_shape = {B, shape_.kv_heads, capacity, D / group_size};
  for (const auto* parts : {&keys, &values}) {
    const auto& [w, scales, biases] = *parts;
    if (w.dtype() != mx::uint32 || w.shape() != words_shape || scales.dtype() != mx::float32 ||
        scales.shape() != groups_shape || biases.dtype() != mx::float32 ||
        biases.shape() != groups_shape) {
      fail("quantized keys and values: uint32 words (B, kv_heads, capacity, head_dim * bits"
           " / 32), float32 scales and biases (B, kv_heads, capacity, head_dim / group_size)");
    }
  }
  const std::vector<mx::array> caches = {
      std::get<0>(keys), std::get<0>(values), std::get<1>(keys),
      std::get<2>(keys), std::get<1>(values), std::get<2>(values)};
  auto outs = step(x, caches, index, positions, mask, -1, group_size, bits, s);
  return {outs[0], {outs[1], outs[3], outs[4]}, {outs[2], outs[5], outs[6]}};
}

// The op over caches (keys, values[, keys' scales, biases, values' scales, biases]) of
// capacity caches[0].shape(2): its outputs (out, then the caches written).
std::vector<mx::array> DecoderLayer::step(
    const mx::array& x,
    const std::vector<mx::array>& caches,
    int index,
    const std::optional<mx::array>& positions,
    const std::optional<mx::array>& mask,
    int seen,
    int group_size,
    int bits,
    mx::StreamOrDevice s) const {
  auto stream = mx::to_stream(s);
  const int B = x.shape(0), L = x.shape(1), capacity = caches[0].shape(2);
  if (index < 0 || index + L > capacity) {
    fail("index..index + L - 1 must be within the cache's capacity");
  }
  if (seen >= 0 && (L != 1 || seen <= index || seen > capacity)) {
    fail("seen: one token, written at index < seen <= capacity");
  }
  const int keys_seen = seen >= 0 ? seen : index + L;
  // empty (evaluated, so no op) where there are no per-row positions / no mask
  std::vector<mx::array> inputs = {x, caches[0], caches[1], none_, none_};
  if (positions) {
    if (positions->size() != 1 && positions->size() != static_cast<size_t>(B)) {
      fail("positions must hold 1 or B values");
    }
    inputs[POSITIONS] = positions->dtype() == mx::int32 && positions->ndim() == 1
        ? *positions
        : mx::reshape(mx::astype(*positions, mx::int32, stream), {-1}, stream);
  }
  if (mask) {
    const bool fits = mask->ndim() == 4 && mask->shape(2) == L && mask->shape(3) == keys_seen &&
        (mask->shape(0) == 1 || mask->shape(0) == B) &&
        (mask->shape(1) == 1 || mask->shape(1) == shape_.q_heads);
    if (!fits) fail("mask must broadcast to (B, q_heads, L, index + L) (seen: (B, q_heads, 1, seen))");
    if (mask->dtype() != mx::bool_ && mask->dtype() != mx::float32) fail("mask: bool or float32");
    inputs[MASK] = *mask;
  }
  inputs.insert(inputs.end(), weights_.begin(), weights_.end());
  inputs.insert(inputs.end(), caches.begin() + 2, caches.end());
  std::vector<mx::Shape> shapes = {x.shape()};
  std::vector<mx::Dtype> dtypes = {mx::float32};
  for (const auto& c : caches) {
    shapes.push_back(c.shape());
    dtypes.push_back(c.dtype());
  }
  return mx::array::make_arrays(
      std::move(shapes), dtypes,
      std::make_shared<DecodeLayer>(
          stream, stages_,
          std::array<bool, 4>{q_norm_, k_norm_, attn_out_norm_, mlp_out_norm_}, shape_, index,
          seen, group_size, bits),
      inputs);
}

}  // namespace pipeserve
