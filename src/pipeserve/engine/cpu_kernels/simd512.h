// AVX-512 helpers shared by the kernels (affine_qmm.cpp, attention.cpp).
#pragma once

#include <immintrin.h>

#define PIPESERVE_UNROLL _Pragma("GCC unroll 16")

#if defined(__AVX512F__)
namespace pipeserve {

// The sums of 16 vectors' lanes, lane 4k + t the sum of v[4t + k], in the very order of
// _mm512_reduce_add_ps (lane l + lane l + 8, then + 4, + 2, + 1; a sum's operands
// commute exactly), so an output is bit-identical whichever of the two reduced it.
inline __m512 reduce_sixteen(const __m512 (&v)[16]) {
  __m512 b[8], c[4], d[2];
  PIPESERVE_UNROLL
  for (int k = 0; k < 8; ++k) {  // blocks: v[2k] lanes 0-3 + 8-11, 4-7 + 12-15, then v[2k + 1]'s
    b[k] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * k], v[2 * k + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_f32x4(v[2 * k], v[2 * k + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  }
  PIPESERVE_UNROLL
  for (int k = 0; k < 4; ++k) {  // block t: v[4k + t]'s 8 sums folded to 4
    c[k] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * k], b[2 * k + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(b[2 * k], b[2 * k + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  }
  PIPESERVE_UNROLL
  for (int k = 0; k < 2; ++k) {  // 4 -> 2 within each block
    d[k] = _mm512_add_ps(_mm512_shuffle_ps(c[2 * k], c[2 * k + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(c[2 * k], c[2 * k + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  }
  return _mm512_add_ps(_mm512_shuffle_ps(d[0], d[1], _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_ps(d[0], d[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

}  // namespace pipeserve
#endif
