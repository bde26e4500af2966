// Float32 matmul for a few activation rows (decode steps, small batches): x @ w for a
// weight stored (K, N) (cpu_layout's transposed layout) or x @ w.T for one stored
// (N, K) (nn.Linear's), the weight read from memory once for all rows, its columns
// split across the kernels' thread pool (parallel_for). A float32 model's decode step
// is memory-bound on its weights (a 151k x 512 output projection is 311 MB a token),
// and the BLAS at one thread reads them at about half the rate two threads reach here.
//
// Every output is one chain of fused multiply-adds over k = 0 .. K - 1 in order, then
// the bias added, in both layouts and on every code path (an (N, K) weight is copied
// into (K, n) panels first), so the layout never changes a result: cpu_layout's
// promise that a transposed model computes the very same numbers holds with it.
// More rows than F32_MATMUL_MAX_ROWS go to MLX's matmul (the BLAS: compute-bound there).

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "mlx/backend/cpu/encoder.h"
#include "mlx/ops.h"
#include "mlx/primitives.h"

#include "kernels.h"

namespace pipeserve {

namespace {

#if defined(__AVX512F__)
#define PIPESERVE_F32_SIMD 1
constexpr int LANES = 16;
constexpr int ACC_REGS = 16;  // of 32 vector registers: the rest hold weights
using Vec = __m512;
inline Vec vzero() { return _mm512_setzero_ps(); }
inline Vec vload(const float* p) { return _mm512_loadu_ps(p); }
inline void vstore(float* p, Vec v) { _mm512_storeu_ps(p, v); }
inline Vec vset(float v) { return _mm512_set1_ps(v); }
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
inline Vec vadd(Vec a, Vec b) { return _mm512_add_ps(a, b); }
#elif defined(__AVX2__) && defined(__FMA__)
#define PIPESERVE_F32_SIMD 1
constexpr int LANES = 8;
constexpr int ACC_REGS = 8;  // of 16
using Vec = __m256;
inline Vec vzero() { return _mm256_setzero_ps(); }
inline Vec vload(const float* p) { return _mm256_loadu_ps(p); }
inline void vstore(float* p, Vec v) { _mm256_storeu_ps(p, v); }
inline Vec vset(float v) { return _mm256_set1_ps(v); }
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
inline Vec vadd(Vec a, Vec b) { return _mm256_add_ps(a, b); }
#else
constexpr int LANES = 0;  // scalar: every column takes the scalar chain
#endif

// Rows of x per pass over a panel: a panel (K x 128 floats on AVX-512) is read from
// memory by the first pass and from cache by the rest. Measured on the 151936 x 512
// output projection: blocks of 2 rows over 128 columns beat blocks of up to 8 rows over
// narrower panels (a (K, N) panel's rows lie N floats apart; wider is kinder to the TLB).
constexpr int ROW_BLOCK = 2;
constexpr int PREFETCH_ROWS = 16;          // rows of the panel ahead of the one multiplied
constexpr int64_t CHUNK_FLOATS = 1 << 16;  // weights per claimed chunk (~256 KB)

struct Problem {
  const float* x;  // (M, K), rows ldx apart
  int64_t ldx;
  const float* w;  // (K, N) rows ldw apart when transposed, else (N, K)
  int64_t ldw;
  bool transposed;
  const float* bias;  // (N) or null
  float* out;         // (M, N), rows ldo apart
  int64_t ldo;
  int M, K, N;
};

// One output column: the chain every path computes, as scalars.
inline void column(const Problem& p, const float* w, int64_t step, int n) {
  for (int m = 0; m < p.M; ++m) {
    const float* x = p.x + m * p.ldx;
    float acc = 0.0f;
    for (int k = 0; k < p.K; ++k) acc = std::fma(x[k], w[k * step], acc);
    p.out[m * p.ldo + n] = p.bias ? acc + p.bias[n] : acc;
  }
}

#if defined(PIPESERVE_F32_SIMD)
constexpr int VECTORS_PER_LINE = std::max(1, 64 / (LANES * 4));  // 64-byte cache lines
constexpr int PANEL_VECTORS = ACC_REGS / ROW_BLOCK;
constexpr int PANEL = PANEL_VECTORS * LANES;  // columns per panel

// out[m][n0 .. n0 + V * LANES) for RB rows of x from m0; w points at (k 0, column n0) of
// a (K, *) panel whose rows are ldw apart. prefetch: the panel's row PREFETCH_ROWS
// ahead (past its end, the next panel's first rows) is requested before it is needed.
template <int RB, int V>
void panel(const Problem& p, int m0, const float* w, int64_t ldw, int n0, bool prefetch) {
  Vec acc[RB][V];
  for (int m = 0; m < RB; ++m)
    for (int v = 0; v < V; ++v) acc[m][v] = vzero();
  const float* x = p.x + m0 * p.ldx;
  for (int k = 0; k < p.K; ++k) {
    const float* wk = w + k * ldw;
    if (prefetch) {
      const int ahead = k + PREFETCH_ROWS;
      const float* next = ahead < p.K ? w + ahead * ldw : w + V * LANES + (ahead - p.K) * ldw;
      for (int v = 0; v < V; v += VECTORS_PER_LINE) {
        _mm_prefetch(reinterpret_cast<const char*>(next + v * LANES), _MM_HINT_T0);
      }
    }
    Vec wv[V];
    for (int v = 0; v < V; ++v) wv[v] = vload(wk + v * LANES);
    for (int m = 0; m < RB; ++m) {
      const Vec xm = vset(x[m * p.ldx + k]);
      for (int v = 0; v < V; ++v) acc[m][v] = vfma(xm, wv[v], acc[m][v]);
    }
  }
  for (int m = 0; m < RB; ++m) {
    float* o = p.out + (m0 + m) * p.ldo + n0;
    for (int v = 0; v < V; ++v) {
      const Vec y = p.bias ? vadd(acc[m][v], vload(p.bias + n0 + v * LANES)) : acc[m][v];
      vstore(o + v * LANES, y);
    }
  }
}

// Every row of x against one panel, ROW_BLOCK rows at a time.
template <int V>
void panel_rows(const Problem& p, const float* w, int64_t ldw, int n0, bool prefetch) {
  static_assert(ROW_BLOCK == 2);
  int m0 = 0;
  for (; m0 + 2 <= p.M; m0 += 2) panel<2, V>(p, m0, w, ldw, n0, prefetch);
  if (m0 < p.M) panel<1, V>(p, m0, w, ldw, n0, prefetch);
}

// (n, K) rows of an (N, K) weight copied into a (K, n) panel, 16 k at a time (so the
// panel's lines being written stay in L1).
void pack(const Problem& p, int n0, int n, std::vector<float>& buffer) {
  buffer.resize(static_cast<size_t>(p.K) * n);
  for (int k0 = 0; k0 < p.K; k0 += 16) {
    const int k1 = std::min(p.K, k0 + 16);
    for (int j = 0; j < n; ++j) {
      const float* row = p.w + (n0 + j) * p.ldw;
      for (int k = k0; k < k1; ++k) buffer[static_cast<size_t>(k) * n + j] = row[k];
    }
  }
}
#endif

// Output columns [n0, n1) of every row, on the calling thread: whole panels, then
// single vectors, then single columns.
void columns(const Problem& p, int n0, int n1) {
  int n = n0;
#if defined(PIPESERVE_F32_SIMD)
  if (p.transposed) {
    for (; n + PANEL <= n1; n += PANEL) panel_rows<PANEL_VECTORS>(p, p.w + n, p.ldw, n, true);
    for (; n + LANES <= n1; n += LANES) panel_rows<1>(p, p.w + n, p.ldw, n, false);
  } else {
    thread_local std::vector<float> buffer;
    for (; n + PANEL <= n1; n += PANEL) {
      pack(p, n, PANEL, buffer);
      panel_rows<PANEL_VECTORS>(p, buffer.data(), PANEL, n, false);
    }
    for (; n + LANES <= n1; n += LANES) {
      pack(p, n, LANES, buffer);
      panel_rows<1>(p, buffer.data(), LANES, n, false);
    }
  }
#endif
  for (; n < n1; ++n) {
    if (p.transposed) {
      column(p, p.w + n, p.ldw, n);
    } else {
      column(p, p.w + n * p.ldw, 1, n);
    }
  }
}

// Chunks of whole panels, about CHUNK_FLOATS weights each, claimed by the pool's threads.
void run(const Problem& p) {
#if defined(PIPESERVE_F32_SIMD)
  const int width = PANEL;
#else
  const int width = 16;
#endif
  const int64_t panel_floats = static_cast<int64_t>(width) * std::max(1, p.K);
  const int per_chunk = static_cast<int>(std::max<int64_t>(1, CHUNK_FLOATS / panel_floats));
  const int chunk_cols = per_chunk * width;
  const int chunks = (p.N + chunk_cols - 1) / chunk_cols;
  parallel_for(chunks, [&](int chunk) {
    const int n0 = chunk * chunk_cols;
    columns(p, n0, std::min(p.N, n0 + chunk_cols));
  });
}

class F32Matmul : public mx::Primitive {
 public:
  F32Matmul(mx::Stream stream, bool transposed) : mx::Primitive(stream), transposed_(transposed) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs)
      override {
    const auto& x = inputs[0];
    const auto& w = inputs[1];
    auto& out = outputs[0];
    for (const auto& a : inputs) {
      if (!a.flags().row_contiguous) throw std::runtime_error("f32_matmul: inputs not contiguous");
    }
    out.set_data(mx::allocator::malloc(out.nbytes()));
    auto& encoder = mx::cpu::get_command_encoder(stream());
    for (const auto& a : inputs) encoder.set_input_array(a);
    encoder.set_output_array(out);
    Problem p{};
    p.M = x.shape(0);
    p.K = x.shape(1);
    p.N = out.shape(1);
    p.x = x.data<float>();
    p.ldx = p.K;
    p.w = w.data<float>();
    p.ldw = w.shape(1);
    p.transposed = transposed_;
    p.bias = inputs.size() > 2 ? inputs[2].data<float>() : nullptr;
    p.out = out.data<float>();
    p.ldo = p.N;
    encoder.dispatch([p]() { run(p); });
  }

  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error("f32_matmul runs on the CPU only");
  }
  const char* name() const override {
    return "PipeserveF32Matmul";
  }
  bool is_equivalent(const mx::Primitive& other) const override {
    return transposed_ == static_cast<const F32Matmul&>(other).transposed_;
  }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    const auto& w = inputs[1];
    return {{inputs[0].shape(0), transposed_ ? w.shape(1) : w.shape(0)}};
  }

 private:
  bool transposed_;
};

void check(bool ok, const std::string& message) {
  if (!ok) throw std::invalid_argument("f32_matmul: " + message);
}

}  // namespace

void f32_matmul_columns(const float* x, int64_t ldx, int M, int K, const float* w, int64_t ldw,
                        bool transposed, const float* bias, float* out, int64_t ldo, int n0,
                        int n1) {
  Problem p{x, ldx, w, ldw, transposed, bias, out, ldo, M, K, n1};
  columns(p, n0, n1);
}

void f32_matmul_rows(const float* x, int64_t ldx, int M, int K, const float* w, int64_t ldw,
                     int N, bool transposed, const float* bias, float* out, int64_t ldo) {
  run(Problem{x, ldx, w, ldw, transposed, bias, out, ldo, M, K, N});
}

mx::array f32_matmul(const mx::array& x, const mx::array& w, bool transposed,
                     const std::optional<mx::array>& bias, mx::StreamOrDevice s) {
  auto stream = mx::to_stream(s);
  check(stream.device == mx::Device::cpu, "runs on the CPU only");
  check(w.ndim() == 2 && w.dtype() == mx::float32, "w must be a 2-D float32 array");
  check(x.ndim() >= 1, "x must have at least one dimension");
  const int K = transposed ? w.shape(0) : w.shape(1);
  const int N = transposed ? w.shape(1) : w.shape(0);
  check(x.shape(-1) == K, "x's last dimension does not match w");
  check(!bias || (bias->ndim() == 1 && bias->shape(0) == N), "bias must be (N,)");
  const int64_t rows = K == 0 ? 0 : static_cast<int64_t>(x.size()) / K;
  const bool float_in = x.dtype() == mx::float32 && (!bias || bias->dtype() == mx::float32);
  if (rows > F32_MATMUL_MAX_ROWS || rows == 0 || !float_in) {  // MLX's own (the BLAS)
    auto wt = transposed ? w : mx::transpose(w, stream);
    return bias ? mx::addmm(*bias, x, wt, 1.0f, 1.0f, stream) : mx::matmul(x, wt, stream);
  }
  auto flat = mx::contiguous(mx::reshape(x, {-1, K}, stream), false, stream);
  std::vector<mx::array> inputs = {flat, mx::contiguous(w, false, stream)};
  if (bias) inputs.push_back(mx::contiguous(*bias, false, stream));
  auto out = mx::array({static_cast<int>(rows), N}, mx::float32,
                       std::make_shared<F32Matmul>(stream, transposed), std::move(inputs));
  auto shape = x.shape();
  shape.back() = N;
  return mx::reshape(out, shape, stream);
}

}  // namespace pipeserve
