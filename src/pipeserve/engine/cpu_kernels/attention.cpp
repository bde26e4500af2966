// Attention of one query row against one key / value head (attention.h).
//
// Scores: on AVX-512, 16 positions at a time, each position's dot product in its own
// accumulator and the 16 reduced together (reduce_sixteen), instead of one horizontal sum
// per position. Softmax: a vectorisable exp (vector_math.h). Values: the weighted sum with two
// positions in flight. Elsewhere (AVX2 builds, head sizes that are not a multiple of 16)
// the same steps with plain loops.

#include "attention.h"

#include <algorithm>
#include <utility>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "simd512.h"
#include "strided.h"
#include "vector_math.h"

namespace pipeserve {

namespace {

float max_of(const float* v, int n) {
  float part[16];
  std::fill(part, part + 16, -INFINITY);
  int i = 0;
  for (; i + 16 <= n; i += 16) {
    for (int k = 0; k < 16; ++k) part[k] = std::max(part[k], v[i + k]);
  }
  for (; i < n; ++i) part[0] = std::max(part[0], v[i]);
  return *std::max_element(part, part + 16);
}

// v[p] = exp(v[p] - top) in place.
void exponentiate(float* v, int n, float top) {
  for (int i = 0; i < n; ++i) v[i] = fast_exp(v[i] - top);
}

// The sum of v[0..n) in 16 running sums, v[i] into sum i % 16.
float sum_of(const float* v, int n) {
  float part[16] = {};
  int i = 0;
  for (; i + 16 <= n; i += 16) {
    for (int k = 0; k < 16; ++k) part[k] += v[i + k];
  }
  for (; i < n; ++i) part[i % 16] += v[i];
  float total = 0.0f;
  for (float s : part) total += s;
  return total;
}

// Plain loops: any head size, any build.
void scores_plain(const HeadKeysValues& h, const float* q, int seen, float scale, float* out) {
  for (int p = 0; p < seen; ++p) out[p] = dot(q, 1, h.keys + p * h.key_step, 1, h.dim) * scale;
}

void values_plain(const HeadKeysValues& h, const float* weights, int seen, float inv_total,
                  float* out) {
  std::fill(out, out + h.dim, 0.0f);
  for (int p = 0; p < seen; ++p) axpy(weights[p], h.values + p * h.value_step, 1, out, h.dim);
  for (int d = 0; d < h.dim; ++d) out[d] *= inv_total;
}

#if defined(__AVX512F__)
// Scores of positions p0 .. p0 + count - 1 (count <= 16): position p0 + 4i + j accumulates
// in slot 4j + i, which reduce_sixteen sums into lane 4i + j. A slot's arithmetic is the
// same in a full block and a partial one.
template <int VECTORS>
void score_block(const HeadKeysValues& h, const float* q, int p0, int count, float scale,
                 float* out) {
  __m512 acc[16];
  PIPESERVE_UNROLL
  for (int s = 0; s < 16; ++s) acc[s] = _mm512_setzero_ps();
  const float* keys = h.keys + p0 * h.key_step;
  PIPESERVE_UNROLL
  for (int v = 0; v < VECTORS; ++v) {
    const __m512 qv = _mm512_loadu_ps(q + 16 * v);
    PIPESERVE_UNROLL
    for (int s = 0; s < 16; ++s) {
      const int p = 4 * (s % 4) + s / 4;
      if (count == 16 || p < count) {
        acc[s] = _mm512_fmadd_ps(qv, _mm512_loadu_ps(keys + p * h.key_step + 16 * v), acc[s]);
      }
    }
  }
  alignas(64) float sums[16];
  _mm512_store_ps(sums, _mm512_mul_ps(reduce_sixteen(acc), _mm512_set1_ps(scale)));
  std::memcpy(out + p0, sums, static_cast<size_t>(count) * sizeof(float));
}

template <int VECTORS>
void values_avx512(const HeadKeysValues& h, const float* weights, int seen, float inv_total,
                   float* out) {
  __m512 even[VECTORS], odd[VECTORS];
  PIPESERVE_UNROLL
  for (int v = 0; v < VECTORS; ++v) even[v] = odd[v] = _mm512_setzero_ps();
  int p = 0;
  for (; p + 2 <= seen; p += 2) {
    const __m512 w0 = _mm512_set1_ps(weights[p]), w1 = _mm512_set1_ps(weights[p + 1]);
    const float* v0 = h.values + p * h.value_step;
    const float* v1 = v0 + h.value_step;
    PIPESERVE_UNROLL
    for (int v = 0; v < VECTORS; ++v) {
      even[v] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(v0 + 16 * v), even[v]);
      odd[v] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(v1 + 16 * v), odd[v]);
    }
  }
  if (p < seen) {
    const __m512 w0 = _mm512_set1_ps(weights[p]);
    const float* v0 = h.values + p * h.value_step;
    PIPESERVE_UNROLL
    for (int v = 0; v < VECTORS; ++v) {
      even[v] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(v0 + 16 * v), even[v]);
    }
  }
  const __m512 inv = _mm512_set1_ps(inv_total);
  PIPESERVE_UNROLL
  for (int v = 0; v < VECTORS; ++v) {
    _mm512_storeu_ps(out + 16 * v, _mm512_mul_ps(_mm512_add_ps(even[v], odd[v]), inv));
  }
}

template <int VECTORS>
void scores_avx512(const HeadKeysValues& h, const float* q, int seen, float scale, float* out) {
  for (int p0 = 0; p0 < seen; p0 += 16) {
    score_block<VECTORS>(h, q, p0, std::min(16, seen - p0), scale, out);
  }
}
#endif

using ScoresFn = void (*)(const HeadKeysValues&, const float*, int, float, float*);
using ValuesFn = void (*)(const HeadKeysValues&, const float*, int, float, float*);

// The kernels for a head size: AVX-512 for 16 .. 128 in steps of 16, else plain loops.
std::pair<ScoresFn, ValuesFn> kernels_for(int dim) {
#if defined(__AVX512F__)
  switch (dim) {
    case 16: return {scores_avx512<1>, values_avx512<1>};
    case 32: return {scores_avx512<2>, values_avx512<2>};
    case 48: return {scores_avx512<3>, values_avx512<3>};
    case 64: return {scores_avx512<4>, values_avx512<4>};
    case 80: return {scores_avx512<5>, values_avx512<5>};
    case 96: return {scores_avx512<6>, values_avx512<6>};
    case 112: return {scores_avx512<7>, values_avx512<7>};
    case 128: return {scores_avx512<8>, values_avx512<8>};
    default: break;
  }
#endif
  return {scores_plain, values_plain};
}

}  // namespace

void apply_mask(const QueryMask& mask, int seen, float* scores) {
  if (mask.base == nullptr) return;
  if (mask.is_bool) {
    const bool* m = static_cast<const bool*>(mask.base);
    for (int p = 0; p < seen; ++p) {
      if (!m[p * mask.step]) scores[p] = -INFINITY;
    }
  } else {
    const float* m = static_cast<const float*>(mask.base);
    for (int p = 0; p < seen; ++p) scores[p] += m[p * mask.step];
  }
}

void attend_query(const HeadKeysValues& head, const float* q, int seen, float scale,
                  const QueryMask& mask, float* out) {
  thread_local std::vector<float> buffer;
  buffer.resize(std::max<size_t>(buffer.size(), static_cast<size_t>(seen) + 16));
  float* weights = buffer.data();
  const auto [scores, values] = kernels_for(head.dim);
  scores(head, q, seen, scale, weights);
  apply_mask(mask, seen, weights);
  const float top = max_of(weights, seen);
  if (top == -INFINITY) {  // every position masked: zeros, like sdpa
    std::fill(out, out + head.dim, 0.0f);
    return;
  }
  exponentiate(weights, seen, top);
  // The sums start at the first position that counts, so that left padding (masked
  // positions in front, as many as the batch's longest row needs) leaves the numbers
  // of a row exactly as they are without it.
  int first = 0;
  while (weights[first] == 0.0f) ++first;  // the top score's weight is 1
  HeadKeysValues from_first = head;
  from_first.values += first * head.value_step;
  values(from_first, weights + first, seen - first, 1.0f / sum_of(weights + first, seen - first),
         out);
}

void for_each_query_run(int batch, int kv_heads, int queries, int64_t work,
                        const std::function<void(int b, int kh, int first, int last)>& run) {
  const int pairs = batch * kv_heads;
  const int runs = std::min(queries, std::max(1, (2 * threads() + pairs - 1) / pairs));
  auto task = [&](int t) {
    const int r = t % runs, b = t / runs / kv_heads, kh = t / runs % kv_heads;
    run(b, kh, queries * r / runs, queries * (r + 1) / runs);
  };
  const int tasks = pairs * runs;
  if (work < PARALLEL_ATTENTION) {
    for (int t = 0; t < tasks; ++t) task(t);
  } else {
    parallel_for(tasks, task);
  }
}

}  // namespace pipeserve
