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
//
// A third layout, panels (f32_panels: the weight as contiguous (K, PANEL) blocks of
// PANEL output columns each), is for a model's output projection, the one weight of a
// small float32 model too large for any cache: a panel is one stream of memory the
// hardware prefetcher follows, where a (K, N) panel's rows lie N floats apart (one page
// each), and the BLAS packs the whole weight again on every call. Any number of rows
// runs here (the BLAS cannot read panels), the same chain of FMAs per output. A thread
// claims a few panels at a time, and while its passes over one panel compute from cache
// it requests the next into L2 (`pull`), so memory keeps streaming (16 rows: 61 -> 51 ms
// on one thread for a 151669 x 512 head).

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
// Panels layout: a chunk of several panels, so that a thread knows the next it multiplies
constexpr int64_t PULL_CHUNK_FLOATS = int64_t{1} << 18;  // ~1 MB

enum class Layout { NK, KN, Panels };

struct Problem {
  const float* x;  // (M, K), rows ldx apart
  int64_t ldx;
  const float* w;  // (K, N) rows ldw apart (KN), (N, K) (NK), or (ceil(N / PANEL), K, PANEL)
  int64_t ldw;
  Layout layout;
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
static_assert(PANEL_VECTORS * LANES == F32_PANEL, "kernels.h's F32_PANEL is this build's panel");
constexpr int PANEL = F32_PANEL;  // columns per panel
constexpr int TALL = ACC_REGS / 2;   // rows of x per tall tile (two vectors each)
constexpr int TALL_GROUPS = PANEL_VECTORS / 2;

// Where a pass over a panel prefetches. `after`: the first row of the panel that
// follows it in memory (null: none); the panel's row PREFETCH_ROWS ahead (past its end,
// that panel's) is requested into L1 before it is needed. `pull` (panels layout): the
// panel this thread multiplies next (null: none), its rows requested into L2 spread over
// the passes, so that memory keeps streaming while the later passes compute from cache.
struct Ahead {
  const float* after = nullptr;
  const float* pull = nullptr;
  int pull_row = 0;    // the first row of `pull` this pass requests
  int pull_every = 1;  // k steps between two rows requested
};

// out[m][n0 .. n0 + V * LANES) for RB rows of x from m0; w points at (k 0, column n0) of
// a (K, *) panel whose rows are ldw apart.
template <int RB, int V>
void panel(const Problem& p, int m0, const float* w, int64_t ldw, const Ahead& ahead, int n0) {
  Vec acc[RB][V];
  for (int m = 0; m < RB; ++m)
    for (int v = 0; v < V; ++v) acc[m][v] = vzero();
  const float* x = p.x + m0 * p.ldx;
  int pull_row = ahead.pull_row, countdown = 0;
  for (int k = 0; k < p.K; ++k) {
    const float* wk = w + k * ldw;
    if (ahead.after != nullptr) {
      const int row = k + PREFETCH_ROWS;
      const float* next = row < p.K ? w + row * ldw : ahead.after + (row - p.K) * ldw;
      for (int v = 0; v < V; v += VECTORS_PER_LINE) {
        _mm_prefetch(reinterpret_cast<const char*>(next + v * LANES), _MM_HINT_T0);
      }
    }
    if (ahead.pull != nullptr && --countdown < 0 && pull_row < p.K) {
      const float* row = ahead.pull + static_cast<int64_t>(pull_row++) * ldw;
      for (int v = 0; v < V; v += VECTORS_PER_LINE) {
        _mm_prefetch(reinterpret_cast<const char*>(row + v * LANES), _MM_HINT_T1);
      }
      countdown = ahead.pull_every - 1;
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

// Every row of x against one panel. Whole blocks of TALL rows (batched decode) take
// TALL x (V / TALL_GROUPS) tiles over the panel's TALL_GROUPS column groups in turn
// (each weight loaded once per block, not once per pair of rows); the rest ROW_BLOCK
// rows at a time over the whole panel (the first pass reads the panel from memory, the
// others from cache). Pass j of P pulls rows j * K / P .. (j + 1) * K / P - 1 of
// `pull`, one every P k steps. Tall tiles, on the 151669 x 512 head, one thread: 8 rows
// 40.4 -> 37.4 ms, 16 rows 52.2 -> 46.3 (the BLAS: 36.2, 49.5).
template <int V>
void panel_rows(const Problem& p, const float* w, int64_t ldw, const float* after,
                const float* pull, int n0) {
  static_assert(ROW_BLOCK == 2);
  constexpr bool tall = V == PANEL_VECTORS;  // whole panels only
  const int tall_rows = tall ? p.M / TALL * TALL : 0;
  const int passes = tall_rows / TALL * TALL_GROUPS + (p.M - tall_rows + 1) / 2;
  Ahead ahead{after, pull, 0, passes};
  int pass = 0;
  auto pull_from = [&](int j) { return static_cast<int>(static_cast<int64_t>(j) * p.K / passes); };
  if constexpr (tall) {
    constexpr int GROUP = V / TALL_GROUPS;  // vectors per column group of a tall tile
    static_assert(GROUP * TALL_GROUPS == V);
    for (int m0 = 0; m0 < tall_rows; m0 += TALL) {
      for (int g = 0; g < TALL_GROUPS; ++g, ++pass) {
        const int offset = g * GROUP * LANES;
        const float* next_group = g + 1 < TALL_GROUPS ? w + offset + GROUP * LANES : after;
        Ahead group = ahead;
        group.after = after == nullptr ? nullptr : next_group;
        group.pull_row = pull_from(pass);
        panel<TALL, GROUP>(p, m0, w + offset, ldw, group, n0 + offset);
      }
    }
  }
  for (int m0 = tall_rows; m0 < p.M; ++pass, m0 += 2) {
    ahead.pull_row = pull_from(pass);
    if (m0 + 2 <= p.M) {
      panel<2, V>(p, m0, w, ldw, ahead, n0);
    } else {
      panel<1, V>(p, m0, w, ldw, ahead, n0);
    }
  }
}

// One row of x against two consecutive panels (a, b) at once: two streams of memory in
// flight instead of one, each output the same FMA chain. The 151669 x 512 head: 26.5 ->
// 22.5 ms on one thread, 13.3 -> 11.2 on two.
void panel_pair(const Problem& p, const float* a, const float* b, int n0) {
  constexpr int V = PANEL_VECTORS;
  Vec acc[2][V];
  for (int s = 0; s < 2; ++s)
    for (int v = 0; v < V; ++v) acc[s][v] = vzero();
  const float* streams[2] = {a, b};
  for (int k = 0; k < p.K; ++k) {
    const Vec xk = vset(p.x[k]);
    for (int s = 0; s < 2; ++s) {
      const float* wk = streams[s] + k * PANEL;
      for (int v = 0; v < V; v += VECTORS_PER_LINE) {
        _mm_prefetch(reinterpret_cast<const char*>(wk + PREFETCH_ROWS * PANEL + v * LANES), _MM_HINT_T0);
      }
      for (int v = 0; v < V; ++v) acc[s][v] = vfma(xk, vload(wk + v * LANES), acc[s][v]);
    }
  }
  for (int s = 0; s < 2; ++s) {
    float* o = p.out + n0 + s * PANEL;
    for (int v = 0; v < V; ++v) {
      const int column = n0 + s * PANEL + v * LANES;
      vstore(o + v * LANES, p.bias ? vadd(acc[s][v], vload(p.bias + column)) : acc[s][v]);
    }
  }
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

int64_t panel_floats(const Problem& p) { return static_cast<int64_t>(F32_PANEL) * p.K; }

// Where output column n's weights start in memory, and how many floats apart they lie.
const float* column_weights(const Problem& p, int n) {
  switch (p.layout) {
    case Layout::KN:
      return p.w + n;
    case Layout::NK:
      return p.w + n * p.ldw;
    case Layout::Panels:
      break;
  }
  return p.w + (n / F32_PANEL) * panel_floats(p) + n % F32_PANEL;
}

int64_t column_step(const Problem& p) {
  switch (p.layout) {
    case Layout::KN:
      return p.ldw;
    case Layout::NK:
      return 1;
    case Layout::Panels:
      break;
  }
  return F32_PANEL;
}

#if defined(PIPESERVE_F32_SIMD)
// Output columns from n0 on in whole panels, then single vectors; returns the first
// column left (fewer than LANES before n1).
int vector_columns(const Problem& p, int n0, int n1) {
  int n = n0;
  if (p.layout == Layout::NK) {
    thread_local std::vector<float> buffer;
    for (; n + PANEL <= n1; n += PANEL) {
      pack(p, n, PANEL, buffer);
      panel_rows<PANEL_VECTORS>(p, buffer.data(), PANEL, nullptr, nullptr, n);
    }
    for (; n + LANES <= n1; n += LANES) {
      pack(p, n, LANES, buffer);
      panel_rows<1>(p, buffer.data(), LANES, nullptr, nullptr, n);
    }
    return n;
  }
  const int64_t ldw = column_step(p);
  const bool panels = p.layout == Layout::Panels;
  if (panels && p.M == 1) {  // a decode step of one stream
    for (; n + 2 * PANEL <= n1; n += 2 * PANEL) {
      const float* w = column_weights(p, n);
      panel_pair(p, w, w + panel_floats(p), n);
    }
  }
  for (; n + PANEL <= n1; n += PANEL) {
    const float* w = column_weights(p, n);
    const float* after = panels ? w + panel_floats(p) : w + PANEL;
    const bool next_here = panels && n + 2 * PANEL <= n1;  // this chunk's next whole panel
    panel_rows<PANEL_VECTORS>(p, w, ldw, after, next_here ? after : nullptr, n);
  }
  for (; n + LANES <= n1; n += LANES) {
    panel_rows<1>(p, column_weights(p, n), ldw, nullptr, nullptr, n);
  }
  return n;
}
#endif

// Output columns [n0, n1) of every row, on the calling thread: whole panels, then
// single vectors, then single columns.
void columns(const Problem& p, int n0, int n1) {
  int n = n0;
#if defined(PIPESERVE_F32_SIMD)
  n = vector_columns(p, n0, n1);
#endif
  for (; n < n1; ++n) column(p, column_weights(p, n), column_step(p), n);
}

// Chunks of whole panels, about CHUNK_FLOATS weights each, claimed by the pool's threads.
void run(const Problem& p) {
  const int64_t chunk_floats = p.layout == Layout::Panels ? PULL_CHUNK_FLOATS : CHUNK_FLOATS;
  const int per_chunk =
      static_cast<int>(std::max<int64_t>(1, chunk_floats / std::max<int64_t>(1, panel_floats(p))));
  const int chunk_cols = per_chunk * F32_PANEL;
  const int chunks = (p.N + chunk_cols - 1) / chunk_cols;
  parallel_for(chunks, [&](int chunk) {
    const int n0 = chunk * chunk_cols;
    columns(p, n0, std::min(p.N, n0 + chunk_cols));
  });
}

class F32Matmul : public mx::Primitive {
 public:
  // n: the output's columns (read from w but for the panels layout, whose last panel may
  // hold padding)
  F32Matmul(mx::Stream stream, Layout layout, int n)
      : mx::Primitive(stream), layout_(layout), n_(n) {}

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
    p.N = n_;
    p.x = x.data<float>();
    p.ldx = p.K;
    p.w = w.data<float>();
    p.ldw = w.shape(-1);
    p.layout = layout_;
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
    const auto& that = static_cast<const F32Matmul&>(other);
    return layout_ == that.layout_ && n_ == that.n_;
  }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    return {{inputs[0].shape(0), n_}};
  }

 private:
  Layout layout_;
  int n_;
};

// A (K, N) or (N, K) float32 weight as (ceil(N / F32_PANEL), K, F32_PANEL) panels, the
// columns past N zero.
class F32Panels : public mx::Primitive {
 public:
  F32Panels(mx::Stream stream, bool transposed) : mx::Primitive(stream), transposed_(transposed) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs)
      override {
    const auto& w = inputs[0];
    auto& out = outputs[0];
    if (!w.flags().row_contiguous) throw std::runtime_error("f32_panels: w not contiguous");
    out.set_data(mx::allocator::malloc(out.nbytes()));
    auto& encoder = mx::cpu::get_command_encoder(stream());
    encoder.set_input_array(w);
    encoder.set_output_array(out);
    const float* src = w.data<float>();
    float* dst = out.data<float>();
    const int K = out.shape(1);
    const int N = transposed_ ? w.shape(1) : w.shape(0);
    const int panels = out.shape(0);
    const bool transposed = transposed_;
    encoder.dispatch([=]() {
      parallel_for(panels, [&](int panel) { copy_panel(src, dst, K, N, panel, transposed); });
    });
  }

  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error("f32_panels runs on the CPU only");
  }
  const char* name() const override {
    return "PipeserveF32Panels";
  }
  bool is_equivalent(const mx::Primitive& other) const override {
    return transposed_ == static_cast<const F32Panels&>(other).transposed_;
  }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    const auto& w = inputs[0];
    const int n = transposed_ ? w.shape(1) : w.shape(0);
    return {{(n + F32_PANEL - 1) / F32_PANEL, transposed_ ? w.shape(0) : w.shape(1), F32_PANEL}};
  }

 private:
  // One panel: from (K, N) rows' runs of columns, or (N, K) rows 16 k at a time.
  static void copy_panel(const float* src, float* dst, int K, int N, int panel, bool transposed) {
    const int n0 = panel * F32_PANEL;
    const int width = std::min(F32_PANEL, N - n0);
    float* out = dst + static_cast<int64_t>(panel) * K * F32_PANEL;
    if (width < F32_PANEL) std::fill(out, out + static_cast<int64_t>(K) * F32_PANEL, 0.0f);
    if (transposed) {
      for (int k = 0; k < K; ++k) {
        const float* row = src + static_cast<int64_t>(k) * N + n0;
        std::copy(row, row + width, out + static_cast<int64_t>(k) * F32_PANEL);
      }
      return;
    }
    for (int k0 = 0; k0 < K; k0 += 16) {
      const int k1 = std::min(K, k0 + 16);
      for (int j = 0; j < width; ++j) {
        const float* row = src + static_cast<int64_t>(n0 + j) * K;
        for (int k = k0; k < k1; ++k) out[static_cast<int64_t>(k) * F32_PANEL + j] = row[k];
      }
    }
  }

  bool transposed_;
};

void check(bool ok, const std::string& message) {
  if (!ok) throw std::invalid_argument("f32_matmul: " + message);
}

mx::array float32(const mx::array& a, mx::Stream stream) {
  return mx::contiguous(a.dtype() == mx::float32 ? a : mx::astype(a, mx::float32, stream), false,
                        stream);
}

// The kernel's product of x (any leading axes) as (rows, K) rows.
mx::array kernel_product(const mx::array& x, const mx::array& w, Layout layout, int K, int N,
                         const std::optional<mx::array>& bias, mx::Stream stream) {
  const int rows = static_cast<int>(static_cast<int64_t>(x.size()) / K);
  auto flat = float32(mx::reshape(x, {-1, K}, stream), stream);
  std::vector<mx::array> inputs = {flat, mx::contiguous(w, false, stream)};
  if (bias) inputs.push_back(float32(*bias, stream));
  auto out = mx::array({rows, N}, mx::float32, std::make_shared<F32Matmul>(stream, layout, N),
                       std::move(inputs));
  auto shape = x.shape();
  shape.back() = N;
  return mx::reshape(out, shape, stream);
}

}  // namespace

void f32_matmul_columns(const float* x, int64_t ldx, int M, int K, const float* w, int64_t ldw,
                        bool transposed, const float* bias, float* out, int64_t ldo, int n0,
                        int n1) {
  const Layout layout = transposed ? Layout::KN : Layout::NK;
  Problem p{x, ldx, w, ldw, layout, bias, out, ldo, M, K, n1};
  columns(p, n0, n1);
}

void f32_matmul_rows(const float* x, int64_t ldx, int M, int K, const float* w, int64_t ldw,
                     int N, bool transposed, const float* bias, float* out, int64_t ldo) {
  const Layout layout = transposed ? Layout::KN : Layout::NK;
  run(Problem{x, ldx, w, ldw, layout, bias, out, ldo, M, K, N});
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
  return kernel_product(x, w, transposed ? Layout::KN : Layout::NK, K, N, bias, stream);
}

mx::array f32_panels(const mx::array& w, bool transposed, mx::StreamOrDevice s) {
  auto stream = mx::to_stream(s);
  check(stream.device == mx::Device::cpu, "runs on the CPU only");
  check(w.ndim() == 2 && w.dtype() == mx::float32, "w must be a 2-D float32 array");
  const int K = transposed ? w.shape(0) : w.shape(1);
  const int N = transposed ? w.shape(1) : w.shape(0);
  const mx::Shape shape = {(N + F32_PANEL - 1) / F32_PANEL, K, F32_PANEL};
  return mx::array(shape, mx::float32, std::make_shared<F32Panels>(stream, transposed),
                   {mx::contiguous(w, false, stream)});
}

mx::array f32_matmul_panels(const mx::array& x, const mx::array& panels, int n,
                            const std::optional<mx::array>& bias, mx::StreamOrDevice s) {
  auto stream = mx::to_stream(s);
  check(stream.device == mx::Device::cpu, "runs on the CPU only");
  check(panels.ndim() == 3 && panels.dtype() == mx::float32 && panels.shape(2) == F32_PANEL,
        "panels must be f32_panels' (P, K, F32_PANEL) float32 array");
  const int64_t capacity = static_cast<int64_t>(panels.shape(0)) * F32_PANEL;
  check(n > capacity - F32_PANEL && n <= capacity, "n does not match the panels");
  check(x.ndim() >= 1, "x must have at least one dimension");
  const int K = panels.shape(1);
  check(x.shape(-1) == K, "x's last dimension does not match the panels");
  check(!bias || (bias->ndim() == 1 && bias->shape(0) == n), "bias must be (N,)");
  if (K == 0 || x.size() == 0) {
    auto shape = x.shape();
    shape.back() = n;
    auto zeros = mx::zeros(shape, mx::float32, stream);
    return bias ? mx::add(zeros, float32(*bias, stream), stream) : zeros;
  }
  return kernel_product(x, panels, Layout::Panels, K, n, bias, stream);
}

}  // namespace pipeserve
