// Blocked attention for prompt chunks (prefill_attention.h), as flash attention does it on
// a CPU: a task is one (batch row, kv head, run of query positions); its query rows (the
// kv head's group of query heads x the positions) go in tiles of 12 against blocks of 32
// keys. Per block: the 12 x 32 scores as a small GEMM (each kv head's keys transposed once
// per call, so a key vector load serves 12 rows: attend_query reads a key per query), the
// causal mask, an online softmax (running max and sum per row, the row's output rescaled
// when the max grows), then the weighted values added into the rows' outputs. Blocks start
// at key 0 in steps of 32 whatever the task, and a block a row cannot see leaves its
// numbers exactly as they were, so a row's result depends only on its own q, the keys and
// values and its position, never on the other rows of its tile or chunk.

#include "prefill_attention.h"

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <numeric>
#include <vector>

#include "kernels.h"
#include "simd512.h"
#include "vector_math.h"

namespace pipeserve {

namespace {
std::atomic<bool> enabled{true};
}  // namespace

void set_prefill_attention(bool on) { enabled.store(on); }
bool prefill_attention_enabled() { return enabled.load(); }

#if defined(__AVX512F__)

namespace {

constexpr int KB = 32;  // keys per block: two vectors of scores per row
constexpr int MR = 12;  // query rows per tile: 24 score accumulators
constexpr int MAX_D = 128;

// A tile's rows: scaled queries, running outputs, one block's scores (then weights),
// running max and sum, and how many keys each row sees.
struct Tile {
  alignas(64) float q[MR][MAX_D];
  alignas(64) float o[MR][MAX_D];
  alignas(64) float s[MR][KB];
  float m[MR], l[MR], alpha[MR];
  int first[MR], limit[MR];  // the keys a row sees: first .. limit - 1 (and its mask's)
  const bool* mask[MR];  // the row's mask at key 0 (null: none)
  int64_t mask_step;
};

// s (MR x KB) = q . keys[kb .. kb + KB) from the transposed keys (kt: D rows of `stride`).
template <int V>
void block_scores(Tile& t, const float* kt, int64_t stride) {
  __m512 acc[MR][2];
  PIPESERVE_UNROLL
  for (int i = 0; i < MR; ++i) acc[i][0] = acc[i][1] = _mm512_setzero_ps();
  for (int d = 0; d < 16 * V; ++d) {
    const __m512 k0 = _mm512_loadu_ps(kt + d * stride), k1 = _mm512_loadu_ps(kt + d * stride + 16);
    PIPESERVE_UNROLL
    for (int i = 0; i < MR; ++i) {
      const __m512 qd = _mm512_set1_ps(t.q[i][d]);
      acc[i][0] = _mm512_fmadd_ps(qd, k0, acc[i][0]);
      acc[i][1] = _mm512_fmadd_ps(qd, k1, acc[i][1]);
    }
  }
  PIPESERVE_UNROLL
  for (int i = 0; i < MR; ++i) {
    _mm512_store_ps(t.s[i], acc[i][0]);
    _mm512_store_ps(t.s[i] + 16, acc[i][1]);
  }
}

// Row i's online-softmax step over the block at kb: s becomes the weights (0 for keys the
// row does not see), alpha the factor its output so far is rescaled by.
void softmax_step(Tile& t, int i, int kb) {
  float* s = t.s[i];
  const int from = std::max(0, t.first[i] - kb), to = std::min(KB, t.limit[i] - kb);
  if (to <= from) {  // nothing of this block: the row stays exactly as it is
    std::fill(s, s + KB, 0.0f);
    t.alpha[i] = 1.0f;
    return;
  }
  for (int j = 0; j < from; ++j) s[j] = -INFINITY;
  for (int j = to; j < KB; ++j) s[j] = -INFINITY;
  if (const bool* m = t.mask[i]) {
    for (int j = from; j < to; ++j) {
      if (!m[(kb + j) * t.mask_step]) s[j] = -INFINITY;
    }
  }
  const float top = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_load_ps(s), _mm512_load_ps(s + 16)));
  if (top == -INFINITY) {  // every key of the block masked
    std::fill(s, s + KB, 0.0f);
    t.alpha[i] = 1.0f;
    return;
  }
  const float m = std::max(t.m[i], top);
  for (int j = 0; j < KB; ++j) s[j] = fast_exp(s[j] - m);  // vectorised
  const float sum = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_load_ps(s), _mm512_load_ps(s + 16)));
  t.alpha[i] = fast_exp(t.m[i] - m);  // the first block: exp(-inf) = 0
  t.l[i] = t.l[i] * t.alpha[i] + sum;
  t.m[i] = m;
}

// o[i] = alpha[i] o[i] + s[i] . values[kb .. kb + keys), PR rows at a time.
template <int V>
void block_values(Tile& t, const float* values, int64_t v_s, int keys) {
  constexpr int budget = 24 / V;
  constexpr int PR = budget >= 12 ? 12 : budget >= 6 ? 6 : budget >= 4 ? 4 : 3;
  for (int r0 = 0; r0 < MR; r0 += PR) {
    __m512 acc[PR][V];
    PIPESERVE_UNROLL
    for (int i = 0; i < PR; ++i) {
      const __m512 a = _mm512_set1_ps(t.alpha[r0 + i]);
      PIPESERVE_UNROLL
      for (int v = 0; v < V; ++v) acc[i][v] = _mm512_mul_ps(a, _mm512_load_ps(t.o[r0 + i] + 16 * v));
    }
    for (int j = 0; j < keys; ++j) {
      __m512 row[V];
      PIPESERVE_UNROLL
      for (int v = 0; v < V; ++v) row[v] = _mm512_loadu_ps(values + j * v_s + 16 * v);
      PIPESERVE_UNROLL
      for (int i = 0; i < PR; ++i) {
        const __m512 w = _mm512_set1_ps(t.s[r0 + i][j]);
        PIPESERVE_UNROLL
        for (int v = 0; v < V; ++v) acc[i][v] = _mm512_fmadd_ps(w, row[v], acc[i][v]);
      }
    }
    PIPESERVE_UNROLL
    for (int i = 0; i < PR; ++i) {
      PIPESERVE_UNROLL
      for (int v = 0; v < V; ++v) _mm512_store_ps(t.o[r0 + i] + 16 * v, acc[i][v]);
    }
  }
}

// Keys [0, keys) of a kv head transposed into kt (D rows of `stride` >= keys, rounded up
// to a block; zeros past keys).
void transpose_keys(const float* k, int64_t k_s, int keys, int D, int64_t stride, float* kt) {
  for (int d = 0; d < D; ++d) {
    float* to = kt + static_cast<size_t>(d) * stride;
    for (int j = 0; j < keys; ++j) to[j] = k[j * k_s + d];
    std::fill(to + keys, to + stride, 0.0f);
  }
}

struct Task {
  const PrefillAttention& a;
  const float* kt;  // the (b, kh) head's keys transposed: D rows of `stride`
  int64_t stride;
  int b, kh, first, last;  // query positions first .. last - 1

  int group() const { return a.Hq / a.Hk; }
  int limit(int l) const { return a.causal ? std::min(a.S, a.S - a.L + l + 1) : a.S; }

  // Key blocks outer, the task's tiles inner: a block's keys and values are read from
  // memory once per task and serve all its rows from cache. Blocks start at the first
  // key any of the task's rows sees.
  template <int V>
  void run() const {
    const int rows = (last - first) * group(), tiles = (rows + MR - 1) / MR;
    thread_local std::vector<Tile> state;
    if (static_cast<int>(state.size()) < tiles) state.resize(tiles);
    std::vector<int> tops(tiles);
    int top = 0, base = a.S;
    for (int i = 0; i < tiles; ++i) {
      tops[i] = start(state[i], i * MR, std::min(MR, rows - i * MR), base);
      top = std::max(top, tops[i]);
    }
    const float* values = a.v + b * a.v_b + kh * a.v_h;
    for (int kb = base; kb < top; kb += KB) {
      for (int i = 0; i < tiles; ++i) {
        if (kb >= tops[i]) continue;
        Tile& t = state[i];
        block_scores<V>(t, kt + kb, stride);
        for (int r = 0; r < MR; ++r) softmax_step(t, r, kb);
        block_values<V>(t, values + kb * a.v_s, a.v_s, std::min(KB, tops[i] - kb));
      }
    }
    for (int i = 0; i < tiles; ++i) finish(state[i], i * MR, std::min(MR, rows - i * MR));
  }

  // Row r of the task: position first + r / group, head kh * group + r % group. Loads a
  // tile's rows and the keys each sees (base: the least first key so far); returns one
  // past the last key any of them sees.
  int start(Tile& t, int r0, int count, int& base) const {
    const int g = group();
    int top = 0;
    t.mask_step = a.m_s;
    for (int i = 0; i < MR; ++i) {
      t.m[i] = -INFINITY;
      t.l[i] = 0.0f;
      t.mask[i] = nullptr;
      std::fill(t.o[i], t.o[i] + MAX_D, 0.0f);
      t.first[i] = t.limit[i] = 0;
      if (i >= count) {  // padding: sees nothing
        std::fill(t.q[i], t.q[i] + MAX_D, 0.0f);
        continue;
      }
      const int r = r0 + i, l = first + r / g, h = kh * g + r % g;
      const float* q = a.q + b * a.q_b + h * a.q_h + l * a.q_l;
      for (int d = 0; d < a.D; ++d) t.q[i][d] = q[d] * a.scale;
      int lo = 0, hi = limit(l);
      if (a.mask != nullptr) {
        const bool* m = a.mask + b * a.m_b + h * a.m_h + l * a.m_l;
        while (lo < hi && !m[lo * a.m_s]) ++lo;
        while (hi > lo && !m[(hi - 1) * a.m_s]) --hi;
        t.mask[i] = m;
      }
      t.first[i] = lo;
      t.limit[i] = hi;
      if (hi > lo) {
        base = std::min(base, lo);
        top = std::max(top, hi);
      }
    }
    return top;
  }

  void finish(const Tile& t, int r0, int count) const {
    const int g = group();
    for (int i = 0; i < count; ++i) {
      const int r = r0 + i, l = first + r / g, h = kh * g + r % g;
      float* out = a.out + b * a.out_b + h * a.out_h + l * a.out_l;
      const float inv = t.l[i] > 0.0f ? 1.0f / t.l[i] : 0.0f;  // nothing seen: zeros, as sdpa
      for (int d = 0; d < a.D; ++d) out[d] = t.o[i][d] * inv;
    }
  }

  void dispatch() const {
    switch (a.D / 16) {
      case 1: return run<1>();
      case 2: return run<2>();
      case 3: return run<3>();
      case 4: return run<4>();
      case 5: return run<5>();
      case 6: return run<6>();
      case 7: return run<7>();
      default: return run<8>();
    }
  }
};

// Query positions per task: whole tiles of rows where the group allows, at least 12.
int positions_per_task(int group) {
  int positions = std::lcm(MR, group) / group;
  while (positions < 12) positions *= 2;
  return positions;
}

}  // namespace

bool prefill_attention(const PrefillAttention& a) {
  if (!enabled.load(std::memory_order_relaxed)) return false;
  if (a.L < PREFILL_ATTENTION_MIN_L || a.D % 16 != 0 || a.D > MAX_D || a.Hq % a.Hk != 0) {
    return false;
  }
  const int per = positions_per_task(a.Hq / a.Hk);
  const int runs = (a.L + per - 1) / per, pairs = a.B * a.Hk;
  const int64_t stride = (a.S + KB - 1) / KB * KB + KB;  // blocks may start anywhere
  const size_t head = static_cast<size_t>(a.D) * stride;
  thread_local std::vector<float> buffer;  // the calling thread's: workers get its address
  buffer.resize(head * pairs);
  float* kt = buffer.data();
  parallel_for(pairs, [&](int pair) {
    const int b = pair / a.Hk, kh = pair % a.Hk;
    transpose_keys(a.k + b * a.k_b + kh * a.k_h, a.k_s, a.S, a.D, stride, kt + head * pair);
  });
  // Later positions (causal) see more keys: the pool claims tasks from the heaviest.
  parallel_for(pairs * runs, [&](int task) {
    const int run = runs - 1 - task % runs, pair = task / runs;
    Task{a, kt + head * pair, stride, pair / a.Hk, pair % a.Hk, run * per,
         std::min(a.L, (run + 1) * per)}.dispatch();
  });
  return true;
}

#else

bool prefill_attention(const PrefillAttention&) { return false; }

#endif

}  // namespace pipeserve
