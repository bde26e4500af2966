// A BERT-style encoder (BERT, MiniLM, bge, e5; XLM-R's position offset) as ONE MLX op
// over packed sequences: the token ids of a batch laid end to end (no padding), their
// starts, and every layer's weights in; the last layer's token vectors out (T, H).
//
// Why: through MLX a batch of short inputs is padded to its longest, runs ~15 ops per
// layer (each a dispatch and, on the CPU, single-threaded elementwise work: GELU,
// LayerNorm, the attention's softmax) and the matmuls through the BLAS. Here the whole
// stack runs on the kernels' pool: the sequences are split into chunks of about equal
// token counts, each chunk runs all the layers on one thread (no barrier between ops),
// with a compute-bound float32 GEMM (MR x 32 register tiles of fused multiply-adds
// over weights packed once into 32-column panels), per-sequence attention (no padding
// anywhere, so no mask) and the bias, GELU, residual and LayerNorm on rows still in
// cache. A batch too small to split (fewer than 2 x MIN_CHUNK tokens per thread) runs on
// the calling thread with each GEMM's panels and the attention's heads split over the pool.
//
// Everything is float32; BERT's exact GELU takes erf as Eigen's rational function
// (|error| < 2e-6, the MLX path's bert.py computes the same).

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "mlx/backend/cpu/encoder.h"
#include "mlx/ops.h"
#include "mlx/primitives.h"

#include "kernels.h"
#include "vector_math.h"

namespace pipeserve {

namespace {

constexpr int PANEL = 32;         // columns per packed weight panel
constexpr int MIN_CHUNK = 96;     // tokens: fewer per thread and the GEMMs go column-parallel
constexpr int TENSORS_PER_LAYER = 12;
constexpr int GLOBAL_TENSORS = 5;  // word, position, type embeddings, their LayerNorm w, b

void fail(const std::string& message) {
  throw std::invalid_argument("bert_encode: " + message);
}

// One linear layer: w packed as (N / PANEL, K, PANEL) (column n of panel p: w[p*32 + n]),
// bias (N).
struct Linear {
  const float* w;
  const float* bias;
  int N, K;
};

struct LayerWeights {
  Linear qkv, out, up, down;
  const float *norm1_w, *norm1_b, *norm2_w, *norm2_b;
};

struct Model {
  const float *word, *position, *type, *norm_w, *norm_b;
  int vocab, positions, types;
  std::vector<LayerWeights> layers;
  int hidden, heads, inter, offset;
  float eps;
};

// ---------------------------------------------------------------------------
// GEMM: c (M, N) = a (M, K) @ packed w + bias, panels [p0, p1).

#if defined(__AVX512F__)
constexpr int MR = 12;  // rows per register tile: 24 accumulators + 2 weight vectors

template <int R>
inline void tile(const float* a, int64_t lda, const Linear& w, int p, float* c, int64_t ldc) {
  __m512 lo[R], hi[R];
  for (int r = 0; r < R; ++r) lo[r] = hi[r] = _mm512_setzero_ps();
  const float* b = w.w + static_cast<int64_t>(p) * w.K * PANEL;
  for (int k = 0; k < w.K; ++k) {
    const __m512 b0 = _mm512_loadu_ps(b + k * PANEL);
    const __m512 b1 = _mm512_loadu_ps(b + k * PANEL + 16);
    for (int r = 0; r < R; ++r) {
      const __m512 x = _mm512_set1_ps(a[r * lda + k]);
      lo[r] = _mm512_fmadd_ps(x, b0, lo[r]);
      hi[r] = _mm512_fmadd_ps(x, b1, hi[r]);
    }
  }
  const __m512 bias0 = _mm512_loadu_ps(w.bias + p * PANEL);
  const __m512 bias1 = _mm512_loadu_ps(w.bias + p * PANEL + 16);
  for (int r = 0; r < R; ++r) {
    _mm512_storeu_ps(c + r * ldc + p * PANEL, _mm512_add_ps(lo[r], bias0));
    _mm512_storeu_ps(c + r * ldc + p * PANEL + 16, _mm512_add_ps(hi[r], bias1));
  }
}

#else
constexpr int MR = 4;

// Scalar fallback with the same result layout (any instruction set).
template <int R>
void tile(const float* a, int64_t lda, const Linear& w, int p, float* c, int64_t ldc) {
  const float* b = w.w + static_cast<int64_t>(p) * w.K * PANEL;
  for (int r = 0; r < R; ++r) {
    float acc[PANEL] = {};
    for (int k = 0; k < w.K; ++k) {
      const float x = a[r * lda + k];
      for (int n = 0; n < PANEL; ++n) acc[n] = std::fma(x, b[k * PANEL + n], acc[n]);
    }
    for (int n = 0; n < PANEL; ++n) c[r * ldc + p * PANEL + n] = acc[n] + w.bias[p * PANEL + n];
  }
}

#endif

// A tile of fewer than MR rows (the last rows of a matrix).
template <int R>
void tail_tile(const float* a, int64_t lda, const Linear& w, int p, float* c, int64_t ldc,
               int rows) {
  if constexpr (R > 0) {
    if (rows == R) return tile<R>(a, lda, w, p, c, ldc);
    tail_tile<R - 1>(a, lda, w, p, c, ldc, rows);
  }
}

// erf(x) on [-4, 4] as x * P(x^2) / Q(x^2) (Eigen's float erf), clamped outside.
inline float gelu(float v) {
  const float x = std::clamp(v * 0.7071067811865476f, -4.0f, 4.0f);
  const float x2 = x * x;
  float p = x2 * -2.72614225801306e-10f + 2.77068142495902e-08f;
  p = x2 * p + -2.10102402082508e-06f;
  p = x2 * p + -5.69250639462346e-05f;
  p = x2 * p + -7.34990630326855e-04f;
  p = x2 * p + -2.95459980854025e-03f;
  p = x2 * p + -1.60960333262415e-02f;
  float q = x2 * -1.45660718464996e-05f + -2.13374055278905e-04f;
  q = x2 * q + -1.68282697438203e-03f;
  q = x2 * q + -7.37332916720468e-03f;
  q = x2 * q + -1.42647390514189e-02f;
  return 0.5f * v * (1.0f + x * p / q);
}

// Panels [p0, p1) of every row; GELU on the outputs where asked (while still in cache).
void gemm(const float* a, int M, const Linear& w, float* c, int p0, int p1, bool act) {
  for (int p = p0; p < p1; ++p) {
    int m = 0;
    for (; m + MR <= M; m += MR) tile<MR>(a + m * w.K, w.K, w, p, c + m * w.N, w.N);
    if (m < M) tail_tile<MR - 1>(a + m * w.K, w.K, w, p, c + m * w.N, w.N, M - m);
    if (!act) continue;
    for (int r = 0; r < M; ++r) {
      float* row = c + static_cast<int64_t>(r) * w.N + p * PANEL;
      for (int n = 0; n < PANEL; ++n) row[n] = gelu(row[n]);
    }
  }
}

// Panel-major chunks for the pool: each job a run of panels over every row.
void gemm_parallel(const float* a, int M, const Linear& w, float* c, bool act, bool pool) {
  const int panels = w.N / PANEL;
  if (!pool) return gemm(a, M, w, c, 0, panels, act);
  parallel_for(panels, [&](int p) { gemm(a, M, w, c, p, p + 1, act); });
}

// ---------------------------------------------------------------------------
// Row ops.

// x = LayerNorm(x + residual) (residual may be null), rows of `width`.
void add_norm(float* x, const float* residual, int rows, int width, const float* w,
              const float* b, float eps) {
  for (int r = 0; r < rows; ++r) {
    float* row = x + static_cast<int64_t>(r) * width;
    if (residual != nullptr) {
      const float* res = residual + static_cast<int64_t>(r) * width;
      for (int i = 0; i < width; ++i) row[i] += res[i];
    }
    double sum = 0.0;
    for (int i = 0; i < width; ++i) sum += row[i];
    const float mean = static_cast<float>(sum / width);
    double square = 0.0;
    for (int i = 0; i < width; ++i) square += (row[i] - mean) * (row[i] - mean);
    const float inv = 1.0f / std::sqrt(static_cast<float>(square / width) + eps);
    for (int i = 0; i < width; ++i) row[i] = (row[i] - mean) * inv * w[i] + b[i];
  }
}

// Token vectors of rows [first, last) of the packed batch: embeddings + LayerNorm.
void embed(const Model& m, const int* ids, const int* types, const int* starts, int seq0,
           int seq1, float* out) {
  for (int s = seq0; s < seq1; ++s) {
    for (int t = starts[s]; t < starts[s + 1]; ++t) {
      const int id = ids[t], type = types[t], pos = t - starts[s] + m.offset;
      // bert_encode's caller checked these (an error here could not reach Python); clamped so
      // that nothing is read outside the tables whatever it passed.
      const int id_at = std::clamp(id, 0, m.vocab - 1), type_at = std::clamp(type, 0, m.types - 1);
      const int pos_at = std::min(pos, m.positions - 1);
      float* row = out + static_cast<int64_t>(t) * m.hidden;
      const float* word = m.word + static_cast<int64_t>(id_at) * m.hidden;
      const float* position = m.position + static_cast<int64_t>(pos_at) * m.hidden;
      const float* kind = m.type + static_cast<int64_t>(type_at) * m.hidden;
      for (int i = 0; i < m.hidden; ++i) row[i] = word[i] + position[i] + kind[i];
    }
  }
  const int rows = starts[seq1] - starts[seq0];
  add_norm(out + static_cast<int64_t>(starts[seq0]) * m.hidden, nullptr, rows, m.hidden,
           m.norm_w, m.norm_b, m.eps);
}

// One head of one sequence: ctx (L, D) of its rows = softmax(q k^T * scale) v, reading
// q, k, v from the packed qkv rows (3H wide: q, then k, then v).
void attend_head(const float* qkv, int length, int hidden, int dim, int head, float scale,
                 float* ctx, std::vector<float>& scores) {
  const int64_t ld = 3 * static_cast<int64_t>(hidden);
  scores.resize(static_cast<size_t>(length));
  for (int i = 0; i < length; ++i) {
    const float* q = qkv + i * ld + head * dim;
    float top = -INFINITY;
    for (int j = 0; j < length; ++j) {
      const float* k = qkv + j * ld + hidden + head * dim;
      float dot = 0.0f;
#if defined(__AVX512F__)
      if (dim % 16 == 0) {
        __m512 acc = _mm512_setzero_ps();
        for (int d = 0; d < dim; d += 16) {
          acc = _mm512_fmadd_ps(_mm512_loadu_ps(q + d), _mm512_loadu_ps(k + d), acc);
        }
        dot = _mm512_reduce_add_ps(acc);
      } else
#endif
      {
        for (int d = 0; d < dim; ++d) dot = std::fma(q[d], k[d], dot);
      }
      scores[j] = dot * scale;
      top = std::max(top, scores[j]);
    }
    float total = 0.0f;
    for (int j = 0; j < length; ++j) {
      scores[j] = fast_exp(scores[j] - top);
      total += scores[j];
    }
    const float inv = 1.0f / total;
    float* out = ctx + static_cast<int64_t>(i) * hidden + head * dim;
    for (int d = 0; d < dim; ++d) out[d] = 0.0f;
    for (int j = 0; j < length; ++j) {
      const float* v = qkv + j * ld + 2 * hidden + head * dim;
      const float p = scores[j] * inv;
      for (int d = 0; d < dim; ++d) out[d] = std::fma(p, v[d], out[d]);
    }
  }
}

// ---------------------------------------------------------------------------
// The stack over sequences [seq0, seq1) whose token vectors are rows starts[seq0]..
// of `hidden` (embedded already; updated in place). pool: each op split over the pool
// (a chunk too small to split by sequences), else all on the calling thread.

struct Scratch {
  std::vector<float> qkv, ctx, mid, attn, scores;
};

void encode_layers(const Model& m, const int* starts, int seq0, int seq1, float* hidden,
                   bool pool) {
  thread_local Scratch scratch;
  Scratch& s = scratch;  // the calling thread's, also inside pool jobs (a reference is captured)
  const int base = starts[seq0], rows = starts[seq1] - base;
  const int H = m.hidden, dim = H / m.heads;
  const float scale = 1.0f / std::sqrt(static_cast<float>(dim));
  s.qkv.resize(static_cast<size_t>(rows) * 3 * H);
  s.ctx.resize(static_cast<size_t>(rows) * H);
  s.mid.resize(static_cast<size_t>(rows) * m.inter);
  float* h = hidden + static_cast<int64_t>(base) * H;
  for (const LayerWeights& layer : m.layers) {
    gemm_parallel(h, rows, layer.qkv, s.qkv.data(), false, pool);
    auto head_job = [&](int job, std::vector<float>& scores) {
      const int seq = seq0 + job / m.heads, head = job % m.heads;
      const int64_t row = starts[seq] - base;
      attend_head(s.qkv.data() + row * 3 * H, starts[seq + 1] - starts[seq], H, dim, head,
                  scale, s.ctx.data() + row * H, scores);
    };
    const int jobs = (seq1 - seq0) * m.heads;
    if (pool) {
      parallel_for(jobs, [&](int job) {
        thread_local std::vector<float> scores;
        head_job(job, scores);
      });
    } else {
      for (int job = 0; job < jobs; ++job) head_job(job, s.scores);
    }
    // h1 = LayerNorm(ctx @ Wo + bo + h), kept in ctx's place (attention output).
    s.attn.resize(static_cast<size_t>(rows) * H);
    gemm_parallel(s.ctx.data(), rows, layer.out, s.attn.data(), false, pool);
    add_norm(s.attn.data(), h, rows, H, layer.norm1_w, layer.norm1_b, m.eps);
    gemm_parallel(s.attn.data(), rows, layer.up, s.mid.data(), true, pool);
    gemm_parallel(s.mid.data(), rows, layer.down, h, false, pool);
    add_norm(h, s.attn.data(), rows, H, layer.norm2_w, layer.norm2_b, m.eps);
  }
}

// Sequences grouped into chunks of about `target` tokens (whole sequences each).
std::vector<int> chunk_bounds(const int* starts, int sequences, int target) {
  std::vector<int> bounds = {0};
  for (int s = 1; s <= sequences; ++s) {
    if (starts[s] - starts[bounds.back()] >= target || s == sequences) bounds.push_back(s);
  }
  return bounds;
}

void run(const Model& m, const int* ids, const int* types, const int* starts, int sequences,
         float* out) {
  const int tokens = starts[sequences];
  const int threads = pipeserve::threads();
  if (threads <= 1 || tokens < 2 * MIN_CHUNK * threads || sequences < 2) {
    embed(m, ids, types, starts, 0, sequences, out);
    encode_layers(m, starts, 0, sequences, out, threads > 1);
    return;
  }
  // About two chunks per thread: a thread the OS holds back leaves work to the others.
  const int target = std::max(MIN_CHUNK, (tokens + 2 * threads - 1) / (2 * threads));
  const std::vector<int> bounds = chunk_bounds(starts, sequences, target);
  parallel_for(static_cast<int>(bounds.size()) - 1, [&](int c) {
    embed(m, ids, types, starts, bounds[c], bounds[c + 1], out);
    encode_layers(m, starts, bounds[c], bounds[c + 1], out, false);
  });
}

struct Shape {
  int hidden, heads, inter, offset, layers;
  float eps;
};

Model view(const std::vector<mx::array>& in, const Shape& shape) {
  // in: ids, types, starts, then GLOBAL_TENSORS, then TENSORS_PER_LAYER per layer.
  Model m{};
  m.word = in[3].data<float>();
  m.position = in[4].data<float>();
  m.type = in[5].data<float>();
  m.norm_w = in[6].data<float>();
  m.norm_b = in[7].data<float>();
  m.vocab = in[3].shape(0);
  m.positions = in[4].shape(0);
  m.types = in[5].shape(0);
  m.hidden = shape.hidden;
  m.heads = shape.heads;
  m.inter = shape.inter;
  m.offset = shape.offset;
  m.eps = shape.eps;
  const int H = shape.hidden, I = shape.inter;
  for (int l = 0; l < shape.layers; ++l) {
    const mx::array* t = &in[3 + GLOBAL_TENSORS + l * TENSORS_PER_LAYER];
    auto lin = [&](int i, int N, int K) {
      return Linear{t[i].data<float>(), t[i + 1].data<float>(), N, K};
    };
    m.layers.push_back({lin(0, 3 * H, H), lin(2, H, H), lin(6, I, H), lin(8, H, I),
                        t[4].data<float>(), t[5].data<float>(), t[10].data<float>(),
                        t[11].data<float>()});
  }
  return m;
}

class BertEncode : public mx::Primitive {
 public:
  BertEncode(mx::Stream stream, Shape shape) : mx::Primitive(stream), shape_(shape) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs)
      override {
    auto& out = outputs[0];
    for (const auto& a : inputs) {
      if (!a.flags().row_contiguous) fail("inputs not contiguous");
    }
    out.set_data(mx::allocator::malloc(out.nbytes()));
    auto& encoder = mx::cpu::get_command_encoder(stream());
    for (const auto& a : inputs) encoder.set_input_array(a);
    encoder.set_output_array(out);
    Model m = view(inputs, shape_);
    const int* ids = inputs[0].data<int>();
    const int* types = inputs[1].data<int>();
    const int* starts = inputs[2].data<int>();
    const int sequences = inputs[2].shape(0) - 1;
    float* o = out.data<float>();
    encoder.dispatch([m = std::move(m), ids, types, starts, sequences, o]() {
      run(m, ids, types, starts, sequences, o);
    });
  }
  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error("bert_encode runs on the CPU only");
  }
  const char* name() const override {
    return "PipeserveBertEncode";
  }
  bool is_equivalent(const mx::Primitive&) const override {
    return false;
  }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    return {{inputs[0].shape(0), shape_.hidden}};
  }

 private:
  Shape shape_;
};

void check_weight(const mx::array& a, std::vector<int> shape, const std::string& what) {
  if (a.dtype() != mx::float32 || a.shape() != mx::Shape(shape.begin(), shape.end())) {
    fail(what + " has the wrong dtype or shape");
  }
}

}  // namespace

mx::array bert_encode(const mx::array& ids, const mx::array& types, const mx::array& starts,
                      const std::vector<mx::array>& weights, int heads, float eps, int offset,
                      mx::StreamOrDevice s) {
  auto stream = mx::to_stream(s);
  if (stream.device != mx::Device::cpu) fail("runs on the CPU only");
  if (weights.size() < GLOBAL_TENSORS + TENSORS_PER_LAYER ||
      (weights.size() - GLOBAL_TENSORS) % TENSORS_PER_LAYER != 0) {
    fail("weights: 5 globals, then 12 per layer");
  }
  const int H = weights[0].ndim() == 2 ? weights[0].shape(1) : 0;
  const int layers = static_cast<int>((weights.size() - GLOBAL_TENSORS) / TENSORS_PER_LAYER);
  const int I = weights[GLOBAL_TENSORS + 6].shape(0) * PANEL;
  if (H % PANEL != 0 || heads <= 0 || H % heads != 0) fail("hidden size must be a multiple of 32 and of heads");
  for (int g = 0; g < 3; ++g) {
    if (weights[g].ndim() != 2 || weights[g].shape(1) != H || weights[g].dtype() != mx::float32) {
      fail("embedding tables must be float32 (rows, hidden)");
    }
  }
  check_weight(weights[3], {H}, "embedding LayerNorm");
  check_weight(weights[4], {H}, "embedding LayerNorm bias");
  for (int l = 0; l < layers; ++l) {
    const auto* t = &weights[GLOBAL_TENSORS + l * TENSORS_PER_LAYER];
    const std::string at = "layer " + std::to_string(l);
    check_weight(t[0], {3 * H / PANEL, H, PANEL}, at + " qkv");
    check_weight(t[1], {3 * H}, at + " qkv bias");
    check_weight(t[2], {H / PANEL, H, PANEL}, at + " output");
    check_weight(t[3], {H}, at + " output bias");
    check_weight(t[4], {H}, at + " attention LayerNorm");
    check_weight(t[5], {H}, at + " attention LayerNorm bias");
    check_weight(t[6], {I / PANEL, H, PANEL}, at + " up");
    check_weight(t[7], {I}, at + " up bias");
    check_weight(t[8], {H / PANEL, I, PANEL}, at + " down");
    check_weight(t[9], {H}, at + " down bias");
    check_weight(t[10], {H}, at + " LayerNorm");
    check_weight(t[11], {H}, at + " LayerNorm bias");
  }
  if (ids.ndim() != 1 || types.shape() != ids.shape() || starts.ndim() != 1 || starts.size() < 2) {
    fail("ids and types (T,), starts (S + 1,)");
  }
  std::vector<mx::array> inputs = {mx::astype(ids, mx::int32, stream),
                                   mx::astype(types, mx::int32, stream),
                                   mx::astype(starts, mx::int32, stream)};
  for (const auto& w : weights) inputs.push_back(mx::contiguous(w, false, stream));
  Shape shape{H, heads, I, offset, layers, eps};
  return mx::array({ids.shape(0), H}, mx::float32, std::make_shared<BertEncode>(stream, shape),
                   std::move(inputs));
}

}  // namespace pipeserve
