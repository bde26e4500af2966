// Attention of one query row against a quantized key / value head (attention_quantized.h).
//
// The codes are read as stored (1 byte per code at 8 bits, half a byte at 4) and never
// expanded into a float copy of the cache: a key's score is, per group g,
// scale_g * (q_g . codes_g) + bias_g * sum(q_g); a value's contribution is w * scale_g *
// codes_g, its biases summed apart (sum_p w_p bias_pg) and added once per group. On
// AVX-512 the scores take 16 positions at a time, each position's dot product in its own
// accumulator and the 16 reduced together (reduce_sixteen), as attention.cpp does for
// float keys; 16 codes are widened to floats with one vpmovzxbd (8 bits) or a nibble
// split + interleave first (4 bits). Elsewhere plain loops.

#include "attention_quantized.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#include "simd512.h"
#include "vector_math.h"

namespace pipeserve {

namespace {

constexpr int MAX_GROUPS = 16;  // groups per head (head size / group size)

inline const uint8_t* bytes_of(const uint32_t* words) {
  return reinterpret_cast<const uint8_t*>(words);
}

template <int BITS>
inline float code_at(const uint8_t* bytes, int i) {
  if constexpr (BITS == 8) {
    return static_cast<float>(bytes[i]);
  } else {
    return static_cast<float>((bytes[i >> 1] >> ((i & 1) * 4)) & 15);
  }
}

template <int BITS>
void scores_plain(const QuantizedHead& h, const float* q, const float* qsums, int seen,
                  float scale, float* out) {
  const int gs = h.group_size, groups = h.dim / gs;
  for (int p = 0; p < seen; ++p) {
    const uint8_t* codes = bytes_of(h.keys.words + p * h.keys.word_step);
    const float* s = h.keys.scales + p * h.keys.group_step;
    const float* b = h.keys.biases + p * h.keys.group_step;
    float total = 0.0f;
    for (int g = 0; g < groups; ++g) {
      float dot = 0.0f;
      for (int i = g * gs; i < (g + 1) * gs; ++i) dot += q[i] * code_at<BITS>(codes, i);
      total += s[g] * dot + b[g] * qsums[g];
    }
    out[p] = total * scale;
  }
}

template <int BITS>
void values_plain(const QuantizedHead& h, const float* weights, int seen, float inv_total,
                  float* out) {
  const int gs = h.group_size, groups = h.dim / gs;
  float bias_sums[MAX_GROUPS] = {};
  std::fill(out, out + h.dim, 0.0f);
  for (int p = 0; p < seen; ++p) {
    const uint8_t* codes = bytes_of(h.values.words + p * h.values.word_step);
    const float* s = h.values.scales + p * h.values.group_step;
    const float* b = h.values.biases + p * h.values.group_step;
    for (int g = 0; g < groups; ++g) {
      const float a = weights[p] * s[g];
      bias_sums[g] += weights[p] * b[g];
      for (int i = g * gs; i < (g + 1) * gs; ++i) out[i] += a * code_at<BITS>(codes, i);
    }
  }
  for (int i = 0; i < h.dim; ++i) out[i] = (out[i] + bias_sums[i / gs]) * inv_total;
}

#if defined(__AVX512F__)
// 16 codes from `bytes` (code 0 at the first byte's low bits) as floats.
template <int BITS>
inline __m512 codes16(const uint8_t* bytes) {
  if constexpr (BITS == 8) {
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes));
    return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(raw));
  } else {
    const __m128i raw = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(bytes));
    const __m128i nibble = _mm_set1_epi8(0x0F);
    const __m128i low = _mm_and_si128(raw, nibble);
    const __m128i high = _mm_and_si128(_mm_srli_epi16(raw, 4), nibble);
    return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_unpacklo_epi8(low, high)));
  }
}

// VG: 16-wide vectors per group (group size / 16).
template <int BITS, int VG>
void scores_avx512(const QuantizedHead& h, const float* q, const float* qsums, int seen,
                   float scale, float* out) {
  const int groups = h.dim / h.group_size;
  const QuantizedRows& k = h.keys;
  for (int p0 = 0; p0 < seen; p0 += 16) {
    const int count = std::min(16, seen - p0);
    __m512 total = _mm512_setzero_ps();
    for (int g = 0; g < groups; ++g) {
      __m512 acc[16];
      PIPESERVE_UNROLL
      for (int s = 0; s < 16; ++s) acc[s] = _mm512_setzero_ps();
      PIPESERVE_UNROLL
      for (int v = 0; v < VG; ++v) {
        const int first = (g * VG + v) * 16;
        const __m512 qv = _mm512_loadu_ps(q + first);
        PIPESERVE_UNROLL
        for (int s = 0; s < 16; ++s) {
          const int p = 4 * (s % 4) + s / 4;  // lane p after reduce_sixteen
          if (count == 16 || p < count) {
            const uint8_t* codes = bytes_of(k.words + (p0 + p) * k.word_step) + first * BITS / 8;
            acc[s] = _mm512_fmadd_ps(qv, codes16<BITS>(codes), acc[s]);
          }
        }
      }
      alignas(64) float scales[16] = {}, biases[16] = {};
      for (int i = 0; i < count; ++i) {
        scales[i] = k.scales[(p0 + i) * k.group_step + g];
        biases[i] = k.biases[(p0 + i) * k.group_step + g];
      }
      total = _mm512_fmadd_ps(reduce_sixteen(acc), _mm512_load_ps(scales), total);
      total = _mm512_fmadd_ps(_mm512_load_ps(biases), _mm512_set1_ps(qsums[g]), total);
    }
    alignas(64) float sums[16];
    _mm512_store_ps(sums, _mm512_mul_ps(total, _mm512_set1_ps(scale)));
    std::memcpy(out + p0, sums, static_cast<size_t>(count) * sizeof(float));
  }
}

template <int BITS, int VG>
void values_avx512(const QuantizedHead& h, const float* weights, int seen, float inv_total,
                   float* out) {
  const int groups = h.dim / h.group_size;
  const QuantizedRows& v = h.values;
  const __m512 inv = _mm512_set1_ps(inv_total);
  for (int g = 0; g < groups; ++g) {
    __m512 acc[VG];
    PIPESERVE_UNROLL
    for (int i = 0; i < VG; ++i) acc[i] = _mm512_setzero_ps();
    float bias_sum = 0.0f;
    const int first = g * VG * 16;
    for (int p = 0; p < seen; ++p) {
      const float w = weights[p];
      const __m512 a = _mm512_set1_ps(w * v.scales[p * v.group_step + g]);
      bias_sum += w * v.biases[p * v.group_step + g];
      const uint8_t* codes = bytes_of(v.words + p * v.word_step) + first * BITS / 8;
      PIPESERVE_UNROLL
      for (int i = 0; i < VG; ++i) {
        acc[i] = _mm512_fmadd_ps(a, codes16<BITS>(codes + 16 * i * BITS / 8), acc[i]);
      }
    }
    const __m512 bias = _mm512_set1_ps(bias_sum);
    PIPESERVE_UNROLL
    for (int i = 0; i < VG; ++i) {
      _mm512_storeu_ps(out + first + 16 * i, _mm512_mul_ps(_mm512_add_ps(acc[i], bias), inv));
    }
  }
}
#endif

using ScoresFn = void (*)(const QuantizedHead&, const float*, const float*, int, float, float*);
using ValuesFn = void (*)(const QuantizedHead&, const float*, int, float, float*);

template <int BITS>
std::pair<ScoresFn, ValuesFn> kernels_of_bits(int group_size) {
#if defined(__AVX512F__)
  switch (group_size) {
    case 32: return {scores_avx512<BITS, 2>, values_avx512<BITS, 2>};
    case 64: return {scores_avx512<BITS, 4>, values_avx512<BITS, 4>};
    case 128: return {scores_avx512<BITS, 8>, values_avx512<BITS, 8>};
    default: break;
  }
#endif
  (void)group_size;
  return {scores_plain<BITS>, values_plain<BITS>};
}

std::pair<ScoresFn, ValuesFn> kernels_for(int bits, int group_size) {
  return bits == 8 ? kernels_of_bits<8>(group_size) : kernels_of_bits<4>(group_size);
}

// The sum of v[0..n) in 16 running sums, v[i] into sum i % 16 (as attention.cpp).
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

}  // namespace

bool quantized_shape_ok(int dim, int group_size, int bits) {
  return (bits == 4 || bits == 8) && (group_size == 32 || group_size == 64 || group_size == 128) &&
         dim > 0 && dim % group_size == 0 && dim / group_size <= MAX_GROUPS;
}

void attend_query_quantized(const QuantizedHead& head, const float* q, int seen, float scale,
                            const QueryMask& mask, float* out) {
  thread_local std::vector<float> buffer;
  buffer.resize(std::max<size_t>(buffer.size(), static_cast<size_t>(seen) + 16));
  float* weights = buffer.data();
  float qsums[MAX_GROUPS];
  for (int g = 0; g < head.dim / head.group_size; ++g) {
    const float* part = q + g * head.group_size;
    qsums[g] = sum_of(part, head.group_size);
  }
  const auto [scores, values] = kernels_for(head.bits, head.group_size);
  scores(head, q, qsums, seen, scale, weights);
  apply_mask(mask, seen, weights);
  const float top = *std::max_element(weights, weights + seen);
  if (top == -INFINITY) {  // every position masked: zeros, like sdpa
    std::fill(out, out + head.dim, 0.0f);
    return;
  }
  for (int p = 0; p < seen; ++p) weights[p] = fast_exp(weights[p] - top);
  // From the first position that counts: left padding leaves a row's numbers as they are.
  int first = 0;
  while (weights[first] == 0.0f) ++first;  // the top score's weight is 1
  QuantizedHead from_first = head;
  QuantizedRows& v = from_first.values;
  v.words += first * v.word_step;
  v.scales += first * v.group_step;
  v.biases += first * v.group_step;
  values(from_first, weights + first, seen - first,
         1.0f / sum_of(weights + first, seen - first), out);
}

void quantize_row(const float* x, int dim, int group_size, int bits, uint32_t* words,
                  float* scales, float* biases) {
  // MLX's affine quantize (mlx/backend/cpu/quantized.cpp), step for step: the group's
  // edge of larger magnitude lands exactly on a code (0 or n_bins), codes rounded to
  // nearest even and clamped.
  const float n_bins = static_cast<float>((1 << bits) - 1);
  const float eps = 1e-7f;
  const int per_word = 32 / bits;
  for (int g = 0; g < dim / group_size; ++g) {
    const float* w = x + g * group_size;
    float w_min = INFINITY, w_max = -INFINITY;
    for (int j = 0; j < group_size; ++j) {
      w_max = std::max(w_max, w[j]);
      w_min = std::min(w_min, w[j]);
    }
    const bool low_edge = std::abs(w_min) > std::abs(w_max);
    float scale = std::max((w_max - w_min) / n_bins, eps);
    scale = low_edge ? scale : -scale;
    const float edge = low_edge ? w_min : w_max;
    const float q0 = std::rint(edge / scale);
    float bias = 0.0f;
    if (q0 != 0.0f) {
      scale = edge / q0;
      bias = edge;
    }
    uint32_t* out = words + g * group_size / per_word;
    for (int j = 0; j < group_size / per_word; ++j) {
      uint64_t word = 0;
      for (int k = 0; k < per_word; ++k) {
        float code = std::rint((w[j * per_word + k] - bias) / scale);
        code = std::min(std::max(code, 0.0f), n_bins);
        word |= static_cast<uint64_t>(code) << (k * bits);
      }
      out[j] = static_cast<uint32_t>(word);
    }
    scales[g] = scale;
    biases[g] = bias;
  }
}

}  // namespace pipeserve
