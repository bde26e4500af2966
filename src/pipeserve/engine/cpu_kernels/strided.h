// Row addressing and small vector loops shared by the fused ops (fused.cpp,
// fused_step.cpp, fused_layer.cpp).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "mlx/array.h"
#include "mlx/backend/common/utils.h"

#include "kernels.h"
#include "vector_math.h"

namespace pipeserve {

// Offset of each row's first element (a row: the last axis), for any strides.
inline std::vector<int64_t> row_offsets(const mlx::core::array& a) {
  const int cols = a.shape(-1);
  const size_t rows = cols == 0 ? 0 : a.size() / cols;
  std::vector<int64_t> out(rows);
  for (size_t r = 0; r < rows; ++r) {
    out[r] = a.flags().row_contiguous ? static_cast<int64_t>(r) * cols
                                      : mlx::core::elem_to_loc(static_cast<int>(r * cols), a);
  }
  return out;
}

// a . b over n elements; unit strides take 16 independent partial sums (vectorised).
inline float dot(const float* a, int64_t as, const float* b, int64_t bs, int n) {
  if (as != 1 || bs != 1) {
    float sum = 0.0f;
    for (int i = 0; i < n; ++i) sum += a[i * as] * b[i * bs];
    return sum;
  }
  float acc[16] = {};
  int i = 0;
  for (; i + 16 <= n; i += 16) {
    for (int j = 0; j < 16; ++j) acc[j] += a[i + j] * b[i + j];
  }
  float sum = 0.0f;
  for (int j = 0; j < 16; ++j) sum += acc[j];
  for (; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

// out += p * v over n elements.
inline void axpy(float p, const float* v, int64_t step, float* out, int n) {
  if (step == 1) {
    for (int i = 0; i < n; ++i) out[i] += p * v[i];
  } else {
    for (int i = 0; i < n; ++i) out[i] += p * v[i * step];
  }
}

// Elements of SwiGLU worth a fork / join of the kernels' pool (one exp each).
constexpr int64_t PARALLEL_SWIGLU = 4096;

// silu(gate) * up over n contiguous elements: a loop the compiler vectorises.
inline void swiglu_span(const float* __restrict gate, const float* __restrict up,
                        float* __restrict out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = gate[i] / (1.0f + fast_exp(-gate[i])) * up[i];
}

// gelu_approx(gate) * up (Gemma's GeGLU): MLX's 0.5 g (1 + tanh(y)), y = sqrt(2 / pi)
// (g + 0.044715 g^3), written as g / (1 + exp(-2 y)) (the same function).
inline void geglu_span(const float* __restrict gate, const float* __restrict up,
                       float* __restrict out, int64_t n) {
  constexpr float minus_two_c = -2.0f * 0.7978845608028654f;
  for (int64_t i = 0; i < n; ++i) {
    const float g = gate[i];
    out[i] = g / (1.0f + fast_exp(minus_two_c * (g + 0.044715f * g * g * g))) * up[i];
  }
}

// silu(gate) * up (gelu: gelu_approx(gate) * up) for each row of a fused gate/up
// projection: row r's gate at base + rows[r], its up `half * step` after it, elements
// `step` apart; out (rows, half) contiguous. Split over the kernels' pool in runs of
// elements (each computed alone, so the result does not depend on the split). Not from
// inside a parallel_for job.
inline void swiglu_rows(const float* base, const std::vector<int64_t>& rows, int64_t step,
                        int half, float* out, bool gelu = false) {
  const int64_t total = static_cast<int64_t>(rows.size()) * half;
  auto run = [&](int64_t begin, int64_t end) {
    for (int64_t row = begin / half, e = begin; e < end; ++row) {
      const float* gate = base + rows[row];
      const float* up = gate + half * step;
      const int64_t first = e - row * half, last = std::min<int64_t>(half, end - row * half);
      if (step == 1) {  // the common layout
        (gelu ? geglu_span : swiglu_span)(gate + first, up + first, out + e, last - first);
        e += last - first;
        continue;
      }
      for (int64_t i = first; i < last; ++i, ++e) {
        const float g = gate[i * step], u = up[i * step];
        if (gelu) {
          geglu_span(&g, &u, out + e, 1);
        } else {
          out[e] = g / (1.0f + fast_exp(-g)) * u;
        }
      }
    }
  };
  if (total < PARALLEL_SWIGLU) {
    run(0, total);
    return;
  }
  const int chunks = static_cast<int>(std::min<int64_t>(4 * threads(), total / 1024));
  parallel_for(chunks, [&](int c) { run(total * c / chunks, total * (c + 1) / chunks); });
}

}  // namespace pipeserve
